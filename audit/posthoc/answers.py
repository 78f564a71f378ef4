"""The post-hoc answers of the live API, from the ledger the service owns: plain functions over
a cursor inside the caller's snapshot (tally.audit.ledger.live), in the style of
tally.audit.ledger.queries.

`diff`: two runs of one ledger side by side. Per-record exposures come from the per-record
state the service keeps (tally.audit.ledger.state, copied under its lock), the per-step counts from
`agg_steps`, and every exposure's (step, record) from one pass over the two runs' effective
record starts in the ledger, so every step is compared exactly (the state keeps no step per
record: it costs what a scan of the two runs costs, once per ledger version). Windows of steps
stand in for epochs. The numbers and findings have the shape of `tally diff`'s diff.json
(tally.audit.posthoc.diff_report).

`exposure`: posted content hashes matched to the manifest's records, and the run's exposures of
them (one scan of the run's consumption, as the record lookup does).
"""

from __future__ import annotations

from typing import Any

import duckdb
import numpy as np

from tally.audit.core.exposure import Coverage, start_sql, verdict
from tally.audit.ledger import queries as q
from tally.audit.posthoc import exposure as ex
from tally.audit.posthoc.diff_bucket import RUNS
from tally.audit.posthoc.diff_report import findings
from tally.audit.posthoc.multiset import KEY_BITS, compare_groups, dense_codes, jaccard
from tally.audit.render.charts import step_or_none

MAX_HASHES = 10_000  # documents per exposure request
WINDOWS = 20


def _per_step(cur: duckdb.DuckDBPyConnection, run: int) -> tuple[np.ndarray, np.ndarray]:
    """The run's effective steps in order, and [3, steps]: their segments, tokens and
    exposures."""
    got = cur.execute(f"""
        SELECT s.step, sum(s.segments)::BIGINT AS seg, sum(s.tokens)::BIGINT AS tok,
               sum(s.exposures)::BIGINT AS ex
        FROM agg_steps s JOIN attempts a USING (run, attempt)
        WHERE s.run = ? AND {q.EFFECTIVE} GROUP BY s.step ORDER BY s.step""", [run]).fetchnumpy()
    counts = np.stack([np.asarray(got[c], np.int64) for c in ("seg", "tok", "ex")]) \
        if len(got["step"]) else np.zeros((3, 0), np.int64)
    return np.asarray(got["step"], np.int64), counts


def _events(cur: duckdb.DuckDBPyConnection, run: int) -> tuple[np.ndarray, np.ndarray]:
    """(steps, keys) of every effective exposure of the run (its record starts)."""
    got = cur.execute(f"""SELECT step, record_key FROM effective_consumption
        WHERE run = ? AND {start_sql()}""", [run]).fetchnumpy()
    return np.asarray(got["step"], np.int64), np.asarray(got["record_key"], np.int64)


def _groups(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values in order, each value's index among them): groups numbered by the
    ones that exist, whatever their numbers."""
    return np.unique(values, return_inverse=True)


def diff(cur: duckdb.DuckDBPyConnection, runs: dict[str, int], run_ids: dict[str, str],
         states: dict[str, np.ndarray], uni: q.Universe,
         manifest: Any | None, points: int = 500, window: int | None = None
         ) -> dict[str, Any]:
    """Runs `runs['a']` and `runs['b']` compared. `states[r]`: exposures per record key, from
    the same snapshot as `cur`; `manifest`: the service's (records,
    fingerprint), or None; `window`: steps per window (default: about WINDOWS windows).

    Every per-step array is indexed by the steps either run consumed, never by the step
    number: steps are int64 up to 2**62, and arrays as long as the largest step made two runs
    of three steps, one at 3e7, cost 2.5 GB (and one at 2**40 a 500). Windows and plot buckets
    are numbered by the ones that hold a step, for the same reason."""
    last = {r: q.last_step(cur, runs[r]) for r in RUNS}
    got = {r: _per_step(cur, runs[r]) for r in RUNS}
    ev = {r: _events(cur, runs[r]) for r in RUNS}
    at = np.unique(np.concatenate([got["a"][0], got["b"][0], ev["a"][0], ev["b"][0]]))
    n_at = len(at)
    per = {}
    for r in RUNS:
        per[r] = np.zeros((3, n_at), np.int64)
        per[r][:, np.searchsorted(at, got[r][0])] = got[r][1]
    origin = int(at[0]) if n_at else 0  # windows and buckets count from the first step
    span = int(at[-1]) - origin + 1 if n_at else 0

    # ---- per record: keys of the manifest (else the universe, else every key seen) ----
    size = max(len(states[r]) for r in RUNS)
    limit = manifest.records if manifest is not None else uni.n if uni.n else size
    e = {}
    for r in RUNS:
        exp = states[r].astype(np.int64)
        e[r] = np.zeros(limit, np.int64)
        e[r][: min(limit, len(exp))] = exp[:limit]
    seen_a, seen_b = e["a"] > 0, e["b"] > 0
    values, counts = np.unique(e["a"] - e["b"], return_counts=True)
    records = {"compared": limit, "only_a": int((seen_a & ~seen_b).sum()),
               "only_b": int((seen_b & ~seen_a).sum()),
               "same": int((seen_a & (e["a"] == e["b"])).sum()),
               "more_often_a": int((seen_b & (e["a"] > e["b"])).sum()),
               "more_often_b": int((seen_a & (e["b"] > e["a"])).sum())}
    records["neither"] = limit - sum(v for k, v in records.items() if k != "compared")

    # ---- per step: every exposure, from the ledger; a step is its index in `at` ----
    keys_a, keys_b = ev["a"][1], ev["b"][1]
    if size >= 1 << KEY_BITS:  # keys too wide to pack: compare their ranks instead
        codes, _ = dense_codes(np.concatenate([keys_a, keys_b]))
        keys_a, keys_b = codes[: len(keys_a)], codes[len(keys_a):]
    idx_a, idx_b = np.searchsorted(at, ev["a"][0]), np.searchsorted(at, ev["b"][0])
    cmp = compare_groups(idx_a, keys_a, idx_b, keys_b, n_at)
    present = (per["a"][0] > 0) | (per["b"][0] > 0)
    same_records = cmp.l1[:n_at] == 0
    same_shape = (per["a"][:2] == per["b"][:2]).all(axis=0)
    identical = present & same_records & same_shape
    differ = present & ~identical
    jac = jaccard(cmp.distinct_a, cmp.distinct_b, cmp.common)[:n_at]
    first_i = int(np.flatnonzero(differ)[0]) if differ.any() else None
    first = None if first_i is None else int(at[first_i])

    # Windows of steps: the same multiset in each, in another order?
    w = window or max(1, -(-span // WINDOWS))
    win_ids, win_of = _groups((at - origin) // w)  # the windows that hold a step
    n_win = len(win_ids)
    win = compare_groups(win_of[idx_a], keys_a, win_of[idx_b], keys_b, n_win)
    win_present = np.bincount(win_of[present], minlength=n_win)
    win_same = (win.l1[:n_win] == 0) & (win_present > 0)
    if not differ.any():
        status = "identical"
    elif win_same[win_present > 0].all():
        status = "same_data_other_order"
    else:
        status = "different"

    # ---- bucketed series for a plot: steps, and both runs' coverage ----
    bucket = max(1, -(-span // points))
    b_first, b_of = _groups((at - origin) // bucket)  # about `points` buckets at most
    nb = len(b_first)
    compared_b = np.bincount(b_of[present], minlength=nb)
    jac_b = np.bincount(b_of[present], weights=jac[present], minlength=nb)
    keep = compared_b > 0
    series = {"bucket": bucket, "step": (origin + b_first * bucket)[keep].tolist(),
              "compared": compared_b[keep].tolist(),
              "identical": np.bincount(b_of[identical], minlength=nb)[keep].tolist(),
              "jaccard": (jac_b[keep] / compared_b[keep]).tolist()}
    side = {}
    for r in RUNS:
        # Coverage of the universe's records (keys below N), from the same state copy.
        n = uni.n
        inside = e[r][: n if n is not None else limit]
        cov = Coverage.from_levels(n, int(inside.sum()), np.bincount(inside)).to_dict() \
            if n else Coverage(None, int(inside.sum()), *(int((inside > k).sum())
                                                           for k in range(3))).to_dict()
        steps = q.steps(cur, runs[r], uni, start=origin, bucket=bucket)
        fp = cur.execute("SELECT manifest_fingerprint FROM runs WHERE run = ?",
                         [runs[r]]).fetchall()[0][0]
        marked = q.replayed_of(cur, runs[r])
        mine = per[r][0] > 0
        side[r] = {
            "run_id": run_ids[r], "source": "ledger", "run_manifest_fingerprint": fp,
            "replayed": marked["replayed"], "replayed_files": marked["replayed_files"],
            "last_step": last[r], "first_step": int(at[mine][0]) if mine.any() else None,
            "steps": int(mine.sum()), "exposures": int(per[r][2].sum()),
            "unknown_keys": int((states[r][limit:] > 0).sum()),
            "unknown_exposures": int(states[r][limit:].sum()),
            "coverage": cov,
            "series": {k: steps[k] for k in ("last_step", "coverage", "ideal_coverage")}}
    compared = int(present.sum())
    through = max([-1] + [x for x in last.values() if x is not None])
    d: dict[str, Any] = {
        "a": side["a"], "b": side["b"],
        "manifest": {"fingerprint": None if manifest is None else manifest.fingerprint,
                     "records": limit, "train_records": uni.n},
        "status": status,
        "steps_compared": compared, "identical_steps": int(identical.sum()),
        "first_divergent_step": first,
        "compared_through_step": through,
        "exact": True,
        "steps_only_a": int(((per["a"][0] > 0) & (per["b"][0] == 0) & present).sum()),
        "steps_only_b": int(((per["b"][0] > 0) & (per["a"][0] == 0) & present).sum()),
        "steps_same_records_other_tokens": int((present & same_records & ~same_shape).sum()),
        "jaccard": {"mean": float(jac[present].mean()) if compared else None,
                    "min": float(jac[present].min()) if compared else None,
                    "at_first_divergent_step": None if first_i is None else float(jac[first_i])},
        "records": records, "records_only_a": records["only_a"],
        "records_only_b": records["only_b"],
        "exposure_difference_histogram": {str(k): int(v) for k, v in
                                          zip(values.tolist(), counts.tolist(), strict=True)},
        "epochs": [], "epochs_known": False,
        "windows": {"steps": w, "count": int((win_present > 0).sum()),
                    "same_multiset": int(win_same.sum()),
                    "other_order": int((win_same & (np.bincount(
                        win_of[identical], minlength=n_win) < win_present)).sum())},
        "steps_series": series,
    }
    d["findings"] = findings(d)
    if not d["exact"]:
        d["findings"].append({
            "severity": "INFO", "code": "compared_in_part",
            "message": f"steps compared through {d['compared_through_step']} of "
                       f"{step_or_none(through)}: later steps hold a 4th or later exposure of "
                       "some record, which the live state does not keep (tally diff compares "
                       "every step)", "numbers": {"step": d["compared_through_step"]}})
    d["verdict"] = verdict(d["findings"])
    return d


def exposure(cur: duckdb.DuckDBPyConnection, run: int, run_id: str, hashes: np.ndarray,
             known: np.ndarray, manifest: ex.ManifestHashes) -> dict[str, Any]:
    """The run's exposures of the records matching each posted content hash (one scan of its
    consumption); the same numbers as `tally exposure`. `known[i]`: hash i is an xxh3_64
    value (one that is not matches nothing)."""
    doc, key = manifest.match(hashes[known])
    doc = np.flatnonzero(known)[doc]
    table = ex.join(hashes, doc, key, manifest, {run_id: ex.consumed_in_ledger(cur, run, key)})
    summary = ex.summarize(table, len(hashes), [run_id])["runs"][run_id]
    results: list[dict[str, Any]] = [{"content_hash": f"{int(h):#018x}", "exposures": 0,
                                      "records": []} for h in hashes]
    for row in table.to_pylist():
        if row["record_key"] is None:
            continue
        res = results[row["document"]]
        res["exposures"] += row["exposures"]
        res["records"].append({k: row[k] for k in ("record_key", "split", "domain", "exposures",
                                                   "first_step", "last_step", "hosts",
                                                   "epochs")})
    return {"run_id": run_id, **summary, "replayed": q.replayed_of(cur, run)["replayed"],
            "manifest_fingerprint": manifest.fingerprint, "results": results}
