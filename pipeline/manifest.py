"""The manifest job (Beam): one row per corpus record, in the corpus' global order.

Columns: record_key, content_hash, n_tokens, domain, split, source, source_index. The file's
metadata holds the manifest fingerprint (`tally.manifest_fingerprint`), which a run records to
say which corpus it trained against.

The pipeline's elements are record ranges of a shard; each range is read, hashed with the
project's one hash function, and written as an Arrow part file by one worker, so no element is
one Python object per record. The driver then concatenates the parts in key order into the
manifest, checking that they cover every record exactly once. Bad input (a record without
tokens, a token array of the wrong type) is reported by the worker that found it and raised by
the driver as one clear error naming the file and the record.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import progress
from pipeline.corpus import CorpusArg, CorpusError, Shard, hash_range, open_corpus, repeat
from pipeline.manifest_file import (  # noqa: F401
    FINGERPRINT_KEY,
    MANIFEST_SCHEMA,
    ROW_GROUP_RECORDS,
    Fingerprint,
    manifest_info,
    manifest_metadata,
)
from pipeline.runners import RunnerSpec, pipeline


def manifest_rows(shard: Shard, start: int, end: int) -> pa.Table:
    """Manifest rows for records [start, end) of one shard."""
    hashes, lengths, domains = hash_range(shard, start, end)
    n = end - start
    return pa.Table.from_pydict({
        "record_key": np.arange(shard.base_key + start, shard.base_key + end, dtype=np.int64),
        "content_hash": hashes,
        "n_tokens": lengths,
        "domain": domains,
        "split": repeat(shard.split, n),
        "source": repeat(shard.source, n),
        "source_index": np.arange(start, end, dtype=np.int64),
    }, schema=MANIFEST_SCHEMA)


class _WritePart(beam.DoFn):
    """Writes one record range's manifest rows as a part file (or an error file)."""

    def __init__(self, parts: str) -> None:
        self.parts = parts

    def process(self, chunk: tuple[Shard, int, int]):
        shard, start, end = chunk
        key = shard.base_key + start
        try:
            table = manifest_rows(shard, start, end)
        except CorpusError as exc:
            Path(self.parts, f"error-{key:012d}.txt").write_text(str(exc))
            return
        final = Path(self.parts, f"part-{key:012d}.parquet")
        tmp = final.with_name("." + final.name)
        pq.write_table(table, tmp)
        os.replace(tmp, final)
        yield key, table.num_rows


@dataclass
class ManifestSummary:
    path: Path
    records: int
    train_records: int
    tokens: int
    fingerprint: str
    seconds: float
    bytes_read: int

    def line(self) -> str:
        return (f"manifest {self.path}: {self.records:,} records ({self.train_records:,} train), "
                f"{self.tokens:,} tokens, fingerprint {self.fingerprint}, "
                f"{self.seconds:.1f} s ({self.records / max(self.seconds, 1e-9):,.0f} records/s, "
                f"{self.bytes_read / 1e6 / max(self.seconds, 1e-9):,.0f} MB/s)")


def build_manifest(corpus: CorpusArg, out: str | Path, *, runner: RunnerSpec | None = None,
                   chunk_records: int = 20_000, progress: bool = False,
                   sequence_length: int | None = None, dtype: str | None = None
                   ) -> ManifestSummary:
    """Run the manifest job over `corpus` and write `out` (Parquet) atomically.

    `corpus`: a directory of shards, an OLMo mix's index JSON, or OLMo token files (a list, or
    a directory of them) with their `sequence_length` and `dtype` (`pipeline.corpus`)."""
    runner = runner or RunnerSpec()
    t0 = time.perf_counter()
    # Absolute paths: workers of a cluster do not share this process's working directory.
    source = open_corpus([Path(c).absolute() for c in (
        [corpus] if isinstance(corpus, str | Path) else corpus)],
        sequence_length=sequence_length, dtype=dtype)
    shards = source.shards
    chunks = [(s, a, min(a + chunk_records, s.num_records))
              for s in shards for a in range(0, s.num_records, chunk_records)]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = out.absolute().with_name(f".{out.name}.parts")
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir()
    try:
        with _progress(parts, len(chunks), progress), \
                pipeline(runner, partitions=len(chunks)) as p:
            _ = (p | "ranges" >> beam.Create(chunks)
                   | "spread" >> beam.Reshuffle()
                   | "hash" >> beam.ParDo(_WritePart(str(parts))))
        errors = sorted(parts.glob("error-*.txt"))
        if errors:
            raise CorpusError(errors[0].read_text()
                              + (f" (and {len(errors) - 1} more bad ranges)" if len(errors) > 1
                                 else ""))
        summary = _concatenate(parts, out, shards, source.name, source.metadata)
    finally:
        shutil.rmtree(parts, ignore_errors=True)
    summary.seconds = time.perf_counter() - t0
    summary.bytes_read = sum(s.size_bytes for s in shards)
    return summary


def _concatenate(parts: Path, out: Path, shards: list[Shard], corpus: str,
                 metadata: dict[str, str]) -> ManifestSummary:
    total = sum(s.num_records for s in shards)
    fp = Fingerprint()
    tmp = out.with_name(f".{out.name}.tmp")
    expected, tokens = 0, 0
    pending: list[pa.Table] = []  # rows not yet written: row groups are cut at equal sizes
    with pq.ParquetWriter(tmp, MANIFEST_SCHEMA) as w:
        for part in sorted(parts.glob("part-*.parquet")):
            table = pq.read_table(part)
            first = table["record_key"][0].as_py()
            if first != expected:
                raise CorpusError(f"manifest job lost records {expected}..{first - 1} "
                                  "(a worker failed without an error?)")
            pending.append(table)
            if sum(t.num_rows for t in pending) >= ROW_GROUP_RECORDS:
                rows = pa.concat_tables(pending)
                whole = rows.num_rows // ROW_GROUP_RECORDS * ROW_GROUP_RECORDS
                w.write_table(rows.slice(0, whole), row_group_size=ROW_GROUP_RECORDS)
                pending = [rows.slice(whole)] if whole < rows.num_rows else []
            fp.update(table)
            expected += table.num_rows
            tokens += int(np.sum(table["n_tokens"].to_numpy(), dtype=np.int64))
        if pending:
            w.write_table(pa.concat_tables(pending))
        if expected != total:
            raise CorpusError(f"manifest job produced {expected} of {total} records")
        n_train = sum(s.num_records for s in shards if s.split == "train")
        w.add_key_value_metadata({**manifest_metadata(fp.hexdigest(), total, n_train,
                                                      corpus=corpus), **metadata})
    os.replace(tmp, out)
    return ManifestSummary(out, total, n_train, tokens, fp.hexdigest(), 0.0, 0)


class _progress:
    """A progress bar fed by the part files appearing, whatever runner does the work."""

    def __init__(self, parts: Path, total: int, enabled: bool) -> None:
        self.parts, self.total, self.enabled = parts, total, enabled
        self._stop = threading.Event()

    def __enter__(self) -> None:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        with progress.bar(True, total=self.total, unit="range", desc="manifest") as bar:
            while True:
                done = len(list(self.parts.glob("*-*.*")))
                bar.update(done - bar.n)
                if self._stop.wait(0.5):
                    bar.update(len(list(self.parts.glob("*-*.*"))) - bar.n)
                    return

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()
