"""The DuckDB ledger: one schema, created by code, versioned, opened by one writer process.

DuckDB's file lock lets only one process open the file, so hosts never touch it: the ingester
(`tally ingest` or the API service) owns it, and threads inside that process each take their
own `cursor()`.

Restart lineage lives in `attempts.rolled_back_from_step`, derived by the one rule
(`tally.audit.core.exposure.rolled_back_from`). Rows of an attempt at or after that step were rolled
back; they stay in `consumption` (they prove whether the replay was exact) and the
`effective_consumption` view leaves them out. The `consumption` and `metrics` columns come
from tally.audit.core.schema.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from tally.audit.core.errors import TallyError
from tally.audit.core.exposure import effective_sql, rolled_back_from, rolled_back_sql, start_sql
from tally.audit.core.schema import (
    LEDGER_PREFIX,
    LEDGER_SUFFIX,
    METRIC_COLUMNS,
    SEGMENT_COLUMNS_ALL,
    sql_columns,
)
from tally.audit.hook.spool import replayed_sql
from tally.audit.ledger.integrity import DDL as INTEGRITY_DDL

if TYPE_CHECKING:  # both import this module
    from tally.audit.ledger.aggregates import Aggregates
    from tally.audit.ledger.lookup import LookupIndex

log = logging.getLogger("tally.lookup")

SCHEMA_VERSION = 4

# What tells the file ingested at a path from another put there later (tally.audit.ledger.ingest):
# its stat when ingested (unchanged: not read again), xxh3_64 of its Parquet footer, and its
# spool id (tally.audit.hook.spool). NULL in rows ingested before they were kept; a ledger made then
# gets the columns at its first writable opening (readers that do not know them are unchanged).
_IDENTITY_COLUMNS = (("mtime_ns", "BIGINT"), ("footer_hash", "UBIGINT"), ("spool_id", "VARCHAR"))
_FILE_IDENTITY = ",\n    ".join(f"{name} {kind}" for name, kind in _IDENTITY_COLUMNS)
# What the run's content hashes are taken over (tally.pipeline.text.ContentBasis, JSON; NULL: the
# run did not say), from its spool files' `tally.content_basis`. Added the same way: a ledger
# made before it gets the column at its first writable opening; a read-only one without it
# reads as NULL (`run_content_basis`).
_RUN_COLUMNS = (("content_basis", "VARCHAR"),)
_RUN_EXTRA = ",\n    ".join(f"{name} {kind}" for name, kind in _RUN_COLUMNS)

_DDL = f"""
CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL);
CREATE SEQUENCE run_ids START 1;
CREATE SEQUENCE file_ids START 1;
CREATE TABLE runs (
    run INTEGER PRIMARY KEY,
    run_id VARCHAR NOT NULL UNIQUE,
    manifest_fingerprint VARCHAR,
    first_ingested TIMESTAMP NOT NULL DEFAULT current_timestamp,
    {_RUN_EXTRA}
);
CREATE TABLE attempts (
    run INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    resumed_from_step BIGINT,          -- NULL for a fresh start
    host_count INTEGER NOT NULL,
    writer_version VARCHAR NOT NULL,
    rolled_back_from_step BIGINT,      -- derived: min resumed_from_step of later attempts
    records_per_epoch BIGINT,          -- train records the loader cycles through (writer metadata)
    checkpoint_dir VARCHAR,            -- where the trainer saves checkpoints (writer metadata)
    PRIMARY KEY (run, attempt)
);
CREATE TABLE segments (                -- one row per ingested spool file
    file_id INTEGER PRIMARY KEY,
    path VARCHAR NOT NULL UNIQUE,      -- relative to the spool root
    kind VARCHAR NOT NULL,             -- 'seg' or 'met'
    run INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    host INTEGER NOT NULL,
    first_step BIGINT NOT NULL,
    last_step BIGINT NOT NULL,
    n_rows BIGINT NOT NULL,
    n_tokens BIGINT NOT NULL,
    bytes BIGINT NOT NULL,
    ingested_at TIMESTAMP NOT NULL DEFAULT current_timestamp,
    {_FILE_IDENTITY}
);
CREATE TABLE consumption (
    {sql_columns(LEDGER_PREFIX + SEGMENT_COLUMNS_ALL + LEDGER_SUFFIX)}
);
CREATE TABLE metrics (
    {sql_columns(LEDGER_PREFIX + METRIC_COLUMNS + LEDGER_SUFFIX)}
);
CREATE TABLE quarantine (
    path VARCHAR PRIMARY KEY,
    bytes BIGINT NOT NULL,
    mtime_ns BIGINT NOT NULL,
    reason VARCHAR NOT NULL,
    quarantined_at TIMESTAMP NOT NULL DEFAULT current_timestamp
);
CREATE VIEW effective_consumption AS
    SELECT c.* FROM consumption c JOIN attempts a USING (run, attempt)
    WHERE {effective_sql("c", "a")};
CREATE VIEW rolled_back_consumption AS
    SELECT c.* FROM consumption c JOIN attempts a USING (run, attempt)
    WHERE {rolled_back_sql("c", "a")};
-- Aggregates kept at ingest (audit/ledger/aggregates.py), in each file's transaction, so the
-- live API never scans `consumption`. An exposure is a record-start segment ({start_sql()}).
CREATE TABLE agg_steps (               -- per (file, host, step); readers drop rolled-back steps
    run INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    host INTEGER NOT NULL,
    step BIGINT NOT NULL,
    segments BIGINT NOT NULL,
    tokens BIGINT NOT NULL,
    exposures BIGINT NOT NULL,
    file_id INTEGER NOT NULL
);
CREATE TABLE agg_ranks (               -- effective: records whose rank-th exposure is at this step
    run INTEGER NOT NULL,
    rank TINYINT NOT NULL,             -- 1 (first seen), 2, 3
    step BIGINT NOT NULL,
    records BIGINT NOT NULL,
    PRIMARY KEY (run, rank, step)
);
CREATE TABLE agg_levels (              -- effective: records seen exactly `level` (>= 1) times
    run INTEGER NOT NULL,
    level BIGINT NOT NULL,
    records BIGINT NOT NULL,
    PRIMARY KEY (run, level)
);
CREATE TABLE agg_host_pairs (          -- effective: records both hosts saw (a = b: unique per host)
    run INTEGER NOT NULL,
    a INTEGER NOT NULL,
    b INTEGER NOT NULL,
    records BIGINT NOT NULL,
    PRIMARY KEY (run, a, b)
);
CREATE TABLE agg_hosts (               -- effective: records a host saw that another host saw too
    run INTEGER NOT NULL,
    host INTEGER NOT NULL,
    shared BIGINT NOT NULL,
    PRIMARY KEY (run, host)
);
CREATE TABLE agg_runs (                -- effective totals per run
    run INTEGER PRIMARY KEY,
    seg_files BIGINT NOT NULL,         -- segment files applied (checked against `segments`)
    records BIGINT NOT NULL,           -- distinct records seen
    exposures BIGINT NOT NULL,
    epoch_duplicates BIGINT NOT NULL,  -- exposures beyond the first of a record in one epoch
    epoch_duplicate_records BIGINT NOT NULL,
    multi_host_records BIGINT NOT NULL -- records seen by two or more hosts
);
CREATE SEQUENCE preflight_ids START 1;
CREATE TABLE preflight_verdicts (      -- every pre-flight verdict (audit/preflight.py)
    id INTEGER PRIMARY KEY,
    run_id VARCHAR NOT NULL,           -- a name, not runs.run: the run may not be ingested yet
    checked_at TIMESTAMP NOT NULL DEFAULT current_timestamp,
    checkpoint_step BIGINT,
    old_hosts INTEGER,
    new_hosts INTEGER,
    old_global_batch INTEGER,
    new_global_batch INTEGER,
    horizon_steps INTEGER,
    status VARCHAR NOT NULL,           -- 'safe' | 'unsafe' | 'unknown'
    forced BOOLEAN NOT NULL,           -- the resume went ahead against an unsafe verdict
    requested_by VARCHAR NOT NULL,     -- 'cli' | 'api' | 'trainer'
    headline VARCHAR NOT NULL,
    verdict VARCHAR NOT NULL           -- the whole verdict as JSON (findings, numbers)
);
"""


def one(cur: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | None = None) -> tuple | None:
    """The first row of a query, with the result fully consumed (DuckDB 2 refuses new work on
    a cursor whose last result is still open)."""
    rows = cur.execute(sql, params or []).fetchall()
    return rows[0] if rows else None


def memory_limit_mb() -> int:
    """DuckDB's memory for a ledger: TALLY_DUCKDB_MEMORY_GB, else a quarter of the machine's
    memory (at least 1 GiB). DuckDB's default, 80%, let its buffer pool keep the pages it wrote:
    a 500M-row `tally ingest` peaked at 15.5 GiB of 24, beside a per-record state that at the
    seed run's size needs the machine's memory itself; with 4 GB it ingested 100M rows as fast
    (61 against 75 s, the same peak)."""
    gb = os.environ.get("TALLY_DUCKDB_MEMORY_GB")
    if gb:
        try:
            return max(64, int(float(gb) * 1024))
        except (ValueError, OverflowError):
            raise TallyError(f"TALLY_DUCKDB_MEMORY_GB={gb!r} is not a number of GB") from None
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1024, total // 4 // 2**20)


# DuckDB's words for a disk that is full, and for a file that does not hold what DuckDB wrote
# (truncated, overwritten, a bad sector): at open, or only once a query reads the bad block.
_FULL = ("No space left on device", "File too large", "Disk quota exceeded")
_DAMAGED = ("Corrupt database file", "Could not read enough bytes")


def ledger_error(path: str | os.PathLike, exc: BaseException) -> TallyError | None:
    """What a DuckDB error raised while working on the ledger at `path` says about the file,
    as one line: its disk is full, or the file is damaged; None for any other error (a bug,
    shown as one). The cause is searched along the exception's chain: a disk that fills during
    a COMMIT fails it, and the ROLLBACK after it then fails with "cannot rollback" or "database
    has been invalidated". The ledger holds whole batches only (a COMMIT whose checkpoint
    failed is in its write-ahead log, or not at all): the next ingest takes up the files that
    are not in it."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, duckdb.Error):
            chain.append(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
        exc = exc.__context__
    full = [m for m in chain if any(w in m for w in _FULL)]
    if full:
        return TallyError(f"ledger {path}: the disk is full ({full[-1]}); what was committed "
                          "is kept: free space, and the next ingest goes on from there")
    damaged = [m for m in chain if any(w in m for w in _DAMAGED)]
    if damaged:
        return TallyError(f"ledger {path} is damaged ({damaged[-1]}): restore it from a "
                          "backup, or ingest the spool again into a new ledger file")
    return None


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _json_differences(was: str, now: str) -> str:
    """The keys of two JSON objects whose values differ, "key now, not was" (raw when either
    is not an object)."""
    try:
        a, b = json.loads(was), json.loads(now)
        keys = sorted(k for k in {*a, *b} if a.get(k) != b.get(k) and k != "tokenizer_name")
    except (ValueError, AttributeError):
        return f"{now}, not {was}"
    return "; ".join(f"{k} {b.get(k)}, not {a.get(k)}" for k in keys) or f"{now}, not {was}"


class Ledger:
    """An open ledger file. Use as a context manager; `cursor()` per thread."""

    def __init__(self, path: str | os.PathLike, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.ledger_id: str | None = None
        # What this process derives from the ledger, made on first need and owned here: the
        # per-record aggregates (tally.audit.ledger.aggregates.for_ledger, dropped by their
        # `invalidate`) and the lookup index (tally.audit.ledger.lookup.for_ledger, flushed at
        # close).
        self._aggregates: Aggregates | None = None
        self._lookup: LookupIndex | None = None
        if read_only and not self.path.exists():
            raise TallyError(f"no ledger at {self.path}")
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except duckdb.IOException as exc:
            msg = str(exc)
            if "lock" in msg.lower():
                raise TallyError(
                    f"ledger {self.path} is held by another process (one process at a time may "
                    f"open a DuckDB file, even to read). While `tally serve` owns it, ask its "
                    f"API (GET /v1/runs, /v1/runs/RUN/...) or give the command the spool "
                    f"instead (--spool DIR, e.g. tally reconcile --spool); else stop that "
                    f"process. DuckDB: {_first_line(msg)}"
                ) from None
            raise TallyError(f"cannot open ledger {self.path}: {msg}") from None
        except duckdb.Error as exc:
            raise TallyError(f"{self.path} is not a readable DuckDB ledger: {exc}") from None
        try:
            self.con.execute(f"SET memory_limit = '{memory_limit_mb()}MiB'")
            self._check_or_create(read_only)
        except BaseException:
            self.con.close()
            raise

    def _check_or_create(self, read_only: bool) -> None:
        tables = {r[0] for r in self.con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'"
        ).fetchall()}
        if not tables:
            if read_only:
                raise TallyError(f"{self.path} is an empty DuckDB file, not a Tally ledger")
            self.con.execute("BEGIN")
            self.con.execute(_DDL)
            self.con.execute("INSERT INTO meta VALUES ('schema_version', ?), ('ledger_id', ?)",
                             [str(SCHEMA_VERSION), uuid.uuid4().hex])
            self.con.execute(INTEGRITY_DDL)
            self.con.execute("COMMIT")
            self.ledger_id = self._ledger_id()
            return
        if "meta" not in tables:
            raise TallyError(f"{self.path} is a DuckDB file but not a Tally ledger (no meta table)")
        row = one(self.con, "SELECT value FROM meta WHERE key = 'schema_version'")
        found = row[0] if row else "none"
        if found != str(SCHEMA_VERSION):
            raise TallyError(
                f"ledger {self.path} has schema version {found}; this Tally reads version "
                f"{SCHEMA_VERSION}. Re-ingest the spool into a new ledger file."
            )
        self.ledger_id = self._ledger_id()
        if self.ledger_id is None and not read_only:
            # A ledger made before ledgers had an id (same schema version: an extra meta row
            # changes nothing for a reader that does not know it).
            self.con.execute("INSERT INTO meta VALUES ('ledger_id', ?) ON CONFLICT DO NOTHING",
                             [uuid.uuid4().hex])
            self.ledger_id = self._ledger_id()
        if not read_only:
            have = {r[0] for r in self.con.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = 'main' "
                "AND table_name = 'segments'").fetchall()}
            for name, kind in _IDENTITY_COLUMNS:
                if name not in have:
                    self.con.execute(f"ALTER TABLE segments ADD COLUMN {name} {kind}")
            have = self._columns("runs")
            for name, kind in _RUN_COLUMNS:
                if name not in have:
                    self.con.execute(f"ALTER TABLE runs ADD COLUMN {name} {kind}")
            # Integrity checked at ingest (tally.audit.ledger.integrity): tables a ledger made
            # before them gets here; a reader that does not know them is unchanged.
            self.con.execute(INTEGRITY_DDL)

    def _columns(self, table: str) -> set[str]:
        return {r[0] for r in self.con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = 'main' "
            "AND table_name = ?", [table]).fetchall()}

    def run_content_basis(self, run: int) -> str | None:
        """The content basis (JSON) the run's spool files said; None when they did not, or
        the ledger predates the column (opened read-only)."""
        if "content_basis" not in self._columns("runs"):
            return None
        row = one(self.con, "SELECT content_basis FROM runs WHERE run = ?", [run])
        return row[0] if row else None

    def _ledger_id(self) -> str | None:
        """The ledger's random id (`meta`), which its state snapshots carry
        (tally.audit.ledger.snapshot); None in a read-only ledger made before ledgers had one."""
        row = one(self.con, "SELECT value FROM meta WHERE key = 'ledger_id'")
        return None if row is None else row[0]

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A cursor for one thread (DuckDB connections are not shared across threads)."""
        return self.con.cursor()

    def close(self) -> None:
        # The lookup index's runs still in memory go to disk (tally.audit.ledger.lookup.flush): the
        # next process then indexes none of those files again.
        index = self._lookup
        if index is not None:
            try:
                index.flush()
            except Exception as exc:  # noqa: BLE001 (derived data: lookups scan instead)
                log.warning("lookup index not written: %s: %s", type(exc).__name__, exc)
        agg = self._aggregates
        if agg is not None:  # its state no longer counts against the process's bound
            agg.invalidate(self)
        self.con.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- writes used by ingest (inside the caller's transaction) ---------------------------
    def ensure_run(self, cur: duckdb.DuckDBPyConnection, run_id: str, fingerprint: str,
                   content_basis: str | None = None) -> int:
        row = one(cur, "SELECT run, manifest_fingerprint, content_basis FROM runs "
                  "WHERE run_id = ?", [run_id])
        if row is None:
            run = one(cur, "SELECT nextval('run_ids')")[0]
            cur.execute("INSERT INTO runs (run, run_id, manifest_fingerprint, content_basis) "
                        "VALUES (?, ?, ?, ?)",
                        [run, run_id, fingerprint or None, content_basis or None])
            return run
        run, known, known_basis = row
        if fingerprint and known and fingerprint != known:
            raise ValueError(f"manifest fingerprint {fingerprint} differs from the run's {known}")
        # One basis a run, like its manifest: a file hashed otherwise is set aside, named.
        if content_basis and known_basis and content_basis != known_basis:
            differ = _json_differences(known_basis, content_basis)
            raise ValueError(f"content basis differs from the run's ({differ}): the file's "
                             "content hashes are taken otherwise")
        if (fingerprint and not known) or (content_basis and not known_basis):
            cur.execute("UPDATE runs SET manifest_fingerprint = coalesce(manifest_fingerprint, "
                        "?), content_basis = coalesce(content_basis, ?) WHERE run = ?",
                        [fingerprint or None, content_basis or None, run])
        return run

    def ensure_attempt(self, cur: duckdb.DuckDBPyConnection, run: int, attempt: int,
                       resumed_from_step: int | None, host_count: int, writer_version: str,
                       records_per_epoch: int | None = None,
                       checkpoint_dir: str | None = None) -> None:
        row = one(cur, "SELECT resumed_from_step, host_count, records_per_epoch FROM attempts "
                  "WHERE run = ? AND attempt = ?", [run, attempt])
        if row is None:
            cur.execute(
                "INSERT INTO attempts (run, attempt, resumed_from_step, host_count, writer_version,"
                " records_per_epoch, checkpoint_dir) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [run, attempt, resumed_from_step, host_count, writer_version, records_per_epoch,
                 checkpoint_dir],
            )
            resumed = dict(cur.execute("SELECT attempt, resumed_from_step FROM attempts "
                                       "WHERE run = ?", [run]).fetchall())
            cur.executemany("UPDATE attempts SET rolled_back_from_step = ? "
                            "WHERE run = ? AND attempt = ?",
                            [[cut, run, a] for a, cut in rolled_back_from(resumed).items()])
            return
        if tuple(row[:2]) != (resumed_from_step, host_count):
            raise ValueError(
                f"metadata says attempt {attempt} resumed from {resumed_from_step} on "
                f"{host_count} hosts, but earlier files of it say {row[0]} on {row[1]} hosts"
            )
        if records_per_epoch is not None and row[2] != records_per_epoch:
            if row[2] is not None:
                raise ValueError(
                    f"metadata says attempt {attempt} cycles through {records_per_epoch} records "
                    f"per epoch, but earlier files of it say {row[2]}")
            cur.execute("UPDATE attempts SET records_per_epoch = ? WHERE run = ? AND attempt = ?",
                        [records_per_epoch, run, attempt])
        if checkpoint_dir is not None:
            cur.execute("UPDATE attempts SET checkpoint_dir = ? WHERE run = ? AND attempt = ? "
                        "AND checkpoint_dir IS NULL", [checkpoint_dir, run, attempt])

    # ---- reads ------------------------------------------------------------------------------
    def query(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        cur = self.cursor()
        try:
            res = cur.execute(sql, params or [])
            names = [d[0] for d in res.description]
            return [dict(zip(names, r, strict=True)) for r in res.fetchall()]
        finally:
            cur.close()

    def overview(self) -> dict[str, Any]:
        """Runs, attempts, hosts with step ranges and row counts, and quarantined files."""
        runs = self.query("SELECT run, run_id, manifest_fingerprint FROM runs ORDER BY run_id")
        attempts = self.query(f"""
            SELECT a.run, a.attempt, a.resumed_from_step, a.host_count, a.rolled_back_from_step,
                   {replayed_sql("a")} AS replayed, coalesce(sum(h.segments), 0) AS segments,
                   coalesce(sum(h.segments) FILTER (
                       WHERE h.step >= a.rolled_back_from_step), 0) AS rolled_back_segments
            FROM attempts a LEFT JOIN agg_steps h USING (run, attempt)
            GROUP BY ALL ORDER BY a.run, a.attempt""")
        hosts = self.query("""
            SELECT run, attempt, host, count(*) AS files, min(first_step) AS first_step,
                   max(last_step) AS last_step, sum(n_rows) AS segments, sum(n_tokens) AS tokens
            FROM segments WHERE kind = 'seg' GROUP BY ALL ORDER BY run, attempt, host""")
        out = []
        for r in runs:
            atts = [a for a in attempts if a["run"] == r["run"]]
            for a in atts:
                a["hosts"] = [h for h in hosts
                              if h["run"] == r["run"] and h["attempt"] == a["attempt"]]
            out.append({**r, "attempts": atts})
        quarantine = self.query("SELECT path, reason FROM quarantine ORDER BY path")
        return {"runs": out, "quarantine": quarantine}
