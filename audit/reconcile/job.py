"""The reconcile job (Beam): a run's consumption against the corpus manifest.

Inputs are a frozen list of consumption files (tally.audit.reconcile.plan): the run's published
spool
segment files, or an export of the ledger. The consumption is cut into record-key buckets and
joined with the manifest bucket by bucket (CoGroupByKey on the bucket number; each bucket's
manifest rows are read by key range where the bucket is computed, so there are no side inputs).
The rows travel between the two stages as bucket files (tally.audit.reconcile.buckets): the shuffle
carries only references to them, and each bucket is computed with numpy over its columns
(tally.audit.reconcile.bucket_stats), never one Python object per row. Every worker emits typed
partial results (tally.audit.reconcile.partials) that the driver merges; per-record rows are written
as part files that the driver moves into place. Only Create, ParDo, GroupByKey and Flatten are
used, the primitives every runner translates, Dask's included.

Restart lineage (tally.audit.core.exposure) splits rows into effective and rolled back; rolled-back
rows are compared step by step with the surviving replay.
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

from tally.audit.core.arrays import distinct
from tally.audit.core.errors import TallyError
from tally.audit.core.exposure import effective, starts
from tally.audit.hook.spool import BadFile, read_checked
from tally.audit.reconcile import bucket_stats, buckets, host_steps
from tally.audit.reconcile.partials import Partial, Spans, merge_all
from tally.audit.reconcile.plan import (
    COLUMNS,
    InputFile,
    Plan,
    chunks,
    ledger_inputs,
    make_plan,
    metric_facts,
    milestones,
    run_finished,
    spool_inputs,
)
from tally.pipeline.corpus import read_rows
from tally.pipeline.progress import Progress
from tally.pipeline.runners import RunnerSpec, pipeline

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


def _name(path: str) -> str:
    return xxhash.xxh3_64_hexdigest(path.encode())


def _chunk_name(chunk: tuple) -> str:
    """A chunk's name, from its files' paths (the same on a retried bundle)."""
    return _name("\n".join(f.path for f in chunk))


class ReadMetrics(beam.DoFn):
    """A chunk of the run's metric files -> its partial of metric facts (NaN or infinite
    losses, hosts that said they finished, losses per step for the milestones)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def process(self, files: tuple):
        facts = metric_facts(list(files), self.plan.cutoffs)
        count, first = facts["non_finite"]
        yield f"metrics-{_name(chr(10).join(str(f.path) for f in files))}", Partial(
            non_finite_losses=count, non_finite_first_step=first,
            finished_at=facts["finished"], loss_sums=facts["loss_sums"])


METRIC_FILES_A_TASK = 512


def _rows_where(cols: Columns, mask: np.ndarray) -> Columns:
    return {k: v[mask] for k, v in cols.items()}


def of_kind(item: tuple[str, Any], kind: str) -> list[Any]:
    """The values of (kind, value) pairs of one kind (a FlatMap splitting a DoFn's outputs)."""
    return [item[1]] if item[0] == kind else []


class ReadConsumption(beam.DoFn):
    """One chunk of input files (tally.audit.reconcile.plan.chunks) -> (kind, value): their
    effective rows written as one bucket file and one reference per bucket, their per-step and
    per-host partial (each file's, merged), replay rows, and the files skipped with why."""

    def __init__(self, plan: Plan, folder: str) -> None:
        self.plan, self.folder = plan, folder

    def process(self, chunk: tuple[InputFile, ...]):
        plan = self.plan
        parts, kept_cols, partial = [], [], Partial()
        for f in chunk:
            try:
                cols = _read_file(f)
            except BadFile as exc:
                partial = partial.merge(Partial(skipped=1, skipped_files=[(f.path, str(exc))]))
                continue
            if plan.at_step is not None:
                cols = _rows_where(cols, cols["step"] <= plan.at_step)
            kept = effective(cols["step"], cols["attempt"], plan.cutoffs)
            rolled = _rows_where(cols, ~kept)
            if not kept.all():
                cols = _rows_where(cols, kept)
            yield from self._replay_rows(cols, rolled)
            if len(cols["step"]):
                parts.append(self._per_file(cols))
                kept_cols.append(cols)
        refs = []
        if kept_cols:
            cols = {k: np.concatenate([c[k] for c in kept_cols]) for k in COLUMNS}
            Path(self.folder).mkdir(parents=True, exist_ok=True)
            refs = buckets.write(cols, plan.bucket_size, plan.buckets,
                                 Path(self.folder, f"{_chunk_name(chunk)}.bin"))
        partial = merge_all(parts, partial)
        partial.slices_written = len(refs)
        yield "partials", (f"chunk-{_chunk_name(chunk)}", partial)
        for ref in refs:
            yield "by_bucket", ref

    def _replay_rows(self, cols: Columns, rolled: Columns) -> Iterator[tuple[str, Any]]:
        """Rolled-back rows, and effective rows at rolled-back steps, by step."""
        if not self.plan.replay_ranges:
            return
        in_range = np.zeros(len(cols["step"]), dtype=bool)
        for lo, hi in self.plan.replay_ranges:
            in_range |= (cols["step"] >= lo) & (cols["step"] <= hi)
        for tag, part in (("effective", _rows_where(cols, in_range)), ("rolled_back", rolled)):
            for step in np.unique(part["step"]):
                yield "replay", (int(step), (tag, _rows_where(part, part["step"] == step)))

    def _per_file(self, cols: Columns) -> Partial:
        """The per-step and per-host counts of one file's effective rows."""
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
            rows = bucket_stats.bincount(distinct(triples) // per_step)
        n = len(self.plan.host_ids)  # per host by its position (Plan.host_ids)
        if h1 == h0:  # one host (every spool file): its totals, no bincount
            by_host = [np.zeros(n, np.int64) for _ in range(3)]
            at = int(self.plan.host_index(np.int64(h0)))
            for a, total in zip(by_host, (len(steps), start.sum(), n_tokens.sum(dtype=np.int64)),
                                strict=True):
                a[at] = total
        else:
            at = self.plan.host_index(host)
            by_host = [bucket_stats.bincount(at, n=n),
                       bucket_stats.bincount(at[start], n=n),
                       bucket_stats.bincount(at, n_tokens, n=n)]
        return Partial(
            **host_steps.per_file(cols, self.plan.train_records),
            segments=len(steps), first_step=lo, last_step=hi,
            step_segments=Spans([(lo, bucket_stats.bincount(rel))]),
            step_tokens=Spans([(lo, bucket_stats.bincount(rel, n_tokens))]),
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


class BucketStats(beam.DoFn):
    """One bucket: its manifest rows (read here, by key range) joined with its consumption
    (read from the bucket files): a partial, and a part file of per-record rows."""

    def __init__(self, plan: Plan, parts: str) -> None:
        self.plan, self.parts = plan, parts

    def process(self, item):
        bucket, grouped = item
        slices = list(grouped["consumption"])
        rows = buckets.read(slices, overflow=bucket == self.plan.buckets)
        out, records = bucket_stats.compute(manifest_bucket(self.plan, bucket), rows,
                                            self.plan.host_ids, self.plan.loss_window,
                                            self.plan.first_step)
        out.slices_joined = len(slices)
        if records is not None:
            write_part(records, Path(self.parts, f"part-{bucket:06d}.parquet"))
        yield f"bucket-{bucket}", out


class CompareReplay(beam.DoFn):
    """For one step: was each rolled-back attempt's batch replayed, and identically?

    An attempt that was killed publishes its last steps on some hosts only (each host flushes on
    its own). On the same host count, the hosts that published the step are compared with the
    same hosts of the replay; on another host count only a step every host of the attempt
    published can be compared, and a partial one is neither replayed nor differing. (Comparing a
    partial step with the whole replayed step read a clean kill-and-resume as inexact whenever
    the hosts died a flush apart: about one SIGKILL test in six.)"""

    def __init__(self, host_counts: dict[int, int]) -> None:
        self.host_counts = host_counts  # attempt -> its host count

    def process(self, item):
        step, parts = item
        replayed = [p for tag, p in parts if tag == "effective"]
        by = {int(a) for p in replayed for a in np.unique(p["attempt"])}
        replay_hosts = self.host_counts.get(max(by)) if by else None
        rolled: dict[int, list[Columns]] = {}
        for tag, p in parts:
            if tag == "rolled_back":
                for a in np.unique(p["attempt"]):
                    rolled.setdefault(int(a), []).append(_rows_where(p, p["attempt"] == a))
        for a, ps in rolled.items():
            hosts = np.unique(np.concatenate([p["host"] for p in ps]))
            if replay_hosts == self.host_counts[a]:
                theirs = [_rows_where(p, np.isin(p["host"], hosts)) for p in replayed]
                comparable = True
            else:
                theirs, comparable = replayed, len(hosts) == self.host_counts[a]
            was = comparable and any(len(p["step"]) for p in theirs)
            same = was and _multiset(ps) == _multiset(theirs)
            yield f"replay-{step}-{a}", Partial(
                replay={a: np.array([1, int(was), int(same)], np.int64)},
                first_differing_step={a: step} if was and not same else {})


def _multiset(parts: list[Columns]) -> list[tuple]:
    rows = []
    for p in parts:
        rows += list(zip(p["record_key"].tolist(), p["offset"].tolist(),
                         p["n_tokens"].tolist(), p["content_hash"].tolist(), strict=True))
    return sorted(rows)


# ---- the job --------------------------------------------------------------------------------

def run_reconcile(plan: Plan, work: Path, runner: RunnerSpec | None = None) -> Partial:
    """Run the pipeline; return the merged partials. Workers write bucket files, per-record
    parts and partial results under `work`, which must be reachable from every worker."""
    (work / "records").mkdir(parents=True)
    tasks = chunks(plan.files)
    metric_tasks = [tuple(plan.metric_files[i: i + METRIC_FILES_A_TASK])
                    for i in range(0, len(plan.metric_files), METRIC_FILES_A_TASK)]
    slim = plan.for_workers()
    with pipeline(runner or RunnerSpec(), partitions=max(2, len(tasks))) as p:
        # Create spreads its elements over the workers itself (a Reshuffle inside).
        read = (p | "files" >> beam.Create(tasks)
                  | "read" >> beam.ParDo(ReadConsumption(slim, str(work / "buckets"))))
        # Outputs are (kind, value) pairs split by FlatMaps, not tagged outputs: the Dask
        # runner sends every tagged output to the main one.
        out = {kind: read | kind >> beam.FlatMap(of_kind, kind)
               for kind in ("by_bucket", "partials", "replay")}
        # Every bucket, consumed or not: never-seen records count too.
        every = p | "buckets" >> beam.Create([(b, b) for b in range(plan.buckets + 1)],
                                              reshuffle=False)  # the join shuffles them
        joined = ({"consumption": out["by_bucket"], "manifest": every}
                  | "join" >> beam.CoGroupByKey())
        stats = joined | "stats" >> beam.ParDo(BucketStats(slim, str(work / "records")))
        replay = (out["replay"] | "by step" >> beam.GroupByKey()
                  | "compare" >> beam.ParDo(CompareReplay(
                      {a: int(info["host_count"]) for a, info in plan.attempts.items()})))
        results = [stats, replay, out["partials"]]
        if metric_tasks:
            results.append(p | "metric files" >> beam.Create(metric_tasks)
                           | "metrics" >> beam.ParDo(ReadMetrics(slim)))
        save_partials(tuple(results), work)
    merged = merge_all(load_partials(work / "partials", finished=work / "saved"))
    if plan.metric_files:  # the run's metric facts, as ledger_inputs reads them by SQL
        plan.non_finite_losses = {"count": merged.non_finite_losses,
                                  "first_step": merged.non_finite_first_step}
        plan.finished, plan.finished_step = run_finished(plan.attempts, merged.finished_at,
                                                         plan.at_step)
        plan.milestones = milestones(merged.loss_sums)
    joined = merged.unknown_segments + merged.hash_checked + merged.hash_unverifiable
    if (merged.segments, merged.slices_written) != (joined, merged.slices_joined):
        raise TallyError(f"the reconcile job lost rows: {merged.segments:,} effective rows "
                         f"read, {joined:,} joined with the manifest; {merged.slices_written:,} "
                         f"bucket slices written, {merged.slices_joined:,} joined (runner "
                         f"{runner}); no report written")
    return merged


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


def publish_records(work: Path, out: Path, schema: pa.Schema = bucket_stats.RECORDS_SCHEMA
                    ) -> None:
    """OUT/records/: one Parquet part per key bucket, named in key order."""
    parts = work / "records"
    if not any(parts.glob("part-*.parquet")):  # an empty manifest: still a readable table
        write_part(schema.empty_table(), parts / "part-000000.parquet")
    old = work / "records.old"
    if out.exists():
        out.rename(old)  # the earlier report's table, until the new one is in place
    parts.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    out.with_name("records.parquet").unlink(missing_ok=True)  # what earlier versions wrote


def reconcile(*, run_id: str, manifest: str | Path, out: str | Path,
              spool: str | Path | None = None, ledger: str | Path | None = None,
              at_step: int | None = None, runner: RunnerSpec | None = None,
              bucket_records: int | None = None, memory_gb: float = 3.0,
              progress: bool = False, api_url: str | None = None) -> dict:
    """Inputs -> plan -> Beam job -> report files in `out`; returns the report.

    `memory_gb` bounds the memory of the buckets in flight (see `make_plan`); `progress`
    shows the stages on stderr, the job's by the key buckets done; `api_url`: the `tally
    serve` report.html's evidence links open (without it, its own Evidence tables)."""
    if (spool is None) == (ledger is None):
        raise TallyError("give exactly one of --spool or --ledger")
    if not Path(manifest).exists():
        raise TallyError(f"no manifest at {manifest}")
    # Absolute paths go to the workers: on a cluster they do not share this process's working
    # directory (the paths must name the same files there: a shared file system).
    out, manifest = Path(out).absolute(), Path(manifest).absolute()
    # Under the output folder, so that workers on other machines can reach it when the output
    # is on a shared file system; removed when the job is done.
    work = out / ".work"
    shutil.rmtree(work, ignore_errors=True)
    made = not out.exists()  # a refused reconcile leaves no folder it made behind
    work.mkdir(parents=True)
    with Progress(f"reconcile {run_id}", progress) as bar:
        return _reconcile(run_id, manifest, out, work, made, spool, ledger, at_step, runner,
                          bucket_records, memory_gb, bar, api_url)


def _reconcile(run_id: str, manifest: Path, out: Path, work: Path, made: bool,
               spool: str | Path | None, ledger: str | Path | None, at_step: int | None,
               runner: RunnerSpec | None, bucket_records: int | None, memory_gb: float,
               bar: Progress, api_url: str | None = None) -> dict:
    from tally.audit.reconcile import report as rp

    done = False
    try:
        bar.stage("reading the inputs")
        if spool is not None:
            if not Path(spool).is_dir():
                raise TallyError(f"spool {spool} is not a directory")
            inputs = spool_inputs(Path(spool).absolute(), run_id)
        else:
            inputs = ledger_inputs(Path(ledger), run_id, work)
        plan = make_plan(run_id=run_id, manifest=manifest, files=inputs.files,
                         attempts=inputs.attempts, run_fingerprint=inputs.fingerprint,
                         at_step=at_step, bucket_records=bucket_records, memory_gb=memory_gb,
                         left_out=inputs.left_out,
                         non_finite_losses=inputs.non_finite_losses,
                         finished=inputs.finished, milestones=inputs.milestones,
                         metric_files=inputs.metric_files,
                         replayed_files=inputs.replayed_files,
                         segment_files=inputs.segment_files, host_ids=inputs.host_ids,
                         content_bases=inputs.content_bases)
        parts = work / "records"
        bar.stage("key buckets", total=plan.buckets + 1,
                  count=lambda: sum(1 for _ in parts.glob("part-*.parquet")))
        merged = run_reconcile(plan, work, runner)
        bar.stage("writing the report")
        report, tables = rp.build(plan, merged, ("spool", Path(spool).absolute())
                                  if spool is not None else ("ledger", Path(ledger).absolute()))
        rp.write(report, tables, out, api_url)
        publish_records(work, out / "records")
        done = True
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if made and not done:
            shutil.rmtree(out, ignore_errors=True)
