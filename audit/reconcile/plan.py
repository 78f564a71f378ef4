"""What a reconcile job reads and how it cuts the work: the input files (a run's spool segment
files, or an export of the ledger), the attempts and their rollback cutoffs, and the record-key
buckets sized to the memory budget. Decided once, before the pipeline starts (`Plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from audit.core.errors import TallyError
from audit.core.exposure import rolled_back_from
from audit.core.schema import SEGMENT_COLUMNS, names, sql_select
from audit.hook import spool as sp
from audit.ledger.database import Ledger

# What the job reads of each row: the segment columns, with the row's attempt.
COLUMNS = ("attempt", *names(SEGMENT_COLUMNS))
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


def ledger_inputs(ledger_path: Path, run_id: str, workdir: Path,
                  folder: str = "export") -> tuple[list, dict, str | None]:
    """The run's rows exported from the ledger as Parquet files under `workdir / folder`."""
    with Ledger(ledger_path, read_only=True) as ledger:
        run = ledger.query("SELECT run, manifest_fingerprint FROM runs WHERE run_id = ?",
                           [run_id])
        if not run:
            raise TallyError(f"run {run_id!r} is not in ledger {ledger_path}")
        rows = ledger.query("""
            SELECT a.attempt, a.resumed_from_step, a.host_count, max(h.step) AS last_step,
                   coalesce(sum(h.segments), 0) AS rows
            FROM attempts a LEFT JOIN agg_steps h USING (run, attempt)
            WHERE a.run = ? GROUP BY ALL""", [run[0]["run"]])
        attempts = {r["attempt"]: {"resumed_from_step": r["resumed_from_step"],
                                   "host_count": r["host_count"],
                                   "last_step": r["last_step"] if r["last_step"] is not None
                                   else -1, "rows": int(r["rows"])} for r in rows}
        out = workdir / folder
        target = str(out).replace("'", "''")  # a path is no SQL parameter in COPY ... TO
        ledger.con.execute(f"""
            COPY (SELECT attempt, {sql_select(SEGMENT_COLUMNS)}
                  FROM consumption WHERE run = {int(run[0]['run'])})
            TO '{target}' (FORMAT parquet, PER_THREAD_OUTPUT true, FILE_SIZE_BYTES '64MB')""")
    files = [InputFile(str(p)) for p in sorted(out.glob("*.parquet"))]
    return files, attempts, run[0]["manifest_fingerprint"]


def bucket_records_for(records: int, rows: int, hosts: int, memory_gb: float) -> int:
    """Records per bucket: the most that keep BUCKETS_IN_FLIGHT buckets of `rows` consumption
    rows spread over `records` records within `memory_gb`, and each bucket under BUCKET_ROWS.
    A job over two runs (audit.posthoc.diff) passes both runs' rows: a bucket holds both."""
    per_record = rows / max(records, 1) * BYTES_PER_ROW + BYTES_PER_RECORD + hosts
    out = min(int(memory_gb * 2**30 / BUCKETS_IN_FLIGHT / per_record),
              int(BUCKET_ROWS * records / max(rows, 1)))
    return min(max(out, 10_000), 4_000_000)


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
        bucket_records = bucket_records_for(records, rows, hosts, memory_gb)
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
