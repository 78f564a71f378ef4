"""The live answers: plain functions over a DuckDB cursor (inside the caller's snapshot
transaction), returning JSON-able dicts. They read the `agg_*` tables kept at ingest
(audit/ledger/aggregates.py), never a scan of `consumption`, except the per-record lookups.

Rolled-back steps are left out with the ledger's rule (tally.audit.core.exposure.effective_sql).
Coverage is over a universe of N train records (record keys 0..N-1: the manifest's train split,
which comes first in key order, or `--records N`); keys >= N are counted apart as `outside`.
"""

from __future__ import annotations

import bisect
import datetime as dt
from dataclasses import dataclass
from typing import Any

import duckdb
import numpy as np

from tally.audit.core import exposure
from tally.audit.core.arrays import ranks
from tally.audit.core.errors import NotFound, Unavailable
from tally.audit.core.exposure import Coverage, effective_sql, start_sql
from tally.audit.hook.spool import FINISHED, replayed_run, replayed_sql
from tally.audit.ledger.database import one
from tally.audit.ledger.lookup import LookupIndex

EFFECTIVE = effective_sql("s", "a")  # over agg_steps s JOIN attempts a
REPLAYED = replayed_sql("a")  # over ... JOIN attempts a: written by `tally replay`
MAX_POINTS = 5000
__all__ = ["NotFound", "Unavailable"]  # the errors the answers raise, for the routes
# A page of a record lookup ends at a consumption: its place in the order, as a cursor.
RECORD_CURSOR = r"^[0-9]{1,19}(\.[0-9]{1,19}){6}$"


@dataclass
class Universe:
    """What coverage is measured against."""

    n: int | None  # train records; None when neither a manifest nor --records was given
    source: str  # "manifest", "records option" or "unknown"


def run_of(cur: duckdb.DuckDBPyConnection, run_id: str) -> int:
    row = one(cur, "SELECT run FROM runs WHERE run_id = ?", [run_id])
    if row is None:
        raise NotFound(f"unknown run {run_id!r}: no segment of it has been ingested; "
                       + known_runs(cur))
    return row[0]


def known_runs(cur: duckdb.DuckDBPyConnection, most: int = 10) -> str:
    """The runs a ledger holds, said for an unknown run's message: 'runs here: a, b' (the
    first `most` of them), or 'the ledger holds no run yet'."""
    ids = [r[0] for r in cur.execute("SELECT run_id FROM runs ORDER BY run_id LIMIT ?",
                                     [most + 1]).fetchall()]
    if not ids:
        return "the ledger holds no run yet"
    more = " (and more: GET /v1/runs, or tally ledger)" if len(ids) > most else ""
    return "runs here: " + ", ".join(ids[:most]) + more


def runs(cur: duckdb.DuckDBPyConnection, limit: int | None = None,
         after: str | None = None) -> list[dict[str, Any]]:
    """The runs in run-id order: `limit` of them after the run id `after` (a page), or all."""
    rows = cur.execute(f"""
        SELECT r.run_id, r.manifest_fingerprint,
               (SELECT count(*) FROM attempts x WHERE x.run = r.run) AS attempts,
               (SELECT max(host_count) FROM attempts x WHERE x.run = r.run) AS host_count,
               (SELECT max(s.step) FROM agg_steps s JOIN attempts a USING (run, attempt)
                WHERE s.run = r.run AND {EFFECTIVE}) AS last_step,
               coalesce(g.records, 0), coalesce(g.exposures, 0),
               (SELECT count(*) FILTER (WHERE {REPLAYED}) FROM segments f
                JOIN attempts a USING (run, attempt) WHERE f.run = r.run AND f.kind = 'seg'),
               (SELECT count(*) FROM segments f WHERE f.run = r.run AND f.kind = 'seg')
        FROM runs r LEFT JOIN agg_runs g USING (run)
        WHERE $after IS NULL OR r.run_id > $after ORDER BY r.run_id LIMIT $limit""",
                       {"after": after, "limit": limit}).fetchall()
    names = ["run_id", "manifest_fingerprint", "attempts", "host_count", "last_step",
             "records_seen", "exposures"]
    return [{**dict(zip(names, r[:-2], strict=True)), "replayed": replayed_run(*r[-2:])}
            for r in rows]


def replayed_of(cur: duckdb.DuckDBPyConnection, run: int) -> dict[str, Any]:
    """Whether `tally replay` wrote the run's consumption rather than the run: its segment
    files of replayed attempts (tally.audit.hook.spool.replayed_sql), of all its segment files, and
    `replayed` when that is every one (tally.audit.hook.spool.replayed_run), as a reconcile of the
    run's spool counts them."""
    k, n = one(cur, f"""SELECT count(*) FILTER (WHERE {REPLAYED}), count(*)
                        FROM segments f JOIN attempts a USING (run, attempt)
                        WHERE f.run = ? AND f.kind = 'seg'""", [run])
    return {"replayed": replayed_run(k, n), "replayed_files": int(k), "segment_files": int(n)}


def quarantined_of(cur: duckdb.DuckDBPyConnection, run_id: str) -> list[tuple[str, str]]:
    """The run's spool files the ingester set aside, with why (paths relative to the spool,
    which start with the run id), in path order."""
    return [(str(p), str(r)) for p, r in cur.execute(
        "SELECT path, reason FROM quarantine WHERE starts_with(path, ?) ORDER BY path",
        [f"{run_id}/"]).fetchall()]


def last_step(cur: duckdb.DuckDBPyConnection, run: int) -> int | None:
    return one(cur, f"""SELECT max(s.step) FROM agg_steps s JOIN attempts a USING (run, attempt)
                       WHERE s.run = ? AND {EFFECTIVE}""", [run])[0]


def coverage(cur: duckdb.DuckDBPyConnection, run: int, uni: Universe, step: int | None = None,
             outside: np.ndarray | None = None) -> dict[str, Any]:
    """Coverage, exposure histogram and the ideal, as of `step` (default: the latest).
    `outside`: the exposures of the keys outside the universe that were seen (the live
    state's, as of this snapshot), None when there are none."""
    last = last_step(cur, run)
    at = last if step is None else step
    if at is None:
        at = -1
    exposures = int(one(cur, f"""
        SELECT coalesce(sum(s.exposures), 0) FROM agg_steps s JOIN attempts a USING (run, attempt)
        WHERE s.run = ? AND s.step <= ? AND {EFFECTIVE}""", [run, at])[0])
    ge = dict(cur.execute("""SELECT rank, sum(records) FROM agg_ranks
                             WHERE run = ? AND step <= ? GROUP BY rank""", [run, at]).fetchall())
    ge = [int(ge.get(k, 0)) for k in (1, 2, 3)]
    out_rec = out_exp = 0
    if outside is not None and len(outside):
        seen = outside
        if last is not None and at < last:
            # Exposures as of a past step: a scan, but only when keys outside the corpus were
            # consumed (a fault).
            seen = cur.execute(f"""
                SELECT count(*) AS e FROM consumption c JOIN attempts a USING (run, attempt)
                WHERE c.run = ? AND c.record_key >= ? AND {start_sql("c")} AND c.step <= ?
                  AND {effective_sql("c", "a")} GROUP BY c.record_key""",
                               [run, uni.n, at]).fetchnumpy()["e"]
            seen = np.asarray(seen, np.int64)
        ge = [g - int((seen > j).sum()) for j, g in enumerate(ge)]
        out_exp, out_rec = int(seen.sum()), int((seen > 0).sum())
        exposures -= out_exp
    n = uni.n
    cov = Coverage(n, exposures, *ge)
    if n and (at == last or step is None):
        levels = dict(cur.execute("SELECT level, records FROM agg_levels WHERE run = ? "
                                  "AND records <> 0", [run]).fetchall())
        if outside is not None and len(outside):
            for lv, c in zip(*np.unique(outside, return_counts=True), strict=True):
                levels[int(lv)] = levels.get(int(lv), 0) - int(c)
        per_level = np.zeros(max(levels, default=0) + 1, np.int64)
        for lv, c in levels.items():
            per_level[lv] = c
        per_level[0] = n - ge[0]
        cov = Coverage.from_levels(n, exposures, per_level)
    return {"step": None if at < 0 else at, "latest_step": last, "universe": uni.source,
            **cov.to_dict(), "outside": {"records": out_rec, "exposures": out_exp}}


def _range(cur, run: int, start: int | None, end: int | None, bucket: int | None,
           points: int, cursor: int | None = None) -> tuple[int, int, int, int] | None:
    """(start, end, bucket, first): the steps asked for, the bucket size, and the first step
    of this page (`cursor` snapped down to its bucket, so that pages fall on one grid)."""
    last = last_step(cur, run)
    if last is None:
        return None
    start = 0 if start is None else start
    end = last if end is None else min(end, last)
    if end < start:
        return start, start - 1, 1, start
    if bucket is None:
        bucket = max(1, -(-(end - start + 1) // points))  # exact: steps reach 2**62
    first = start if cursor is None or cursor <= start else \
        start + (cursor - start) // bucket * bucket
    return start, end, bucket, first


def steps(cur: duckdb.DuckDBPyConnection, run: int, uni: Universe, start: int | None = None,
          end: int | None = None, bucket: int | None = None, points: int = 500,
          limit: int | None = None, cursor: int | None = None) -> dict[str, Any]:
    """Per step (bucketed): consumed, new unique, repeats, cumulative coverage and the ideal;
    `limit` buckets from the one holding step `cursor` on (a page; `next_cursor`: the next
    page's first step, None on the last), or every bucket."""
    rng = _range(cur, run, start, end, bucket, points, cursor)
    cols = ("step", "last_step", "segments", "tokens", "exposures", "new_unique")
    if rng is None:
        return {"bucket": bucket or 1, **{c: [] for c in cols}, "repeats": [],
                "cumulative_unique": [], "cumulative_exposures": [], "coverage": None,
                "ideal_coverage": None, "next_cursor": None}
    start, end, bucket, first = rng
    rows = cur.execute(f"""
        WITH e AS (SELECT s.step, sum(s.segments) AS seg, sum(s.tokens) AS tok,
                          sum(s.exposures) AS ex
                   FROM agg_steps s JOIN attempts a USING (run, attempt)
                   WHERE s.run = $1 AND s.step BETWEEN $5 AND $3 AND {EFFECTIVE} GROUP BY s.step),
             u AS (SELECT step, records FROM agg_ranks
                   WHERE run = $1 AND rank = 1 AND step BETWEEN $5 AND $3)
        SELECT $2 + (e.step - $2) // $4 * $4 AS b, max(e.step), sum(seg), sum(tok), sum(ex),
               coalesce(sum(u.records), 0)
        FROM e LEFT JOIN u USING (step) GROUP BY b ORDER BY b LIMIT $6""",
                       [run, start, end, bucket, first,
                        None if limit is None else limit + 1]).fetchall()
    nxt = rows[limit][0] if limit is not None and len(rows) > limit else None
    rows = rows[:limit]
    base_ex = int(one(cur, f"""
        SELECT coalesce(sum(s.exposures), 0) FROM agg_steps s JOIN attempts a USING (run, attempt)
        WHERE s.run = ? AND s.step < ? AND {EFFECTIVE}""", [run, first])[0])
    base_u = int(one(cur, "SELECT coalesce(sum(records), 0) FROM agg_ranks WHERE run = ? "
                          "AND rank = 1 AND step < ?", [run, first])[0])
    data = {c: [int(r[i]) for r in rows] for i, c in enumerate(cols)}
    ex, new = np.array(data["exposures"], np.int64), np.array(data["new_unique"], np.int64)
    cum_u = base_u + np.cumsum(new)
    cum_e = base_ex + np.cumsum(ex)
    n = uni.n
    return {
        "bucket": bucket, **data, "repeats": (ex - new).tolist(),
        "cumulative_unique": cum_u.tolist(), "cumulative_exposures": cum_e.tolist(),
        "coverage": (cum_u / n).tolist() if n else None,
        "ideal_coverage": np.asarray(exposure.ideal_coverage(cum_e, n)).tolist() if n else None,
        "next_cursor": nxt,
    }


def hosts(cur: duckdb.DuckDBPyConnection, run: int) -> dict[str, Any]:
    """Per host that sent rows, ascending (effective rows): segments, tokens, exposures, steps,
    unique records, records shared with another host; and the host x host overlap matrix, its
    rows and columns in `per_host`'s order. Sized by the hosts that exist, never by a host's
    number (one file of host 65,535 sized it 65,536 x 65,536: 32 GiB). Exact at any host
    count: the per-record state keeps every record's hosts (tally.audit.ledger.state), so the agg
    tables hold every pair."""
    per = {r[0]: r[1:] for r in cur.execute(f"""
        SELECT s.host, coalesce(sum(s.segments) FILTER (WHERE {EFFECTIVE}), 0),
               coalesce(sum(s.tokens) FILTER (WHERE {EFFECTIVE}), 0),
               coalesce(sum(s.exposures) FILTER (WHERE {EFFECTIVE}), 0),
               min(s.step) FILTER (WHERE {EFFECTIVE}), max(s.step) FILTER (WHERE {EFFECTIVE})
        FROM agg_steps s JOIN attempts a USING (run, attempt)
        WHERE s.run = ? GROUP BY s.host""", [run]).fetchall()}
    pairs = cur.execute("SELECT a, b, records FROM agg_host_pairs WHERE run = ? "
                        "AND records <> 0", [run]).fetchnumpy()
    a, b = (np.asarray(pairs[c], np.int64) for c in "ab")
    ids = np.unique(np.r_[np.fromiter(per, np.int64, len(per)), a, b])
    k = len(ids)
    matrix = np.zeros((k, k), np.int64)
    matrix[ranks(ids, a), ranks(ids, b)] = pairs["records"]
    shared = dict(cur.execute("SELECT host, shared FROM agg_hosts WHERE run = ?",
                              [run]).fetchall())
    out = []
    for i, host in enumerate(ids.tolist()):
        seg, tok, ex, first, last = per.get(host, (0, 0, 0, None, None))
        out.append({"host": host, "segments": int(seg), "tokens": int(tok), "exposures": int(ex),
                    "first_step": first, "last_step": last, "unique": int(matrix[i, i]),
                    "overlap_with_others": int(shared.get(host, 0))})
    off = matrix.sum() - np.trace(matrix)
    return {"count": host_count(cur, run), "overlap_tracked_hosts": k, "per_host": out,
            "overlap_matrix": matrix.tolist(), "overlap_pairs": int(off // 2)}


def host_count(cur: duckdb.DuckDBPyConnection, run: int) -> int:
    """The run's hosts: the most any attempt declared, or beyond, the highest host seen + 1."""
    hc = one(cur, "SELECT max(host_count) FROM attempts WHERE run = ?", [run])[0] or 0
    top = one(cur, "SELECT max(host) FROM agg_steps WHERE run = ?", [run])[0]
    return max(hc, 0 if top is None else top + 1)


def host_steps(cur: duckdb.DuckDBPyConnection, run: int, host: int, start: int | None = None,
               end: int | None = None, bucket: int | None = None, points: int = 500,
               limit: int | None = None, cursor: int | None = None) -> dict[str, Any]:
    """One host's per-step series, bucketed and paged as `steps` is."""
    if host >= host_count(cur, run):
        raise NotFound(f"run has no host {host} (host_count {host_count(cur, run)})")
    rng = _range(cur, run, start, end, bucket, points, cursor)
    cols = ("step", "last_step", "segments", "tokens", "exposures")
    if rng is None:
        return {"host": host, "bucket": bucket or 1, **{c: [] for c in cols},
                "next_cursor": None}
    start, end, bucket, first = rng
    rows = cur.execute(f"""
        SELECT $3 + (s.step - $3) // $5 * $5 AS b, max(s.step), sum(s.segments), sum(s.tokens),
               sum(s.exposures)
        FROM agg_steps s JOIN attempts a USING (run, attempt)
        WHERE s.run = $1 AND s.host = $2 AND s.step BETWEEN $6 AND $4 AND {EFFECTIVE}
        GROUP BY b ORDER BY b LIMIT $7""",
                       [run, host, start, end, bucket, first,
                        None if limit is None else limit + 1]).fetchall()
    nxt = rows[limit][0] if limit is not None and len(rows) > limit else None
    rows = rows[:limit]
    return {"host": host, "bucket": bucket,
            **{c: [int(r[i]) for r in rows] for i, c in enumerate(cols)},
            "next_cursor": nxt}


_RECORD_COLS = ("record_key", "step", "host", "attempt", "epoch", "row", "offset", "n_tokens",
                "content_hash", "rolled_back")
# A consumption's place in a record lookup; rowid breaks the tie of a record packed twice into
# one row at the same offset (consumption is append-only, so rowid never changes).
_RECORD_ORDER = ("record_key", "step", "host", "attempt", "row", "offset", "rid")


def record(cur: duckdb.DuckDBPyConnection, run: int, *, record_key: int | None = None,
           content_hash: int | None = None, limit: int = 1000, cursor: str | None = None,
           index: LookupIndex | None = None) -> dict[str, Any]:
    """Every consumption of one record (by key) or of the records with one content hash, a
    page of `limit` at a time after `cursor` (RECORD_CURSOR: the `next_cursor` of the page
    before); the totals count every page. Content hashes are returned as 0x-hex strings (a
    JavaScript number cannot hold 64 bits). With the ledger's lookup `index`, only the files
    it names are read, and those it does not cover yet; without it, `consumption` is scanned.

    DuckDB only finds the rows; their order, page, totals and rolled-back marks are worked out
    here. With all of that in one query (a materialised CTE, a join to `attempts`), planning it
    cost more than the rows: 9.7 ms against 1.6 ms for the rows alone (10M rows from 128 hosts,
    four files through the index)."""
    kind, col, val = ("key", "record_key", record_key) if record_key is not None else \
        ("hash", "content_hash", content_hash)
    rows_of = f"""
        SELECT c.record_key, c.step, c.host, c.attempt, c.epoch, c."row", c."offset", c.n_tokens,
               c.content_hash, c.rowid AS rid
        FROM consumption c WHERE c.run = $run AND c.{col} = $val"""
    if index is not None:
        files, upto = index.files_for(kind, val)
        # Literal file ids and a literal bound: DuckDB prunes row groups by their min/max then
        # (a list parameter was measured at p99 104 ms against 13 ms for the literal list).
        parts = [f"{rows_of} AND c.file_id > {int(upto)}"]
        if files:
            parts.insert(0, f"{rows_of} AND c.file_id IN ({', '.join(map(str, files))})")
        rows_of = " UNION ALL ".join(parts)
    got = cur.execute(rows_of, {"run": run, "val": val}).fetchnumpy()
    if not len(got["rid"]):
        what = f"record key {record_key}" if record_key is not None else \
            f"content hash {content_hash:#018x}"
        raise NotFound(f"{what} was never consumed in this run")
    order = np.lexsort([np.asarray(got[c]) for c in reversed(_RECORD_ORDER)])
    got = {c: np.asarray(v)[order] for c, v in got.items()}
    cutoffs = dict(cur.execute("SELECT attempt, rolled_back_from_step FROM attempts WHERE run = ?",
                               [run]).fetchall())
    rolled = ~exposure.effective(got["step"], got["attempt"], cutoffs)
    epochs, counts = np.unique(got["epoch"][~rolled & exposure.starts(got["offset"])],
                               return_counts=True)
    total = len(got["rid"])

    def place(i: int) -> tuple[int, ...]:  # a row's place in the order, as the cursor says it
        return tuple(int(got[c][i]) for c in _RECORD_ORDER)

    # The page's first row by bisection (log n places built, not one a row: a content hash
    # shared by many records can match millions of rows).
    first = 0 if cursor is None else bisect.bisect_right(
        range(total), tuple(int(v) for v in cursor.split(".")), key=place)
    page = range(first, min(first + limit, total))
    columns = {c: got[c][first:page.stop].tolist() for c in _RECORD_COLS[:-1]}
    columns["rolled_back"] = rolled[first:page.stop].tolist()
    segs = [dict(zip(_RECORD_COLS, r, strict=True)) for r in zip(*columns.values(), strict=True)]
    for seg in segs:
        seg["content_hash"] = f"{seg['content_hash']:#018x}"
    return {"record_keys": np.unique(got["record_key"]).tolist(),
            "exposures": int(counts.sum()),
            "exposures_by_epoch": {str(e): int(n) for e, n in zip(epochs.tolist(), counts,
                                                                 strict=True)},
            "segments_total": total, "segments": segs,
            "next_cursor": ".".join(map(str, place(page.stop - 1)))
            if page and page.stop < total else None}


def metrics(cur: duckdb.DuckDBPyConnection, run: int, points: int = 500) -> dict[str, Any]:
    """Milestones (held-out loss, per-domain perplexity, train loss there) and the train loss
    series, effective steps only, averaged over hosts. At most about `points` of each: the
    train loss averaged per bucket of steps, and beyond `points` milestones the last of each
    bucket. Bucketed in DuckDB: a run that logged 200k steps was an answer of 200k milestones
    (14 MB, 6 s, +250 MB at the server's peak) from every metric row brought into Python."""
    of = f"""FROM metrics m JOIN attempts a USING (run, attempt)
             WHERE m.run = $run AND {effective_sql("m", "a")}"""
    names = sorted(n for (n,) in cur.execute(f"SELECT DISTINCT m.name {of}",
                                             {"run": run}).fetchall()
                   if not n.startswith("tally/"))
    train = f"SELECT m.step, avg(m.value) AS v {of} AND m.name = 'train_loss' GROUP BY m.step"
    series = cur.execute(f"""
        WITH t AS ({train}), r AS (SELECT count(*) AS n, min(step) AS lo, max(step) AS hi FROM t),
             g AS (SELECT CASE WHEN n > $points THEN (hi - lo) // $points + 1 ELSE 1 END AS b,
                          lo FROM r)
        SELECT g.lo + (t.step - g.lo) // g.b * g.b AS s, avg(t.v) FROM t, g
        GROUP BY s ORDER BY s""", {"run": run, "points": points}).fetchall()
    # Milestones: every step logging one, or beyond `points` of them the last of each bucket.
    is_mile = "(m.name = 'heldout_loss' OR starts_with(m.name, 'ppl/'))"
    rows = cur.execute(f"""
        WITH s AS (SELECT DISTINCT m.step {of} AND {is_mile}),
             r AS (SELECT count(*) AS n, min(step) AS lo, max(step) AS hi FROM s),
             k AS (SELECT max(s.step) AS step FROM s, r
                   GROUP BY CASE WHEN n > $points
                                 THEN (s.step - lo) // ((hi - lo) // $points + 1)
                                 ELSE s.step - lo END),
             t AS ({train})
        SELECT m.step, m.name, avg(m.value), any_value(t.v)
        FROM metrics m JOIN attempts a USING (run, attempt) LEFT JOIN t ON t.step = m.step
        WHERE m.run = $run AND {effective_sql("m", "a")} AND {is_mile}
          AND m.step IN (SELECT step FROM k)
        GROUP BY m.step, m.name ORDER BY m.step""", {"run": run, "points": points}).fetchall()
    miles: dict[int, dict[str, Any]] = {}
    for step, name, v, at in rows:
        m = miles.setdefault(step, {"step": step, "heldout_loss": None, "ppl": {},
                                    "train_loss": at})
        if name == "heldout_loss":
            m["heldout_loss"] = v
        else:
            m["ppl"][name[4:]] = v
    return {"names": names, "milestones": list(miles.values()),
            "train_loss": {"step": [int(r[0]) for r in series],
                           "value": [float(r[1]) for r in series]}}


def domains(exposures: np.ndarray, manifest: Any) -> list[dict[str, Any]]:
    """Per domain of the manifest's train split: planned vs actual share of exposures,
    coverage, never seen. `exposures`: per train record key, effective."""
    n = manifest.train_records
    e = np.zeros(n, np.int64)
    k = min(n, len(exposures))
    e[:k] = exposures[:k]
    codes = manifest.domain_codes[:n]
    nd = len(manifest.domain_names)
    records = np.bincount(codes, minlength=nd)
    exp = np.bincount(codes, weights=e, minlength=nd)
    seen = np.bincount(codes, weights=(e > 0), minlength=nd)
    total = exp.sum() or 1
    return [{"domain": name, "records": int(records[i]), "exposures": int(exp[i]),
             "seen": int(seen[i]), "never_seen": int(records[i] - seen[i]),
             "coverage": float(seen[i] / records[i]) if records[i] else 0.0,
             "planned_share": float(records[i] / n) if n else 0.0,
             "actual_share": float(exp[i] / total)}
            for i, name in enumerate(manifest.domain_names)]


# The ledger's TIMESTAMP columns hold the writing session's local time (DuckDB's
# current_timestamp cast to TIMESTAMP); read through this, they are UTC (`utc_iso`).
UTC = "::TIMESTAMPTZ AT TIME ZONE 'UTC'"


def utc_iso(value: dt.datetime | None) -> str | None:
    """A UTC timestamp of the ledger (read with UTC) as ISO 8601 with its zone: a time
    without one reads as the client's local time."""
    return None if value is None else value.replace(tzinfo=dt.UTC).isoformat()


def totals(cur: duckdb.DuckDBPyConnection, run: int) -> dict[str, Any]:
    row = one(cur, """SELECT seg_files, records, exposures, epoch_duplicates,
                      epoch_duplicate_records, multi_host_records FROM agg_runs WHERE run = ?""",
              [run]) or (0, 0, 0, 0, 0, 0)
    names = ("segment_files", "records_seen", "exposures", "epoch_duplicates",
             "epoch_duplicate_records", "multi_host_records")
    out = dict(zip(names, map(int, row), strict=True))
    rows = one(cur, f"SELECT coalesce(sum(n_rows), 0), count(*), max(ingested_at){UTC} "
                    "FROM segments WHERE run = ? AND kind = 'seg'", [run])
    out["rows_ingested"], out["last_ingested_at"] = int(rows[0]), utc_iso(rows[2])
    marked = replayed_of(cur, run)
    out["replayed"], out["replayed_files"] = marked["replayed"], marked["replayed_files"]
    out["attempts"] = [dict(zip(("attempt", "resumed_from_step", "host_count",
                                 "rolled_back_from_step", "replayed"), r, strict=True))
                       for r in cur.execute(f"""SELECT attempt, resumed_from_step, host_count,
            rolled_back_from_step, {REPLAYED} FROM attempts a WHERE run = ? ORDER BY attempt""",
                                            [run]).fetchall()]
    out["non_finite_losses"] = non_finite_losses(cur, run)
    last = max(out["attempts"], key=lambda a: a["attempt"], default=None)
    done = finished_hosts(cur, run)
    out["finished"] = last is not None and all(
        (last["attempt"], h) in done for h in range(last["host_count"]))
    out["finished_step"] = (max(done[(last["attempt"], h)] for h in range(last["host_count"]))
                            if out["finished"] else None)
    return out


def run_versions(cur: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Each run's version: the newest segment file of it in the ledger."""
    return dict(cur.execute("""SELECT r.run_id, max(g.file_id) FROM segments g JOIN runs r
                               USING (run) WHERE g.kind = 'seg' GROUP BY ALL""").fetchall())


def finished_hosts(cur: duckdb.DuckDBPyConnection, run: int) -> dict[tuple[int, int], int]:
    """(attempt, host) -> the step at which that host said its share of the run finished."""
    return {(a, h): s for a, h, s in cur.execute(f"""
        SELECT m.attempt, m.host, max(m.step) FROM metrics m JOIN attempts a USING (run, attempt)
        WHERE m.run = ? AND m.name = ? AND {effective_sql("m", "a")} GROUP BY ALL""",
                                                  [run, FINISHED]).fetchall()}


def non_finite_losses(cur: duckdb.DuckDBPyConnection, run: int) -> dict[str, Any]:
    """Loss values (train or held-out) that are NaN or infinite, in the effective steps: the
    run diverged there, and its losses say nothing about the data after it."""
    count, first = one(cur, f"""
        SELECT count(*), min(m.step) FROM metrics m JOIN attempts a USING (run, attempt)
        WHERE m.run = ? AND {effective_sql("m", "a")} AND NOT isfinite(m.value)
          AND (m.name LIKE '%loss' OR m.name LIKE 'ppl/%')""", [run])
    return {"count": int(count), "first_step": first}
