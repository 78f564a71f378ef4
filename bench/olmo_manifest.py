"""Manifest job throughput on an OLMo numpy token mix (uint32 tokens, fixed-length instances).

Writes a mix of `--files` raw uint32 token files (~1.6 GB at the defaults, each with a few
trailing tokens that make no whole instance) and its index JSON, then times, in one run:

1. two references, one plain Python process each, no Beam, no part files, no manifest: each
   file memory-mapped and its [instances, L] rows hashed with the project's hash
   (`hash_runs`), the fastest way one process has; and each file read with `np.fromfile`
   (a copy) and hashed the same way;
2. the job's own work per core: each range of instances hashed, made into manifest rows and
   written as a part file, one range after the other in this process (thread CPU seconds),
   at the mix's sequence length and over the same files cut at OLMo 3's 8,192 tokens;
3. `tally manifest INDEX.json` (`build_manifest`) on the runners of `--runners`: FnApiRunner
   multi_processing with `--workers` processes, a local Dask cluster of `--workers`
   processes (and FnApiRunner in_memory); and each over a mix of one instance, which is the
   runner's fixed cost (starting workers or a cluster, the pipeline);
4. the driver's per-record share (the manifest read, fingerprinted and written again), which
   does not scale with workers.

Each run's hashes must equal the references'. Prints instances/s, GB/s of tokens, the ratio
to the memory-map reference, the largest worker RSS seen (sampled every 0.2 s), and an
extrapolation to the OLMo 3 pretraining mix from (2) and (4). By default the files are read
from the page cache (they were just written); `--cold` drops them from it (fsync, then
posix_fadvise DONTNEED) before every timed read, so that they come from the disk.

    python -m bench.olmo_manifest [--files 12] [--sequence-length 2048] [--workers 2]
        [--runners multi_processing,dask] [--cold] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tally.audit.core.hashing import hash_runs  # noqa: E402
from tally.pipeline.corpus import open_corpus  # noqa: E402
from tally.pipeline.manifest import (  # noqa: E402
    ROW_GROUP_RECORDS,
    Fingerprint,
    build_manifest,
    manifest_rows,
)
from tally.pipeline.olmo import load_index, write_mix  # noqa: E402
from tally.pipeline.runners import RunnerSpec  # noqa: E402

LABELS = ("web", "code", "math", "books")
# The OLMo 3 pretraining mix, as assumed for the extrapolation: ~5.93T tokens of Dolma 3 as
# 724M instances of 8,192 tokens, uint32, in ~950 token files.
OLMO3_INSTANCES = 724_000_000
OLMO3_LENGTH = 8192
OLMO3_FILES = 950
CHUNK = 20_000  # instances per range: build_manifest's default chunk_records


def make_mix(root: Path, files: int, tokens_per_file: int, length: int) -> Path:
    def gen():
        rng = np.random.default_rng(0)
        for i in range(files):
            # A vocabulary of ~200k ids, as Dolma 3's tokenizer; a few trailing tokens.
            n = tokens_per_file + int(rng.integers(0, length))
            yield LABELS[i % len(LABELS)], rng.integers(0, 200_000, n, dtype=np.uint32)
    return write_mix(root, gen(), length, dtype="uint32", tokenizer="bench")


def reference(index_path: Path, read: str) -> np.ndarray:
    """Every instance's hash in one process: files memory-mapped (`read="mmap"`) or read with
    np.fromfile (`read="fromfile"`)."""
    index = load_index(index_path)
    out = []
    for f in index.files:
        count = f.n_instances * f.sequence_length
        if read == "mmap":
            tokens = np.memmap(f.path, np.dtype("<u4"), mode="r", shape=(count,))
        else:
            tokens = np.fromfile(f.path, np.dtype("<u4"), count=count)
        starts = np.arange(f.n_instances, dtype=np.int64) * f.sequence_length
        out.append(hash_runs(tokens.view(np.int32), starts,
                             np.full(f.n_instances, f.sequence_length)))
        del tokens
    return np.concatenate(out)


def drop_cache(index_path: Path) -> None:
    """Drop the mix's files from the page cache, so that the next read comes from the disk."""
    for f in load_index(index_path).files:
        fd = os.open(f.path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a file just written) stay in the cache
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class PeakRss:
    """Samples the RSS of this process's descendants (the workers) every 0.2 s."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakRss:
        import psutil

        def run() -> None:
            me = psutil.Process()
            while not self._stop.wait(0.2):
                for p in me.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        self.peak = max(self.peak, p.memory_info().rss)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=12)
    ap.add_argument("--tokens-per-file", type=int, default=1 << 25,
                    help="tokens per file, plus up to one instance of trailing tokens "
                         "(default 2**25: 128 MiB of uint32)")
    ap.add_argument("--sequence-length", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--runners", default="multi_processing,dask",
                    help="comma-separated: in_memory, multi_processing, dask")
    ap.add_argument("--cold", action="store_true",
                    help="drop the files from the page cache before every timed run")
    ap.add_argument("--dir", help="where the mix goes (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the mix and the manifests")
    args = ap.parse_args(argv)
    logging.getLogger().setLevel(logging.ERROR)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tally-olmo-bench-"))
    res: dict = {}
    try:
        t0 = time.perf_counter()
        index = make_mix(root / "mix", args.files, args.tokens_per_file, args.sequence_length)
        tiny = write_mix(root / "tiny", [("web", np.arange(args.sequence_length))],
                         args.sequence_length, dtype="uint32", tokenizer="bench")
        ix = load_index(index)
        n, length = ix.total_instances, ix.sequence_length
        size = n * length * 4
        print(f"mix: {args.files} files, {n:,} instances of {length:,} uint32 tokens = "
              f"{size / 1e9:.2f} GB (written in {time.perf_counter() - t0:.0f} s); files "
              + ("dropped from the page cache before each run" if args.cold else
                 "in the page cache"))
        res.update(instances=n, sequence_length=length, bytes=size, cold=args.cold, runs={})
        want = None
        for read in ("mmap", "fromfile"):
            if args.cold:
                drop_cache(index)
            t0 = time.perf_counter()
            got = reference(index, read)
            dt = time.perf_counter() - t0
            assert want is None or np.array_equal(got, want)
            want = got
            res[f"reference_{read}_s"] = dt
            print(f"reference, one process, {read} + hash_runs: {n / dt:,.0f} instances/s, "
                  f"{size / 1e9 / dt:.2f} GB/s")
        ref = res["reference_mmap_s"]
        # The job's own work, range by range in this process, without Beam: what each worker
        # does (hash a range, build its rows, write its part file), in thread CPU seconds.
        # At the mix's sequence length, and over the same files cut at OLMo 3's 8,192 tokens.
        for seq in (length, OLMO3_LENGTH):
            if args.cold:
                drop_cache(index)
            cpu, wall, rows = work_per_core(root, index, seq)
            res[f"work_cpu_s_{seq}"] = cpu
            print(f"the job's work per core, ranges of {CHUNK:,} instances of {seq:,} tokens "
                  f"one after the other: {rows / cpu:,.0f} instances/s, "
                  f"{rows * seq * 4 / 1e9 / cpu:.2f} GB/s of thread CPU "
                  f"({rows * seq * 4 / 1e9 / wall:.2f} GB/s wall)")
        specs = {"in_memory": RunnerSpec("direct"),
                 "multi_processing": RunnerSpec("direct", mode="multi_processing",
                                                workers=args.workers),
                 "dask": RunnerSpec("dask", workers=args.workers)}
        names = {"in_memory": "FnApiRunner in_memory",
                 "multi_processing": f"FnApiRunner multi_processing, {args.workers} workers",
                 "dask": f"Dask local cluster, {args.workers} workers"}
        out = root / "manifest.parquet"
        for key in args.runners.split(","):
            t0 = time.perf_counter()
            build_manifest(tiny, root / "tiny.parquet", runner=specs[key])
            fixed = time.perf_counter() - t0
            if args.cold:
                drop_cache(index)
            with PeakRss() as rss:
                t0 = time.perf_counter()
                s = build_manifest(index, out, runner=specs[key])
                dt = time.perf_counter() - t0
            got = pq.read_table(out, columns=["content_hash"])["content_hash"].to_numpy()
            assert s.records == n and np.array_equal(got, want), key
            res["runs"][key] = {"seconds": dt, "fixed_seconds": fixed,
                                "instances_s": n / dt, "gb_s": size / 1e9 / dt,
                                "ratio": ref / dt, "worker_peak_rss": rss.peak}
            print(f"{names[key]}: {dt:.2f} s, {n / dt:,.0f} instances/s, "
                  f"{size / 1e9 / dt:.2f} GB/s, ratio to reference {ref / dt:.2f}; the same "
                  f"job over one instance {fixed:.2f} s; largest worker RSS "
                  f"{rss.peak / 2**20:,.0f} MiB")
        # The driver's share, which does not scale with workers: it reads every part back,
        # fingerprints it and writes it into the manifest.
        t0 = time.perf_counter()
        table = pq.read_table(out)
        Fingerprint().update(table)
        pq.write_table(table, root / "copy.parquet", row_group_size=ROW_GROUP_RECORDS)
        drv = time.perf_counter() - t0
        res["driver_records_s"] = n / drv
        print(f"driver: the manifest read, fingerprinted and written again, {n / drv:,.0f} "
              "records/s")
        res["extrapolation"] = extrapolate(res, args.workers)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return res


def work_per_core(root: Path, index: Path, seq: int) -> tuple[float, float, int]:
    """(thread CPU s, wall s, instances) of the job's per-range work over the mix's files cut
    at `seq` tokens, one range after the other in this process."""
    shards = open_corpus([f.path for f in load_index(index).files], sequence_length=seq,
                         dtype="uint32").shards
    part = root / "part.parquet"
    cpu0, wall0, rows = time.thread_time(), time.perf_counter(), 0
    for shard in shards:
        for a in range(0, shard.num_records, CHUNK):
            table = manifest_rows(shard, a, min(a + CHUNK, shard.num_records))
            pq.write_table(table, part)
            rows += table.num_rows
    return time.thread_time() - cpu0, time.perf_counter() - wall0, rows


def extrapolate(res: dict, workers: int) -> dict:
    """Hours for the OLMo 3 mix at the job's measured per-core rate at 8,192 tokens (the
    workers' share, which scales with workers as long as storage keeps up) plus the driver's
    join (one core, whatever the workers). A cluster's start-up, seconds to minutes, is left
    out."""
    total = OLMO3_INSTANCES * OLMO3_LENGTH * 4
    cpu = res[f"work_cpu_s_{OLMO3_LENGTH}"]
    rows8k = res["instances"] * res["sequence_length"] // OLMO3_LENGTH
    per_core = rows8k * OLMO3_LENGTH * 4 / cpu  # bytes/s
    drv = OLMO3_INSTANCES / res["driver_records_s"] / 3600
    out = {"bytes": total, "per_core_gb_s": per_core / 1e9, "driver_hours": drv}
    print(f"OLMo 3 mix (assumed {OLMO3_INSTANCES / 1e6:,.0f}M instances of {OLMO3_LENGTH:,} "
          f"uint32 tokens = {total / 1e12:.1f} TB in ~{OLMO3_FILES} files), at the job's "
          f"{per_core / 1e9:.2f} GB/s per core and the driver's "
          f"{res['driver_records_s']:,.0f} rows/s ({drv:.2f} h):")
    for cores in (2, 64):
        hours = total / (per_core * cores) / 3600 + drv
        out[f"hours_{cores}"] = hours
        print(f"  {cores} workers: {hours:,.2f} h, if storage delivers "
              f"{per_core * cores / 1e9:,.1f} GB/s")
    return out


if __name__ == "__main__":
    main()
