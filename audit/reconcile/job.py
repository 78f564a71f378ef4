"""The reconcile job (Beam): a run's consumption against the corpus manifest.

Inputs are a frozen list of consumption files (tally.audit.buckets.plan): the run's published
spool segment files, or an export of the ledger. The consumption is cut into record-key buckets
and joined with the manifest bucket by bucket (CoGroupByKey on the bucket number; each bucket's
manifest rows are read by key range where the bucket is computed, so there are no side inputs).
The rows travel between the two stages as bucket files (tally.audit.buckets.exchange, read by
tally.audit.buckets.stages.ReadConsumption): the shuffle carries only references to them, and
each bucket is computed with numpy over its columns (tally.audit.reconcile.bucket_stats), never
one Python object per row. Every worker emits typed partial results
(tally.audit.buckets.partials) that the driver merges; per-record rows are written as part files
that the driver moves into place. Only Create, ParDo, GroupByKey and Flatten are used, the
primitives every runner translates, Dask's included.

Restart lineage (tally.audit.core.exposure) splits rows into effective and rolled back;
rolled-back rows are compared step by step with the surviving replay.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import apache_beam as beam
import numpy as np

from tally.audit.buckets import exchange
from tally.audit.buckets.partials import Partial, merge_all
from tally.audit.buckets.plan import (
    Plan,
    PlanOptions,
    chunks,
    in_flight,
    ledger_inputs,
    make_plan,
    metric_facts,
    milestones,
    run_finished,
    spool_inputs,
)
from tally.audit.buckets.stages import (
    Columns,
    ReadConsumption,
    load_partials,
    manifest_bucket,
    name_of,
    of_kind,
    publish_records,
    rows_where,
    save_partials,
    write_part,
)
from tally.audit.core.errors import TallyError
from tally.audit.reconcile import bucket_stats
from tally.pipeline.progress import Progress
from tally.pipeline.runners import RunnerSpec, pipeline, threaded

# ---- stage 1: the run's metric files (its consumption: tally.audit.buckets.stages) ----------

class ReadMetrics(beam.DoFn):
    """A chunk of the run's metric files -> its partial of metric facts (NaN or infinite
    losses, hosts that said they finished, losses per step for the milestones)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def process(self, files: tuple):
        yield (f"metrics-{name_of(chr(10).join(str(f.path) for f in files))}",
               metric_partial(self.plan, files))


METRIC_FILES_A_TASK = 512



# ---- stage 2: the join, per bucket -----------------------------------------------------------

class BucketStats(beam.DoFn):
    """One bucket: its manifest rows (read here, by key range) joined with its consumption
    (read from the bucket files): a partial, and a part file of per-record rows."""

    def __init__(self, plan: Plan, parts: str) -> None:
        self.plan, self.parts = plan, parts

    def process(self, item):
        bucket, grouped = item
        slices = list(grouped["consumption"])
        rows = exchange.read(slices, overflow=bucket == self.plan.buckets)
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
                    rolled.setdefault(int(a), []).append(rows_where(p, p["attempt"] == a))
        for a, ps in rolled.items():
            hosts = np.unique(np.concatenate([p["host"] for p in ps]))
            if replay_hosts == self.host_counts[a]:
                theirs = [rows_where(p, np.isin(p["host"], hosts)) for p in replayed]
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
    runner = runner or RunnerSpec()
    with pipeline(runner, partitions=max(2, len(tasks))) as p:
        # Create spreads its elements over the workers itself (a Reshuffle inside).
        read = (p | "files" >> beam.Create(tasks)
                  | "read" >> beam.ParDo(threaded(runner, ReadConsumption(
                      slim, str(work / "buckets")))))
        # Outputs are (kind, value) pairs split by FlatMaps, not tagged outputs: the Dask
        # runner sends every tagged output to the main one.
        out = {kind: read | kind >> beam.FlatMap(of_kind, kind)
               for kind in ("by_bucket", "partials", "replay")}
        # Every bucket, consumed or not: never-seen records count too.
        every = p | "buckets" >> beam.Create([(b, b) for b in range(plan.buckets + 1)],
                                              reshuffle=False)  # the join shuffles them
        joined = ({"consumption": out["by_bucket"], "manifest": every}
                  | "join" >> beam.CoGroupByKey())
        stats = joined | "stats" >> beam.ParDo(threaded(runner, BucketStats(
            slim, str(work / "records"))))
        replay = (out["replay"] | "by step" >> beam.GroupByKey()
                  | "compare" >> beam.ParDo(CompareReplay(
                      {a: int(info["host_count"]) for a, info in plan.attempts.items()})))
        results = [stats, replay, out["partials"]]
        if metric_tasks:
            results.append(p | "metric files" >> beam.Create(metric_tasks)
                           | "metrics" >> beam.ParDo(ReadMetrics(slim)))
        save_partials(tuple(results), work)
    merged = merge_all(load_partials(work / "partials", finished=work / "saved"))
    with_metric_facts(plan, merged)
    joined = merged.unknown_segments + merged.hash_checked + merged.hash_unverifiable
    if (merged.segments, merged.slices_written) != (joined, merged.slices_joined):
        raise TallyError(f"the reconcile job lost rows: {merged.segments:,} effective rows "
                         f"read, {joined:,} joined with the manifest; {merged.slices_written:,} "
                         f"bucket slices written, {merged.slices_joined:,} joined (runner "
                         f"{runner}); no report written")
    return merged


def metric_partial(plan: Plan, files: list) -> Partial:
    """The metric facts of some of the run's metric files, as a partial."""
    facts = metric_facts(list(files), plan.cutoffs)
    count, first = facts["non_finite"]
    return Partial(non_finite_losses=count, non_finite_first_step=first,
                   finished_at=facts["finished"], loss_sums=facts["loss_sums"])


def with_metric_facts(plan: Plan, merged: Partial) -> None:
    """The plan given the run's metric facts from the merged partials (a spool's: a ledger's
    were read by SQL, in its inputs)."""
    if plan.metric_files:
        plan.non_finite_losses = {"count": merged.non_finite_losses,
                                  "first_step": merged.non_finite_first_step}
        plan.finished, plan.finished_step = run_finished(plan.attempts, merged.finished_at,
                                                         plan.at_step)
        plan.milestones = milestones(merged.loss_sums)


@dataclass(frozen=True)
class ReconcileJob:
    """One reconcile as `reconcile` was asked for it (the manifest and the output absolute)."""

    run_id: str
    manifest: Path
    out: Path
    spool: str | Path | None  # exactly one of spool and ledger
    ledger: str | Path | None
    runner: RunnerSpec | None
    api_url: str | None  # the API report.html's evidence links open
    plan: PlanOptions


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
    job = ReconcileJob(run_id, manifest, out, spool, ledger, runner, api_url,
                       PlanOptions(at_step=at_step, bucket_records=bucket_records,
                                   memory_gb=memory_gb,
                                   in_flight=in_flight((runner or RunnerSpec()).parallel)))
    with Progress(f"reconcile {run_id}", progress) as bar:
        return _reconcile(job, work, made, bar)


def _reconcile(job: ReconcileJob, work: Path, made: bool, bar: Progress) -> dict:
    """`job` run in `work`, its report written to `job.out` (`made`: by this call, so removed
    when the job fails)."""
    from tally.audit.reconcile import report as rp

    run_id, spool, ledger, out = job.run_id, job.spool, job.ledger, job.out
    done = False
    try:
        bar.stage("reading the inputs")
        if spool is not None:
            if not Path(spool).is_dir():
                raise TallyError(f"spool {spool} is not a directory")
            inputs = spool_inputs(Path(spool).absolute(), run_id)
        else:
            inputs = ledger_inputs(Path(ledger), run_id, work)
        plan = make_plan(run_id, job.manifest, inputs, job.plan)
        parts = work / "records"
        bar.stage("key buckets", total=plan.buckets + 1,
                  count=lambda: sum(1 for _ in parts.glob("part-*.parquet")))
        merged = run_reconcile(plan, work, job.runner)
        bar.stage("writing the report")
        report, tables = rp.build(plan, merged, ("spool", Path(spool).absolute())
                                  if spool is not None else ("ledger", Path(ledger).absolute()))
        rp.write(report, tables, out, job.api_url)
        publish_records(work, out / "records", bucket_stats.RECORDS_SCHEMA)
        done = True
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if made and not done:
            shutil.rmtree(out, ignore_errors=True)
