"""Exactly-once ingest of spool files into the ledger.

Each published file is checked (footer, schema, metadata, row count, values) and then ingested
in one transaction together with its `segments` row, so a file is in the ledger entirely or not
at all, and a file already listed in `segments` is skipped: re-running ingest, or being killed
in the middle of it, never counts a row twice. A file that fails a check is quarantined (listed
in the ledger's `quarantine` table with the reason, and reported); the other files still ingest.
A quarantined file is tried again only if it changes on disk.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from audit import spool as sp
from audit.aggregates import Starts, for_ledger
from audit.ledger import Ledger, one


class BadFile(Exception):
    """A spool file that cannot be ingested; the message says why."""


@dataclass
class IngestResult:
    files: int = 0
    rows: int = 0
    already: int = 0
    quarantined: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        rate = self.rows / self.seconds if self.seconds > 0 else 0.0
        s = (f"ingested {self.files} files ({self.rows:,} rows) in {self.seconds:.2f} s "
             f"({rate:,.0f} rows/s); {self.already} already in the ledger")
        if self.quarantined:
            s += f"; {len(self.quarantined)} quarantined"
        return s


def _meta(md: dict[bytes, bytes] | None) -> dict[str, str]:
    md = md or {}
    out = {}
    for k in sp.META_KEYS:
        raw = md.get((sp.META_PREFIX + k).encode())
        if raw is None:
            raise BadFile(f"metadata key {sp.META_PREFIX + k} is missing (not written by Tally?)")
        out[k] = raw.decode()
    return out


def _int(meta: dict[str, str], key: str) -> int:
    try:
        return int(meta[key])
    except ValueError:
        raise BadFile(f"metadata {key}={meta[key]!r} is not an integer") from None


def read_checked(f: sp.SpoolFile) -> tuple[pa.Table, dict]:
    """The file's table and parsed metadata, or BadFile saying what is wrong."""
    try:
        pf = pq.ParquetFile(f.path)
    except Exception as exc:
        raise BadFile(f"unreadable Parquet footer (truncated or not Parquet): {exc}") from None
    expected = sp.SCHEMAS[f.kind]
    found = pf.schema_arrow.remove_metadata()
    if not found.equals(expected):
        raise BadFile(f"schema mismatch: expected {_fmt(expected)}, found {_fmt(found)}")
    meta = _meta(pf.schema_arrow.metadata)
    if meta["format_version"] != sp.FORMAT_VERSION:
        raise BadFile(f"spool format version {meta['format_version']}, expected "
                      f"{sp.FORMAT_VERSION}")
    info = {
        "run_id": meta["run_id"],
        "attempt": _int(meta, "attempt"),
        "host": _int(meta, "host"),
        "host_count": _int(meta, "host_count"),
        "resumed_from_step": _int(meta, "resumed_from_step") if meta["resumed_from_step"] else None,
        "writer_version": meta["writer_version"],
        "fingerprint": meta["manifest_fingerprint"],
        "rows": _int(meta, "rows"),
        "first_step": _int(meta, "first_step"),
        "last_step": _int(meta, "last_step"),
    }
    for key, from_path in (("run_id", f.run_id), ("attempt", f.attempt), ("host", f.host)):
        if info[key] != from_path:
            raise BadFile(f"metadata {key}={info[key]!r} but the path says {from_path!r}")
    if meta["kind"] != f.kind or info["first_step"] != f.first_step:
        raise BadFile("metadata kind/first_step disagree with the file name")
    if not 0 <= info["host"] < info["host_count"]:
        raise BadFile(f"host {info['host']} is outside host_count {info['host_count']}")
    if (info["attempt"] > 0) != (info["resumed_from_step"] is not None):
        raise BadFile("attempt > 0 must say resumed_from_step, attempt 0 must not")
    if pf.metadata.num_rows != info["rows"]:
        raise BadFile(f"footer holds {pf.metadata.num_rows} rows, writer wrote {info['rows']}")
    try:
        table = pf.read()
    except Exception as exc:
        raise BadFile(f"corrupt data pages: {exc}") from None
    if table.num_rows != info["rows"] or table.num_rows == 0:
        raise BadFile(f"read {table.num_rows} rows, writer wrote {info['rows']}")
    _check_values(table, f.kind, info)
    return table, info


def _fmt(schema: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name} {f.type}" for f in schema) + ")"


def _check_values(table: pa.Table, kind: str, info: dict) -> None:
    for name in table.column_names:
        if table[name].null_count:
            raise BadFile(f"column {name} has nulls")
    steps = pc.min_max(table["step"]).as_py()
    if (steps["min"], steps["max"]) != (info["first_step"], info["last_step"]):
        raise BadFile(f"steps {steps['min']}..{steps['max']} disagree with metadata "
                      f"{info['first_step']}..{info['last_step']}")
    if steps["min"] < 0:
        raise BadFile("negative step")
    if not pc.all(pc.equal(table["host"], info["host"])).as_py():
        raise BadFile(f"rows for a host other than {info['host']}")
    if kind == "seg":
        for name, low in (("row", 0), ("record_key", 0), ("offset", 0), ("n_tokens", 1)):
            if pc.min(table[name]).as_py() < low:
                raise BadFile(f"column {name} has values below {low}")


def ingest(spool: str | Path, ledger: Ledger, *, progress: bool = False) -> IngestResult:
    """Ingest every new published file under `spool` into `ledger`, exactly once."""
    t0 = time.perf_counter()
    result = IngestResult()
    for_ledger(ledger)  # the aggregates' per-record state, loaded once per process
    cur = ledger.cursor()
    try:
        done = {r[0] for r in cur.execute("SELECT path FROM segments").fetchall()}
        held = {r[0]: (r[1], r[2]) for r in cur.execute(
            "SELECT path, bytes, mtime_ns FROM quarantine").fetchall()}
        todo = []
        for item in sp.scan(Path(spool)):
            if item.rel in done:
                result.already += 1
                continue
            st = item.path.stat()
            if held.get(item.rel) == (st.st_size, st.st_mtime_ns):
                continue  # known bad and unchanged: reported by `tally ledger`, not again here
            todo.append((item, st))
        bar = tqdm(total=len(todo), unit="file", desc="ingest", disable=not progress,
                   file=sys.stderr)
        for (item, st), read in _read_ahead(todo):
            bar.update()
            if isinstance(read, BadFile):
                _quarantine(cur, result, item.rel, st, str(read))
                continue
            try:
                _ingest_one(ledger, cur, item, st.st_size, *read)
            except BadFile as exc:
                _quarantine(cur, result, item.rel, st, str(exc))
                continue
            result.files += 1
            result.rows += read[0].num_rows
            if item.rel in held:
                cur.execute("DELETE FROM quarantine WHERE path = ?", [item.rel])
        bar.close()
    finally:
        cur.close()
    result.seconds = time.perf_counter() - t0
    return result


def _read(item: sp.SpoolFile | sp.Stray
          ) -> tuple[pa.Table, dict, pa.Table | None, Starts | None] | BadFile:
    """Read, check and pre-aggregate one file (runs in the read-ahead thread)."""
    if isinstance(item, sp.Stray):
        return BadFile(item.reason)
    try:
        table, info = read_checked(item)
    except BadFile as exc:
        return exc
    steps = starts = None
    if item.kind == "seg":
        start = pc.cast(pc.equal(table["offset"], 0), pa.int64())
        steps = table.append_column("start", start).group_by(["host", "step"]).aggregate(
            [("n_tokens", "count"), ("n_tokens", "sum"), ("start", "sum")])
        starts = Starts.from_table(table)
    return table, info, steps, starts


def _read_ahead(todo: list, depth: int = 2) -> Iterator:
    """`(entry, _read(entry))` in order, reading up to `depth` files ahead of the inserts.

    Parquet decoding and DuckDB's insert both release the GIL, so they overlap; the bounded
    depth keeps memory at a few files whatever the size of the backlog.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tally-ingest-read") as pool:
        pending: deque = deque()
        entries = iter(todo)
        for entry in entries:
            pending.append((entry, pool.submit(_read, entry[0])))
            if len(pending) > depth:
                first, fut = pending.popleft()
                yield first, fut.result()
        while pending:
            first, fut = pending.popleft()
            yield first, fut.result()


def _quarantine(cur, result: IngestResult, rel: str, st, reason: str) -> None:
    cur.execute(
        "INSERT OR REPLACE INTO quarantine (path, bytes, mtime_ns, reason) VALUES (?, ?, ?, ?)",
        [rel, st.st_size, st.st_mtime_ns, reason],
    )
    result.quarantined.append((rel, reason))


def _ingest_one(ledger: Ledger, cur, f: sp.SpoolFile, size: int, table: pa.Table,
                info: dict, steps: pa.Table | None, starts: Starts | None) -> None:
    agg = for_ledger(ledger)
    cur.execute("BEGIN TRANSACTION")
    try:
        try:
            run = ledger.ensure_run(cur, info["run_id"], info["fingerprint"])
            cuts = agg.cuts(cur, run)
            ledger.ensure_attempt(cur, run, info["attempt"], info["resumed_from_step"],
                                  info["host_count"], info["writer_version"])
        except ValueError as exc:
            raise BadFile(str(exc)) from None
        agg.lineage(cur, run, cuts)
        file_id = one(cur, "SELECT nextval('file_ids')")[0]
        ids = [run, info["attempt"], file_id]
        cur.register("incoming", table)
        if f.kind == "seg":
            cur.execute("""
                INSERT INTO consumption SELECT $1, $2, host, step, "row", record_key, "offset",
                    n_tokens, content_hash, epoch, $3 FROM incoming""", ids)
            cur.register("incoming_steps", steps)
            cur.execute("""
                INSERT INTO host_steps SELECT $1, $2, host, step, n_tokens_count, n_tokens_sum, $3
                FROM incoming_steps""", ids)
            cur.unregister("incoming_steps")
            agg.add_file(cur, run, info["attempt"], file_id, starts, steps)
            n_tokens = pc.sum(table["n_tokens"]).as_py()
        else:
            cur.execute("INSERT INTO metrics SELECT $1, $2, host, step, name, value, $3 "
                        "FROM incoming", ids)
            n_tokens = 0
        cur.execute(
            "INSERT INTO segments (file_id, path, kind, run, attempt, host, first_step, last_step,"
            " n_rows, n_tokens, bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [file_id, f.rel, f.kind, run, info["attempt"], info["host"], info["first_step"],
             info["last_step"], table.num_rows, n_tokens, size],
        )
        cur.unregister("incoming")
        with agg.lock:  # readers of the per-record state open their snapshot under it
            cur.execute("COMMIT")
            agg.commit()
    except BaseException:
        agg.discard()
        cur.execute("ROLLBACK")
        raise
