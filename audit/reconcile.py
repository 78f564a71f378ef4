"""The reconcile job (Beam): a run's consumption against the corpus manifest.

Inputs are a frozen list of consumption files: the run's published spool segment files, or an
export of the ledger. The consumption is cut into record-key buckets and joined with the
manifest bucket by bucket (CoGroupByKey on the bucket number; each bucket's manifest rows are
read by key range where the bucket is computed, so there are no side inputs). The rows travel
between the two stages as Arrow IPC bucket files (audit.key_buckets): the shuffle carries only
references to them, and each bucket is computed with numpy over its columns
(audit.bucket_stats), never one Python object per row. Each bucket yields partial aggregates
(sums, and elementwise maxima for the first bad step) that one reduce merges; per-record rows are
written as part files that the driver joins. Only Create, ParDo, GroupByKey and Flatten are
used, the primitives every runner translates, Dask's included.

Restart lineage (`audit.ledger.rolled_back_from`) splits rows into effective and rolled back;
rolled-back rows are compared step by step with the surviving replay.
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from audit import bucket_stats, key_buckets
from audit import spool as sp
from audit.errors import TallyError
from audit.ledger import Ledger, rolled_back_from
from audit.spool import BadFile, read_checked
from pipeline.corpus import read_rows
from pipeline.runners import RunnerSpec, pipeline

COLUMNS = ("attempt", "host", "step", "row", "record_key", "offset", "n_tokens", "content_hash",
           "epoch")
# Memory a bucket takes in its worker: per consumption row (its columns, sort keys, masks) and
# per manifest record (its columns, per-record results, one byte per host).
BYTES_PER_ROW, BYTES_PER_RECORD = 120, 160
# Buckets in memory at once, with room to spare: one per worker process plus the runner's.
BUCKETS_IN_FLIGHT = 4
# Rows per bucket at most: keeps each int64 temporary under glibc's largest mmap threshold
# (32 MiB), so that the allocator reuses heap memory instead of mapping, faulting in and
# unmapping fresh pages for every temporary (measured: 30% of a bucket's time).
BUCKET_ROWS = 2_500_000


@dataclass(frozen=True)
class InputFile:
    path: str
    spool_file: sp.SpoolFile | None = None  # None: a ledger export with an `attempt` column


@dataclass
class Plan:
    """Everything the workers need to know, decided before the pipeline starts."""

    run_id: str
    files: list[InputFile]
    attempts: dict[int, dict[str, Any]]  # attempt -> resumed_from_step, host_count, last_step
    manifest: str
    records: int  # manifest rows
    train_records: int
    fingerprint: str
    run_fingerprint: str | None
    at_step: int | None
    hosts: int
    bucket_size: int
    buckets: int
    rows: int = 0  # consumption rows
    cutoffs: dict[int, int | None] = field(default_factory=dict)
    replay_ranges: list[tuple[int, int]] = field(default_factory=list)


# ---- inputs -------------------------------------------------------------------------------

def spool_inputs(spool: Path, run_id: str) -> tuple[list[InputFile], dict, str | None]:
    files, attempts, fingerprint = [], {}, None
    for f in sp.scan(spool):
        if not isinstance(f, sp.SpoolFile) or f.kind != "seg" or f.run_id != run_id:
            continue
        try:
            md = {k.decode(): v.decode() for k, v in
                  (pq.read_metadata(f.path).metadata or {}).items()}
            resumed = md.get("tally.resumed_from_step", "")
            info = attempts.setdefault(f.attempt, {
                "resumed_from_step": int(resumed) if resumed else None,
                "host_count": int(md["tally.host_count"]), "last_step": -1})
            info["last_step"] = max(info["last_step"], int(md["tally.last_step"]))
            info["rows"] = info.get("rows", 0) + int(md["tally.rows"])
            fingerprint = fingerprint or md.get("tally.manifest_fingerprint") or None
        except Exception:
            pass  # the worker re-checks the file and reports why it was skipped
        files.append(InputFile(str(f.path), f))
    if not files:
        raise TallyError(f"no segment files for run {run_id!r} in spool {spool}")
    return files, attempts, fingerprint


def ledger_inputs(ledger_path: Path, run_id: str, workdir: Path) -> tuple[list, dict, str | None]:
    with Ledger(ledger_path, read_only=True) as ledger:
        run = ledger.query("SELECT run, manifest_fingerprint FROM runs WHERE run_id = ?",
                           [run_id])
        if not run:
            raise TallyError(f"run {run_id!r} is not in ledger {ledger_path}")
        rows = ledger.query("""
            SELECT a.attempt, a.resumed_from_step, a.host_count, max(h.step) AS last_step,
                   coalesce(sum(h.n_segments), 0) AS rows
            FROM attempts a LEFT JOIN host_steps h USING (run, attempt)
            WHERE a.run = ? GROUP BY ALL""", [run[0]["run"]])
        attempts = {r["attempt"]: {"resumed_from_step": r["resumed_from_step"],
                                   "host_count": r["host_count"],
                                   "last_step": r["last_step"] if r["last_step"] is not None
                                   else -1, "rows": int(r["rows"])} for r in rows}
        out = workdir / "export"
        target = str(out).replace("'", "''")  # a path is no SQL parameter in COPY ... TO
        ledger.con.execute(f"""
            COPY (SELECT attempt, host, step, "row", record_key, "offset", n_tokens,
                         content_hash, epoch FROM consumption WHERE run = {int(run[0]['run'])})
            TO '{target}' (FORMAT parquet, PER_THREAD_OUTPUT true, FILE_SIZE_BYTES '64MB')""")
    files = [InputFile(str(p)) for p in sorted(out.glob("*.parquet"))]
    return files, attempts, run[0]["manifest_fingerprint"]


def make_plan(*, run_id: str, manifest: str | Path, files: list[InputFile], attempts: dict,
              run_fingerprint: str | None, at_step: int | None,
              bucket_records: int | None = None, memory_gb: float = 3.0) -> Plan:
    """`bucket_records` (default: the most that keep BUCKETS_IN_FLIGHT buckets within
    `memory_gb`) sets the key range each bucket covers."""
    from pipeline.manifest_file import manifest_info, uniform_row_groups

    info = manifest_info(manifest)
    records, train = int(info["records"]), int(info["train_records"])
    hosts = max([a["host_count"] for a in attempts.values()] + [1])
    rows = sum(a.get("rows", 0) for a in attempts.values())
    if bucket_records is None:
        per_record = rows / max(records, 1) * BYTES_PER_ROW + BYTES_PER_RECORD + hosts
        bucket_records = min(int(memory_gb * 2**30 / BUCKETS_IN_FLIGHT / per_record),
                             int(BUCKET_ROWS * records / max(rows, 1)))
        bucket_records = min(max(bucket_records, 10_000), 4_000_000)
    bucket_records = min(bucket_records, 2**31)  # bucket files keep key offsets in uint32
    buckets = max(1, -(-records // bucket_records))
    bucket_size = -(-records // buckets)  # equal buckets
    group = uniform_row_groups(pq.read_metadata(manifest))
    if group and bucket_records >= group:  # whole row groups instead: none decoded twice
        bucket_size = bucket_records - bucket_records % group
        buckets = max(1, -(-records // bucket_size))
    plan = Plan(run_id=run_id, files=files, attempts=attempts, manifest=str(manifest),
                records=records, train_records=train, fingerprint=info["manifest_fingerprint"],
                run_fingerprint=run_fingerprint, at_step=at_step, hosts=hosts,
                bucket_size=bucket_size, buckets=buckets, rows=rows)
    plan.cutoffs = rolled_back_from({a: v["resumed_from_step"] for a, v in attempts.items()})
    for a, cut in plan.cutoffs.items():
        last = attempts[a]["last_step"]
        if at_step is not None:
            last = min(last, at_step)
        if cut is not None and last >= cut:
            plan.replay_ranges.append((cut, last))
    return plan


# ---- merging partial aggregates -----------------------------------------------------------

class Spans:
    """Per-step counts kept as (first step, counts) pieces. One input file covers a few steps
    of a run that may have a million: padding each file's counts to the run's length would make
    merging cost files x steps."""

    MAX_PIECES = 256  # then fold them into one: merging costs about files / 256 x steps

    def __init__(self, pieces: list[tuple[int, np.ndarray]]) -> None:
        self.pieces = pieces

    def __add__(self, other: Spans) -> Spans:
        out = Spans(self.pieces + other.pieces)
        if len(out.pieces) > self.MAX_PIECES:
            lo = min(p for p, _ in out.pieces)
            out = Spans([(lo, out.dense(lo))])
        return out

    def dense(self, lo: int = 0) -> np.ndarray:
        """The counts of steps lo, lo + 1, ... to the last step counted (no piece before lo)."""
        out = np.zeros(max(p + len(c) for p, c in self.pieces) - lo, dtype=np.int64)
        for p, c in self.pieces:
            out[p - lo: p - lo + len(c)] += c
        return out


def merge(a: Any, b: Any) -> Any:
    """Sum nested dicts of numpy arrays, Spans and ints (arrays padded to the longer shape);
    keys starting with `min_` / `max_` keep the smaller / larger value; lists concatenate
    (capped)."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, dict):
        out = dict(a)
        for k, v in b.items():
            if str(k).startswith(("min_", "max_")):
                out[k] = _pick(str(k), out.get(k), v)
            else:
                out[k] = merge(out.get(k), v)
        return out
    if isinstance(a, list):
        return (a + b)[:bucket_stats.EXAMPLES]
    if isinstance(a, np.ndarray):
        shape = tuple(max(x, y) for x, y in zip(a.shape, b.shape, strict=True))
        out = np.zeros(shape, dtype=np.result_type(a.dtype, b.dtype))
        out[tuple(slice(0, n) for n in a.shape)] += a
        out[tuple(slice(0, n) for n in b.shape)] += b
        return out
    return a + b


def _pick(key: str, a: Any, b: Any) -> Any:
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, np.ndarray):  # elementwise max of per-step series, padded
        out = np.zeros(max(len(a), len(b)), dtype=np.int64)
        out[: len(a)] = a
        out[: len(b)] = np.maximum(out[: len(b)], b)
        return out
    return min(a, b) if key.startswith("min_") else max(a, b)


def _reduce(xs: Iterable[Any]) -> Any:
    out = None
    for x in xs:
        out = merge(out, x)
    return out


# ---- stage 1: read consumption, cut it into key-bucket files ------------------------------

def _read_file(f: InputFile) -> dict[str, np.ndarray]:
    if f.spool_file is None:
        table = pq.read_table(f.path, columns=list(COLUMNS))
    else:
        table, _ = read_checked(f.spool_file)  # the same checks as ingest; BadFile if not
        table = table.append_column(
            "attempt", pa.array(np.full(table.num_rows, f.spool_file.attempt, np.int32)))
    return {c: table[c].to_numpy() for c in COLUMNS}


def _name(path: str) -> str:
    return xxhash.xxh3_64_hexdigest(path.encode())


def _take(cols: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[mask] for k, v in cols.items()}


def _only(item: tuple[str, Any], kind: str) -> list[Any]:
    return [item[1]] if item[0] == kind else []


class ReadConsumption(beam.DoFn):
    """One input file -> (kind, value): its effective rows written as a bucket file and one
    reference per bucket, per-step and per-host partials, replay rows, or the reason the file
    was skipped."""

    def __init__(self, plan: Plan, folder: str) -> None:
        self.plan, self.folder = plan, folder

    def process(self, f: InputFile):
        plan = self.plan
        try:
            cols = _read_file(f)
        except BadFile as exc:
            yield "skipped", {"_id": f"skipped-{_name(f.path)}", "skipped_files": [
                f"{f.path}: {exc}"]}
            return
        if plan.at_step is not None:
            cols = _take(cols, cols["step"] <= plan.at_step)
        # Each row's rollback cutoff, looked up by its attempt (no cutoff: never rolled back).
        lut = np.full(max(plan.cutoffs, default=0) + 1, np.iinfo(np.int64).max, np.int64)
        for a, cut in plan.cutoffs.items():
            if cut is not None:
                lut[a] = cut
        known = cols["attempt"] < len(lut)
        effective = ~known | (cols["step"] < lut[np.where(known, cols["attempt"], 0)])
        if not effective.all():
            rolled = _take(cols, ~effective)
            cols = _take(cols, effective)
        else:
            rolled = _take(cols, np.zeros(len(effective), dtype=bool))
        refs = []
        if len(cols["step"]):
            Path(self.folder).mkdir(parents=True, exist_ok=True)
            refs = key_buckets.write(cols, plan.bucket_size, plan.buckets,
                                     Path(self.folder, f"{_name(f.path)}.bin"))
        yield from self._per_file(f, cols, rolled, len(refs))
        for ref in refs:
            yield "by_bucket", ref

    def _per_file(self, f: InputFile, cols: dict, rolled: dict, slices: int):
        """Replay rows and the per-step, per-host partials of one file."""
        plan = self.plan
        # Replay comparison: rolled-back rows, and effective rows at rolled-back steps.
        if plan.replay_ranges:
            in_range = np.zeros(len(cols["step"]), dtype=bool)
            for lo, hi in plan.replay_ranges:
                in_range |= (cols["step"] >= lo) & (cols["step"] <= hi)
            for tag, part in (("eff", _take(cols, in_range)), ("rb", rolled)):
                for step in np.unique(part["step"]):
                    sel = _take(part, part["step"] == step)
                    yield "replay", (int(step), (tag, sel))
        if not len(cols["step"]):
            return
        steps, host, row = cols["step"], cols["host"], cols["row"]
        starts, n_tokens = cols["offset"] == 0, cols["n_tokens"]
        lo, hi = int(steps.min()), int(steps.max())
        h0, h1 = int(host.min()), int(host.max())
        rel = steps.astype(np.int64, copy=False) - lo
        # Rows per step: distinct (step, host, row) triples, packed into one key; counted in a
        # bitmap when the key space is small (a spool file: one host, a few steps), else sorted.
        rows_n = int(row.max()) + 1
        per_step = (h1 - h0 + 1) * rows_n
        triples = rel * per_step
        if h1 > h0:
            triples += (host - h0).astype(np.int64) * rows_n
        triples += row
        space = (hi - lo + 1) * per_step
        if space <= 8 * len(triples) + 4096:
            mark = np.zeros(space, dtype=bool)
            mark[triples] = True
            rows = mark.reshape(-1, per_step).sum(axis=1)
        else:
            rows = bucket_stats.bincount(np.unique(triples) // per_step)
        n = self.plan.hosts
        if h1 == h0:  # one host (every spool file): its totals, no bincount
            by_host = [np.zeros(n, np.int64) for _ in range(3)]
            for a, total in zip(by_host, (len(steps), starts.sum(), n_tokens.sum(dtype=np.int64)),
                                strict=True):
                a[h0] = total
        else:
            by_host = [bucket_stats.bincount(host, n=n),
                       bucket_stats.bincount(host[starts], n=n),
                       bucket_stats.bincount(host, n_tokens, n=n)]
        yield "partials", {
            "_id": f"file-{_name(f.path)}",
            "steps": {
                "segments": Spans([(lo, bucket_stats.bincount(rel))]),
                "tokens": Spans([(lo, bucket_stats.bincount(rel, n_tokens))]),
                "rows": Spans([(lo, rows.astype(np.int64))]),
            },
            "hosts": dict(zip(("segments", "exposures", "tokens"), by_host, strict=True)),
            "segments": len(steps),
            "slices_written": slices,
            "min_step": lo,
            "max_step": hi,  # merged with max()
        }


# ---- stage 2: the join, per bucket -----------------------------------------------------------

def _manifest_bucket(plan: Plan, bucket: int) -> dict | None:
    lo = bucket * plan.bucket_size
    hi = min(lo + plan.bucket_size, plan.records)
    if lo >= hi:  # the overflow bucket: keys beyond the manifest
        return None
    strings = ("domain", "split", "source")
    # Strings read as the dictionaries Parquet stores them in: no string is materialised.
    t = read_rows(pq.ParquetFile(plan.manifest, read_dictionary=strings), lo, hi,
                  ["record_key", "content_hash", "n_tokens", *strings])
    out = {c: t[c].to_numpy() for c in ("record_key", "content_hash", "n_tokens")}
    for c in strings:
        enc = t[c].unify_dictionaries().combine_chunks()
        out[c] = enc.indices.to_numpy(zero_copy_only=False).astype(np.int32)
        out[f"{c}_names"] = enc.dictionary.to_pylist()
    return out


class BucketStats(beam.DoFn):
    """One bucket: its manifest rows (read here, by key range) joined with its consumption
    (read from the bucket files): partial aggregates, and a part file of per-record rows."""

    def __init__(self, plan: Plan, parts: str) -> None:
        self.plan, self.parts = plan, parts

    def process(self, item):
        bucket, grouped = item
        slices = list(grouped["c"])
        rows = key_buckets.read(slices, overflow=bucket == self.plan.buckets)
        out, records = bucket_stats.compute(_manifest_bucket(self.plan, bucket), rows,
                                            self.plan.hosts)
        out["_id"] = f"bucket-{bucket}"
        out["slices_joined"] = len(slices)
        if records is not None:
            _write_part(records, Path(self.parts, f"part-{bucket:06d}.parquet"))
        yield out


class CompareReplay(beam.DoFn):
    """For one step: was each rolled-back attempt's batch replayed, and identically?"""

    def process(self, item):
        step, parts = item
        eff = [p for tag, p in parts if tag == "eff"]
        rb: dict[int, list] = {}
        for tag, p in parts:
            if tag == "rb":
                for a in np.unique(p["attempt"]):
                    rb.setdefault(int(a), []).append(_take(p, p["attempt"] == a))
        want = _multiset(eff)
        for a, ps in rb.items():
            got = _multiset(ps)
            same = bool(eff) and got == want
            yield {"_id": f"replay-{step}-{a}",
                   "replay": {str(a): np.array([1, int(bool(eff)), int(same)], np.int64)},
                   f"min_differs_{a}": None if (not eff or same) else step}


def _multiset(parts: list[dict]) -> list[tuple]:
    rows = []
    for p in parts:
        rows += list(zip(p["record_key"].tolist(), p["offset"].tolist(),
                         p["n_tokens"].tolist(), p["content_hash"].tolist(), strict=True))
    return sorted(rows)


# ---- the job --------------------------------------------------------------------------------

def run_reconcile(plan: Plan, work: Path, runner: RunnerSpec | None = None) -> dict:
    """Run the pipeline; return the merged aggregates. Workers write bucket files, per-record
    parts and results under `work`, which must be reachable from every worker."""
    (work / "records").mkdir(parents=True)
    with pipeline(runner or RunnerSpec(), partitions=max(2, len(plan.files))) as p:
        # Create spreads its elements over the workers itself (a Reshuffle inside).
        read = (p | "files" >> beam.Create(plan.files)
                  | "read" >> beam.ParDo(ReadConsumption(plan, str(work / "buckets"))))
        # Outputs are (kind, value) pairs split by FlatMaps, not tagged outputs: the Dask
        # runner sends every tagged output to the main one.
        out = {kind: read | kind >> beam.FlatMap(_only, kind)
               for kind in ("by_bucket", "partials", "replay", "skipped")}
        # Every bucket, consumed or not: never-seen records count too.
        every = p | "buckets" >> beam.Create([(b, b) for b in range(plan.buckets + 1)],
                                              reshuffle=False)  # the join shuffles them
        joined = {"c": out["by_bucket"], "m": every} | "join" >> beam.CoGroupByKey()
        stats = joined | "stats" >> beam.ParDo(BucketStats(plan, str(work / "records")))
        replay = (out["replay"] | "by step" >> beam.GroupByKey()
                  | "compare" >> beam.ParDo(CompareReplay()))
        # Every partial result goes to its own file; the driver merges them and checks that
        # nothing went missing. One leaf: the Dask runner computes only the last transform.
        saved = ((stats, replay, out["partials"], out["skipped"])
                 | "all partials" >> beam.Flatten()
                 | "save" >> beam.ParDo(_Save(str(work / "partials"))))
        (saved | "count" >> beam.Map(lambda n: (0, n)) | "total" >> beam.GroupByKey()
         | "done" >> beam.MapTuple(lambda _, ns: (work / "saved").write_text(str(sum(ns)))))
    if not (work / "saved").exists():
        raise TallyError("the reconcile job did not finish writing its results")
    merged = _reduce(load_partials(work / "partials")) or {}
    merged["steps"] = {k: v.dense() if isinstance(v, Spans) else v
                       for k, v in merged.get("steps", {}).items()}
    merged.setdefault("skipped_files", [])
    written, joined_slices = (int(merged.get(k, 0)) for k in ("slices_written", "slices_joined"))
    read = int(merged.get("segments", 0))
    joined = sum(int(merged.get(k, 0)) for k in ("unknown_segments", "hash_checked",
                                                 "hash_unverifiable"))
    if (read, written) != (joined, joined_slices):
        raise TallyError(f"the reconcile job lost rows: {read:,} effective rows read, "
                         f"{joined:,} joined with the manifest; {written:,} bucket slices "
                         f"written, {joined_slices:,} joined (runner {runner}); no report "
                         "written")
    return merged


class _Save(beam.DoFn):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def process(self, partial: dict):
        # Named by what it summarises and by its content, written by rename: a retried bundle
        # rewrites the same file, never half a file; a second, different result for the same
        # bucket (file, step) lands beside the first, where `load_partials` finds it.
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        key = partial.pop("_id")
        data = pickle.dumps(partial)
        name = f"{key}.{xxhash.xxh3_64_hexdigest(data)}.pkl"
        final = Path(self.folder, name)
        tmp = final.with_name(f".{name}.{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, final)
        yield 1


def load_partials(folder: Path) -> list[dict]:
    """The saved partial results; TallyError when one id has two different results (the
    runner delivered a bucket's group twice, with different values)."""
    by_id: dict[str, list[Path]] = {}
    for f in sorted(folder.glob("*.pkl")):
        by_id.setdefault(f.name.split(".")[0], []).append(f)
    twice = sorted(k for k, v in by_id.items() if len(v) > 1)
    if twice:
        raise TallyError(f"the runner delivered {len(twice)} group(s) more than once with "
                         f"different contents ({', '.join(twice[:5])}): a GroupByKey split a "
                         "key's values; no report written")
    return [pickle.loads(v[0].read_bytes()) for v in by_id.values()]


def _write_part(records: pa.Table, final: Path) -> None:
    # Written where the bucket is computed, in parallel: the driver only moves the folder.
    # Strings stay dictionary-encoded, as Parquet stores them; without the Arrow schema in the
    # file they read back as plain strings.
    tmp = final.with_name(f".{final.name}.{os.getpid()}")
    pq.write_table(records, tmp, store_schema=False,
                   use_dictionary=[f.name for f in records.schema
                                   if pa.types.is_dictionary(f.type)])
    os.replace(tmp, final)  # a retried bundle rewrites the same part whole


def publish_records(work: Path, out: Path) -> None:
    """OUT/records/: one Parquet part per key bucket, named in key order."""
    parts = work / "records"
    if not any(parts.glob("part-*.parquet")):  # an empty manifest: still a readable table
        _write_part(bucket_stats.RECORDS_SCHEMA.empty_table(), parts / "part-000000.parquet")
    old = work / "records.old"
    if out.exists():
        out.rename(old)  # the earlier report's table, until the new one is in place
    parts.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    out.with_name("records.parquet").unlink(missing_ok=True)  # what earlier versions wrote


def reconcile(*, run_id: str, manifest: str | Path, out: str | Path,
              spool: str | Path | None = None, ledger: str | Path | None = None,
              at_step: int | None = None, runner: RunnerSpec | None = None,
              bucket_records: int | None = None, memory_gb: float = 3.0) -> dict:
    """Inputs -> plan -> Beam job -> report files in `out`; returns the report.

    `memory_gb` bounds the memory of the buckets in flight (see `make_plan`)."""
    from audit import report as rp

    if (spool is None) == (ledger is None):
        raise TallyError("give exactly one of --spool or --ledger")
    if not Path(manifest).exists():
        raise TallyError(f"no manifest at {manifest}")
    out = Path(out)
    # Under the output folder, so that workers on other machines can reach it when the output
    # is on a shared file system; removed when the job is done.
    work = out / ".work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        if spool is not None:
            if not Path(spool).is_dir():
                raise TallyError(f"spool {spool} is not a directory")
            files, attempts, fp = spool_inputs(Path(spool), run_id)
        else:
            files, attempts, fp = ledger_inputs(Path(ledger), run_id, work)
        plan = make_plan(run_id=run_id, manifest=manifest, files=files, attempts=attempts,
                         run_fingerprint=fp, at_step=at_step, bucket_records=bucket_records,
                         memory_gb=memory_gb)
        merged = run_reconcile(plan, work, runner)
        report, tables = rp.build(plan, merged)
        rp.write(report, tables, out)
        publish_records(work, out / "records")
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
