"""The Beam stages both bucket jobs build on (reconcile, tally.audit.reconcile.job; diff,
tally.audit.posthoc.diff): a chunk of a run's input files read into one record-key bucket file
(tally.audit.buckets.exchange) with its per-step and per-host partial (`ReadConsumption`), a
bucket's manifest rows (`manifest_bucket`), every worker's partial saved and loaded back for the
driver's merge (`save_partials`, `load_partials`), and the per-record parts published
(`write_part`, `publish_records`).

Per-bucket partials are produced by each job's own join stage (reconcile's `BucketStats`,
diff's `CompareBucket`), per-chunk partials here; all of them are saved by `save_partials` and
merged by the driver (tally.audit.buckets.partials.merge_all over `load_partials`).
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from tally.audit.buckets import exchange, host_steps
from tally.audit.buckets.partials import Partial, Spans, merge_all
from tally.audit.buckets.plan import COLUMNS, InputFile, Plan
from tally.audit.core.arrays import bincount, distinct
from tally.audit.core.errors import TallyError
from tally.audit.core.exposure import effective, starts
from tally.audit.hook.spool import BadFile, read_checked
from tally.pipeline.corpus import read_rows

Columns = dict[str, np.ndarray]


# ---- stage 1: read consumption, cut it into key-bucket files ------------------------------

def _read_file(f: InputFile) -> Columns:
    if f.spool_file is None:
        table = pq.read_table(f.path, columns=list(COLUMNS))
    else:
        table, _ = read_checked(f.spool_file)  # the same checks as ingest; BadFile if not
        table = table.append_column(
            "attempt", pa.array(np.full(table.num_rows, f.spool_file.attempt, np.int32)))
    return {c: table[c].to_numpy() for c in COLUMNS}


def name_of(path: str) -> str:
    """A file name for `path` (or any text): the same on every worker and retry."""
    return xxhash.xxh3_64_hexdigest(path.encode())


def _chunk_name(chunk: tuple) -> str:
    """A chunk's name, from its files' paths (the same on a retried bundle)."""
    return name_of("\n".join(f.path for f in chunk))


def rows_where(cols: Columns, mask: np.ndarray) -> Columns:
    """The rows of `cols` where `mask` holds."""
    return {k: v[mask] for k, v in cols.items()}


def of_kind(item: tuple[str, Any], kind: str) -> list[Any]:
    """The values of (kind, value) pairs of one kind (a FlatMap splitting a DoFn's outputs)."""
    return [item[1]] if item[0] == kind else []


def effective_rows(f: InputFile, plan: Plan) -> tuple[Columns, Columns]:
    """One input file's (effective, rolled-back) rows under the plan's cutoffs (and its
    `at_step`); BadFile when the file fails the spool's checks."""
    cols = _read_file(f)
    if plan.at_step is not None:
        cols = rows_where(cols, cols["step"] <= plan.at_step)
    kept = effective(cols["step"], cols["attempt"], plan.cutoffs)
    rolled = rows_where(cols, ~kept)
    if not kept.all():
        cols = rows_where(cols, kept)
    return cols, rolled


def replay_rows(plan: Plan, cols: Columns, rolled: Columns) -> Iterator[tuple[int, tuple]]:
    """(step, (tag, rows)): a file's rolled-back rows, and its effective rows at rolled-back
    steps, by step (what tally.audit.reconcile.job.CompareReplay compares)."""
    if not plan.replay_ranges:
        return
    in_range = np.zeros(len(cols["step"]), dtype=bool)
    for lo, hi in plan.replay_ranges:
        in_range |= (cols["step"] >= lo) & (cols["step"] <= hi)
    for tag, part in (("effective", rows_where(cols, in_range)), ("rolled_back", rolled)):
        for step in np.unique(part["step"]):
            yield int(step), (tag, rows_where(part, part["step"] == step))


class ReadConsumption(beam.DoFn):
    """One chunk of input files (tally.audit.buckets.plan.chunks) -> (kind, value): their
    effective rows written as one bucket file and one reference per bucket, their per-step and
    per-host partial (each file's, merged), replay rows, and the files skipped with why."""

    def __init__(self, plan: Plan, folder: str) -> None:
        self.plan, self.folder = plan, folder

    def process(self, chunk: tuple[InputFile, ...]):
        plan = self.plan
        parts, kept_cols, partial = [], [], Partial()
        for f in chunk:
            try:
                cols, rolled = effective_rows(f, plan)
            except BadFile as exc:
                partial = partial.merge(Partial(skipped=1, skipped_files=[(f.path, str(exc))]))
                continue
            for step, part in replay_rows(plan, cols, rolled):
                yield "replay", (step, part)
            if len(cols["step"]):
                parts.append(file_partial(plan, cols))
                kept_cols.append(cols)
        refs = []
        if kept_cols:
            cols = {k: np.concatenate([c[k] for c in kept_cols]) for k in COLUMNS}
            Path(self.folder).mkdir(parents=True, exist_ok=True)
            refs = exchange.write(cols, plan.bucket_size, plan.buckets,
                                 Path(self.folder, f"{_chunk_name(chunk)}.bin"))
        partial = merge_all(parts, partial)
        partial.slices_written = len(refs)
        yield "partials", (f"chunk-{_chunk_name(chunk)}", partial)
        for ref in refs:
            yield "by_bucket", ref


def file_partial(plan: Plan, cols: Columns) -> Partial:
    """The per-step and per-host counts of one file's effective rows (not empty)."""
    steps, host, row = cols["step"], cols["host"], cols["row"]
    start, n_tokens = starts(cols["offset"]), cols["n_tokens"]
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
        rows = bincount(distinct(triples) // per_step)
    n = len(plan.host_ids)  # per host by its position (Plan.host_ids)
    if h1 == h0:  # one host (every spool file): its totals, no bincount
        by_host = [np.zeros(n, np.int64) for _ in range(3)]
        at = int(plan.host_index(np.int64(h0)))
        for a, total in zip(by_host, (len(steps), start.sum(), n_tokens.sum(dtype=np.int64)),
                            strict=True):
            a[at] = total
    else:
        at = plan.host_index(host)
        by_host = [bincount(at, n=n),
                   bincount(at[start], n=n),
                   bincount(at, n_tokens, n=n)]
    return Partial(
        **host_steps.per_file(cols, plan.train_records),
        segments=len(steps), first_step=lo, last_step=hi,
        step_segments=Spans([(lo, bincount(rel))]),
        step_tokens=Spans([(lo, bincount(rel, n_tokens))]),
        step_rows=Spans([(lo, rows.astype(np.int64))]),
        host_segments=by_host[0], host_exposures=by_host[1], host_tokens=by_host[2])


# ---- stage 2: the join, per bucket -----------------------------------------------------------

def manifest_bucket(plan: Plan, bucket: int) -> dict | None:
    """The manifest rows of one key bucket as numpy columns (strings as dictionary codes, with
    their names); None for the overflow bucket."""
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



# ---- the driver's side: partials saved and merged, per-record parts published ------------

def save_partials(pcolls: tuple, work: Path) -> None:
    """The pipeline's end: every (id, partial) of `pcolls` saved to its own file under
    `work / "partials"`, then `work / "saved"` written once all are. The driver merges them
    (`load_partials`) and checks that nothing went missing. One leaf: the Dask runner
    computes only the last transform."""
    saved = (pcolls | "all partials" >> beam.Flatten()
             | "save" >> beam.ParDo(SavePartials(str(work / "partials"))))
    (saved | "count" >> beam.Map(lambda n: (0, n)) | "total" >> beam.GroupByKey()
     | "done" >> beam.MapTuple(lambda _, ns: (work / "saved").write_text(str(sum(ns)))))


class SavePartials(beam.DoFn):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def process(self, item: tuple[str, Partial]):
        # Named by what it summarises and by its content, written by rename: a retried bundle
        # rewrites the same file, never half a file; a second, different result for the same
        # bucket (file, step) lands beside the first, where `load_partials` finds it.
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        key, partial = item
        data = pickle.dumps(partial)
        name = f"{key}.{xxhash.xxh3_64_hexdigest(data)}.pkl"
        final = Path(self.folder, name)
        tmp = final.with_name(f".{name}.{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, final)
        yield 1


def load_partials(folder: Path, finished: Path | None = None) -> Iterator[Any]:
    """The saved partial results, loaded one at a time as they are merged (a bucket's per-step
    series are as long as the run); TallyError at once when one id has two different results
    (the runner delivered a bucket's group twice, with different values), or when the job did
    not write its `finished` mark."""
    if finished is not None and not finished.exists():
        raise TallyError("the job did not finish writing its results")
    by_id: dict[str, list[Path]] = {}
    for f in sorted(folder.glob("*.pkl")):
        by_id.setdefault(f.name.split(".")[0], []).append(f)
    twice = sorted(k for k, v in by_id.items() if len(v) > 1)
    if twice:
        raise TallyError(f"the runner delivered {len(twice)} group(s) more than once with "
                         f"different contents ({', '.join(twice[:5])}): a GroupByKey split a "
                         "key's values; no report written")
    return (pickle.loads(v[0].read_bytes()) for v in by_id.values())


def write_part(records: pa.Table, final: Path) -> None:
    # Written where the bucket is computed, in parallel: the driver only moves the folder.
    # Strings stay dictionary-encoded, as Parquet stores them; without the Arrow schema in the
    # file they read back as plain strings.
    tmp = final.with_name(f".{final.name}.{os.getpid()}")
    pq.write_table(records, tmp, store_schema=False,
                   use_dictionary=[f.name for f in records.schema
                                   if pa.types.is_dictionary(f.type)])
    os.replace(tmp, final)  # a retried bundle rewrites the same part whole


def publish_records(work: Path, out: Path, schema: pa.Schema) -> None:
    """OUT/records/: one Parquet part per key bucket, named in key order (`schema`: the job's
    per-record table, for an empty manifest)."""
    parts = work / "records"
    if not any(parts.glob("part-*.parquet")):  # an empty manifest: still a readable table
        write_part(schema.empty_table(), parts / "part-000000.parquet")
    old = work / "records.old"
    if out.exists():
        out.rename(old)  # the earlier report's table, until the new one is in place
    parts.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    out.with_name("records.parquet").unlink(missing_ok=True)  # what earlier versions wrote
