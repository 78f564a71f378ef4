"""The diff job (Beam): did two runs consume the same records, step by step?

Each run is read as reconcile reads one (tally.audit.buckets.stages.ReadConsumption: spool
files or a ledger export, restart lineage applied, effective rows cut into record-key bucket
files), with the same bucket layout for both runs, sized for both runs' rows. Each bucket then
joins A's and B's slices with the bucket's manifest rows (CoGroupByKey on the bucket number, no
side input) and compares them with numpy (tally.audit.posthoc.diff_bucket). Partials are typed
and merged by the driver, with the same checks as reconcile: every effective row and bucket
slice of both runs reached the join, no bucket was delivered twice with different values. Only
Create, ParDo, GroupByKey and Flatten: FnApiRunner, Dask and the other Beam runners take it
alike.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import apache_beam as beam

from tally.audit.buckets import exchange
from tally.audit.buckets.partials import Partial, merge_all
from tally.audit.buckets.plan import (
    BUCKETS_IN_FLIGHT,
    MAX_RUN_STEPS,
    Plan,
    PlanOptions,
    bucket_records_for,
    check_span,
    chunks,
    in_flight,
    make_plan,
)
from tally.audit.buckets.stages import (
    ReadConsumption,
    load_partials,
    manifest_bucket,
    of_kind,
    publish_records,
    save_partials,
    write_part,
)
from tally.audit.core.errors import TallyError
from tally.audit.posthoc import diff_bucket
from tally.audit.posthoc.diff_bucket import RUNS, DiffPartial
from tally.audit.posthoc.sources import RunSource, inputs
from tally.pipeline.runners import RunnerSpec, pipeline, threaded

WINDOWS = 20  # windows of steps when --window is not given: about this many over the runs


@dataclass
class DiffPlan:
    """Both runs' plans (the same manifest and bucket layout) and the window size."""

    runs: dict[str, Plan]
    sources: dict[str, RunSource]
    window: int  # steps per window

    @property
    def layout(self) -> Plan:
        return self.runs["a"]

    def for_workers(self) -> DiffPlan:
        """Without the runs' lists of input files (Plan.for_workers)."""
        return DiffPlan({r: p.for_workers() for r, p in self.runs.items()}, self.sources,
                        self.window)

    @property
    def first_step(self) -> int:
        """The first step either run consumed: the job's per-step series start here."""
        return min(p.first_step for p in self.runs.values())

    @property
    def last_step(self) -> int:
        last = max(max([x["last_step"] for x in p.attempts.values()] + [-1])
                   for p in self.runs.values())
        at = self.layout.at_step
        return last if at is None else min(last, at)


def make_diff_plan(sources: dict[str, RunSource], manifest: str | Path, work: Path, *,
                   at_step: int | None = None, window: int | None = None,
                   bucket_records: int | None = None, memory_gb: float = 3.0,
                   buckets_in_flight: int = BUCKETS_IN_FLIGHT) -> DiffPlan:
    from tally.pipeline.manifest_file import manifest_info

    info = manifest_info(manifest)
    found = {r: inputs(src, work, f"export-{r}") for r, src in sources.items()}
    if bucket_records is None:  # one layout, sized for both runs' rows in a bucket
        rows = sum(a.get("rows", 0) for got in found.values()
                   for a in got.attempts.values())
        hosts = max([a["host_count"] for got in found.values()
                     for a in got.attempts.values()] + [1])
        bucket_records = bucket_records_for(int(info["records"]), rows, hosts, memory_gb,
                                            buckets_in_flight)
    options = PlanOptions(at_step=at_step, bucket_records=bucket_records, memory_gb=memory_gb,
                          job="diff")
    runs = {}
    for r, got in found.items():
        runs[r] = make_plan(sources[r].run_id, manifest, got, options)
        runs[r].replay_ranges = []  # a diff compares effective rows only
    plan = DiffPlan(runs, sources, 1)
    if window is not None and window < 1:
        raise TallyError("--window must be >= 1 step")
    span = plan.last_step - plan.first_step + 1
    if span > MAX_RUN_STEPS:
        raise TallyError(f"the runs span steps {plan.first_step}..{plan.last_step} together, "
                         f"{span:,} steps: a diff may span at most {MAX_RUN_STEPS:,}")
    check_span("the two runs span", plan.first_step, plan.last_step, memory_gb, "diff")
    plan.window = window or max(1, -(-max(span, 1) // WINDOWS))
    return plan


def _tag(item: tuple[str, Partial], run: str) -> tuple[str, DiffPartial]:
    key, partial = item
    return f"{run}-{key}", DiffPartial(read={run: partial})


class CompareBucket(beam.DoFn):
    """One bucket: A's and B's rows (from the bucket files) and the bucket's manifest rows
    (read here, by key range) compared: a partial, and a part file of per-record rows."""

    def __init__(self, plan: DiffPlan, parts: str) -> None:
        self.plan, self.parts = plan, parts

    def process(self, item):
        bucket, grouped = item
        layout = self.plan.layout
        overflow = bucket == layout.buckets
        slices = {r: list(grouped[r]) for r in RUNS}
        rows = {r: exchange.read(slices[r], overflow=overflow) for r in RUNS}
        first = self.plan.first_step
        for r in RUNS:  # steps since the first step of either run: the series and windows
            rows[r]["step"] -= first
        out, records = diff_bucket.compute(manifest_bucket(layout, bucket), rows,
                                           bucket * layout.bucket_size, self.plan.window, first)
        out.slices_joined = {r: len(slices[r]) for r in RUNS}
        if records is not None:
            write_part(records, Path(self.parts, f"part-{bucket:06d}.parquet"))
        yield f"bucket-{bucket}", out


def run_diff(plan: DiffPlan, work: Path, runner: RunnerSpec | None = None) -> DiffPartial:
    """Run the pipeline; return the merged partials. Workers write bucket files, per-record
    parts and partial results under `work`, which must be reachable from every worker."""
    (work / "records").mkdir(parents=True)
    tasks = {r: chunks(plan.runs[r].files) for r in RUNS}
    slim = plan.for_workers()
    runner = runner or RunnerSpec()
    with pipeline(runner, partitions=max(2, sum(map(len, tasks.values())))) as p:
        refs, tagged = {}, []
        for r in RUNS:
            read = (p | f"files {r}" >> beam.Create(tasks[r])
                    | f"read {r}" >> beam.ParDo(threaded(runner, ReadConsumption(
                        slim.runs[r], str(work / f"buckets-{r}")))))
            refs[r] = read | f"by_bucket {r}" >> beam.FlatMap(of_kind, "by_bucket")
            tagged.append(read | f"partials {r}" >> beam.FlatMap(of_kind, "partials")
                          | f"tag {r}" >> beam.Map(_tag, r))
        # Every bucket, consumed or not: records neither run saw count too.
        every = p | "buckets" >> beam.Create(
            [(b, b) for b in range(plan.layout.buckets + 1)], reshuffle=False)
        joined = ({"a": refs["a"], "b": refs["b"], "manifest": every}
                  | "join" >> beam.CoGroupByKey())
        stats = joined | "compare" >> beam.ParDo(threaded(runner, CompareBucket(
            slim, str(work / "records"))))
        save_partials((stats, *tagged), work)
    merged = merge_all(load_partials(work / "partials", finished=work / "saved"), DiffPartial())
    for r in RUNS:
        read = merged.read.get(r, Partial())
        joined = merged.rows_joined.get(r, 0), merged.slices_joined.get(r, 0)
        if (read.segments, read.slices_written) != joined:
            raise TallyError(f"the diff job lost rows of run {r.upper()}: {read.segments:,} "
                             f"effective rows read, {joined[0]:,} joined; "
                             f"{read.slices_written:,} bucket slices written, {joined[1]:,} "
                             f"joined (runner {runner}); no diff written")
    return merged


def diff(*, a: RunSource, b: RunSource, manifest: str | Path, out: str | Path,
         at_step: int | None = None, window: int | None = None,
         runner: RunnerSpec | None = None, bucket_records: int | None = None,
         memory_gb: float = 3.0) -> dict:
    """Two runs -> plan -> Beam job -> diff files in `out`; returns diff.json's content."""
    from tally.audit.posthoc import diff_report

    if not Path(manifest).exists():
        raise TallyError(f"no manifest at {manifest}")
    # Absolute: workers elsewhere do not share this process's working directory.
    out, manifest = Path(out).absolute(), Path(manifest).absolute()
    work = out / ".work"  # under the output, which workers elsewhere must reach too
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        plan = make_diff_plan({"a": a, "b": b}, manifest, work, at_step=at_step, window=window,
                              bucket_records=bucket_records, memory_gb=memory_gb,
                              buckets_in_flight=in_flight((runner or RunnerSpec()).parallel))
        merged = run_diff(plan, work, runner)
        report, tables = diff_report.build(plan, merged)
        diff_report.write(report, tables, out)
        publish_records(work, out / "records", diff_bucket.RECORDS_SCHEMA)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
