"""Pre-flight for a user's Grain DataLoader: `tally preflight --loader MODULE:FUNCTION`.

The new topology's loaders come from the user's own factory, FUNCTION(host, host_count), as the
relaunched job would build them, started where it would start them: restored from the loader
states the run checkpointed (`--states`: Grain's `process_<i>-of-<n>.json`, new host h taking
old host h % n's, the transfer a job does when the host count changes), or fresh with their first
batch at `--at-step` (a sampler resumed by its own start offset, MaxText's `initial_step`). The
plan is read from the loaders' index contract exactly as replay reads it (`pipeline.replay`):
nothing of the pipeline runs, so a plan of 64 hosts x 1,000 steps takes seconds.

The checks need no epochs (a custom sampler need not say them): the run's effective exposures
before the step, from the ledger, plus the plan's, against the ideal of the DESIGN ("every
record seen floor(C/N) or ceil(C/N) times"). A correct continuation adds no exposure beyond
ceil(C/N) and, once the plan reaches the next multiple of N exposures, leaves no record below
floor(C/N); what the plan adds beyond the ledger's own distance from the ideal is what the
relaunch would do:
- `repeats`: exposures beyond ceil(C/N) the plan adds (records already seen as often as the
  ideal allows, planned again);
- `skips`: records the plan leaves below floor(C/N) when its horizon reaches a multiple of N;
- `planned_twice`: records planned more often than the horizon itself allows, on two hosts;
- `global_batch_changed`, `ledger_behind`, `horizon_short` as the keyed-loader check says them.
What a correct loader also does is allowed and said as INFO: with W worker streams a host's
reads at a step boundary are not a prefix of its order (each stream but one up to a batch
ahead), and a sampler may drop N mod hosts or N mod global batch records an epoch. Not caught:
a fault whose plan stays within one epoch's unseen records until past the horizon (a twice
sharded loader starting at an epoch's start with a horizon short of the corpus): the finding
`horizon_short` says the check ended there.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from audit.core.errors import TallyError
from audit.core.exposure import effective_sql, start_sql
from audit.ledger.database import Ledger, one
from audit.preflight.verdict import PreflightVerdict
from pipeline.grain_attach import SamplerKeys, contract_of
from pipeline.replay import batches, make_loader, read_state

DEFAULT_MAX_HORIZON = 1000


def run_loader_preflight(ledger: Ledger | str | Path, run_id: str, manifest: str | Path,
                         loader: str, new_hosts: int, *, at_step: int | None = None,
                         states: str | Path | None = None, horizon: int | None = None
                         ) -> PreflightVerdict:
    """Plan the user's loaders on `new_hosts` and check the plan against the ledger."""
    t0 = time.perf_counter()
    if new_hosts < 1:
        raise TallyError(f"--hosts must be at least 1, got {new_hosts}")
    if horizon is not None and horizon < 1:
        raise TallyError(f"--horizon must be at least 1 step, got {horizon}")
    if (states is None) == (at_step is None):
        raise TallyError("give the loader states the run checkpointed (--states DIR) or the "
                         "step the relaunched loaders start at (--at-step S), one of them")
    from pipeline.manifest_file import manifest_info

    n = int(manifest_info(manifest)["train_records"])
    if isinstance(ledger, Ledger):
        return _check(ledger, run_id, n, loader, new_hosts, at_step, states, horizon, t0)
    if not Path(ledger).is_file():
        raise TallyError(f"no ledger at {ledger}")
    with Ledger(ledger, read_only=True) as opened:
        return _check(opened, run_id, n, loader, new_hosts, at_step, states, horizon, t0)


def _old_states(states: Path, spec: str) -> tuple[dict[int, dict], int]:
    """Every old host's state, by host (process_<i>-of-<n>.json, one n for all), and the step
    they resume at: the old loaders' next batch ordinal (the lowest, should hosts differ)."""
    found = sorted(states.glob("process_*-of-*.json"))
    counts = {p.name.rsplit("-of-", 1)[1].removesuffix(".json") for p in found}
    if not found or len(counts) != 1 or not next(iter(counts)).isdigit():
        raise TallyError(f"--states {states}: expected Grain's process_<i>-of-<n>.json for "
                         f"one host count n, found {[p.name for p in found[:4]]}")
    old = int(next(iter(counts)))
    out, step = {}, None
    for h in range(old):
        loader = make_loader(spec, h, old)
        out[h] = read_state(states, h, old, loader)
        contract = contract_of(loader)
        nxt = contract.next_batch(contract.cursor(out[h]))
        if nxt is not None:
            step = nxt[1] if step is None else min(step, nxt[1])
    return out, step or 0


def _check(ledger: Ledger, run_id: str, n: int, spec: str, new_hosts: int,
           at_step: int | None, states: str | Path | None, horizon: int | None,
           t0: float) -> PreflightVerdict:
    cur = ledger.cursor()
    try:
        row = one(cur, "SELECT run FROM runs WHERE run_id = ?", [run_id])
        if row is None:
            raise TallyError(f"run {run_id!r} is not in ledger {ledger.path} (ingest its spool "
                             "first)")
        run = row[0]
        loaders = [make_loader(spec, h, new_hosts) for h in range(new_hosts)]
        try:
            contracts = [contract_of(x) for x in loaders]
        except TallyError as exc:
            raise TallyError(f"--loader {spec}: {exc}") from None
        old: dict[int, dict] = {}
        if states is not None:
            old, at_step = _old_states(Path(states), spec)
        cursors, firsts = [], []
        for h, c in enumerate(contracts):
            st = old[h % len(old)] if old else None
            cur_h = c.cursor(st)
            cursors.append(cur_h)
            nxt = c.next_batch(cur_h)
            firsts.append(None if nxt is None else nxt[1])
        # The relaunch's step: --at-step, else the step the checkpointed loaders were at.
        step = at_step
        new_batch = sum(c.batch_size for c in contracts)
        old_hosts, old_batch, last = _ledger_shape(cur, run, step)
        v = PreflightVerdict(run_id, "safe", numbers={
            "checkpoint_step": step, "old_hosts": old_hosts, "new_hosts": new_hosts,
            "old_global_batch": old_batch, "new_global_batch": new_batch,
            "records_per_epoch": n, "plan": "loader", "loader": spec})
        add = v.findings.add
        if step > 0 and (last is None or last < step - 1):
            held = "nothing" if last is None else f"steps up to {last}"
            add("UNKNOWN", "ledger_behind",
                f"the relaunch starts at step {step}, but the ledger holds {held} of this run: "
                "ingest the spool first", ledger_last_step=last)
            return _done(v, t0)
        if old_batch is not None and old_batch != new_batch:
            add("FAIL", "global_batch_changed",
                f"the global batch would change from {old_batch} to {new_batch} rows at step "
                f"{step}: positions recomputed from a step no longer name the next records",
                before=old_batch, after=new_batch)
        counts = _consumed(cur, run, step, n)
    finally:
        cur.close()
    consumed = int(counts.sum())
    to_multiple = n - consumed % n if consumed % n else n
    steps = horizon or min(DEFAULT_MAX_HORIZON, -(-to_multiple // max(1, new_batch)))
    keys, at_steps, on_host = [], [], []
    for h, (x, c, cu) in enumerate(zip(loaders, contracts, cursors, strict=True)):
        idx, ordinal, _ = batches(c, cu, steps)
        keys.append(SamplerKeys(x._sampler).keys(idx))
        at_steps.append(ordinal - (firsts[h] or 0) + step)
        on_host.append(np.full(len(idx), h, np.int32))
    k, s, hh = np.concatenate(keys), np.concatenate(at_steps), np.concatenate(on_host)
    # With W worker streams a host's reads at a step boundary are not a prefix of its order:
    # each stream but one may be up to a batch ahead, on the run's side and on the plan's
    # (assumed alike), so that many records may sit across an epoch's end in a correct run.
    slack = 2 * sum((c.streams - 1) * c.batch_size for c in contracts)
    # Samplers that drop an epoch's remainder leave up to N mod hosts (per-host blocks) or
    # N mod global batch records unread each epoch, by design.
    remainder = n % new_hosts + n % max(1, new_batch)
    _plan_findings(v, counts, k, s, hh, n, steps, add, slack=slack, remainder=remainder)
    return _done(v, t0)


def _ledger_shape(cur: Any, run: int, step: int) -> tuple[int | None, int | None, int | None]:
    """(hosts, rows per step, last step) of the surviving lineage just before `step`."""
    rows = cur.execute(f"""
        SELECT h.step, count(DISTINCT h.host), sum(h.exposures) FROM agg_steps h JOIN attempts a
            USING (run, attempt)
        WHERE h.run = ? AND {effective_sql("h", "a")} AND h.step < ?
        GROUP BY h.step ORDER BY h.step DESC LIMIT 1""", [run, step]).fetchall()
    if not rows:
        return None, None, None
    last, hosts, starts = rows[0]
    return int(hosts), int(starts), int(last)


def _consumed(cur: Any, run: int, step: int, n: int) -> np.ndarray:
    """Effective exposures per train record before `step`."""
    got = cur.execute(
        f"SELECT record_key, count(*)::BIGINT AS c FROM effective_consumption "
        f"WHERE run = ? AND step < ? AND {start_sql()} AND record_key < ? GROUP BY record_key",
        [run, step, n]).fetchnumpy()
    counts = np.zeros(n, np.int64)
    counts[np.asarray(got["record_key"], np.int64)] = np.asarray(got["c"], np.int64)
    return counts


def _plan_findings(v: PreflightVerdict, before: np.ndarray, keys: np.ndarray,
                   steps_at: np.ndarray, hosts: np.ndarray, n: int, horizon: int, add, *,
                   slack: int = 0, remainder: int = 0) -> None:
    """The plan's findings. Counts within what a correct loader does (`slack`: worker streams'
    reads across a step boundary; `remainder`: records an epoch drops by design, per epoch
    the plan crosses) are said as INFO with the reason, beyond it as FAIL."""
    num = v.numbers
    outside = (keys < 0) | (keys >= n)
    if outside.any():
        add("UNKNOWN", "unknown_keys",
            f"the loaders plan {int(outside.sum()):,} record keys outside the manifest's "
            f"0..{n - 1}: is it this run's corpus?", records=int(outside.sum()))
        return
    planned = np.bincount(keys, minlength=n)
    after = before + planned
    c0, c1 = int(before.sum()), int(after.sum())
    bad_steps: list[np.ndarray] = []

    def beyond(counts: np.ndarray, c: int) -> tuple[int, int]:
        hi, lo = -(-c // n), c // n
        return int(np.maximum(counts - hi, 0).sum()), int(np.maximum(lo - counts, 0).sum())

    def judge(code: str, amount: int, allowed: int, why: str, message: str, **numbers) -> None:
        if amount <= allowed:
            add("INFO", f"{code}_within_allowance",
                f"{message} — within the {allowed:,} a correct loader may show ({why})",
                **numbers)
        else:
            add("FAIL", code, message, **numbers)

    excess0, _ = beyond(before, c0)
    excess1, _ = beyond(after, c1)
    num.update(horizon_steps=horizon, planned=len(keys), consumed_exposures=c0,
               reached_multiple=c1 // n > c0 // n or (c0 % n == 0 and c1 > c0 and c1 % n == 0),
               allowance_streams=slack)
    streams_why = "worker streams read up to a batch ahead of each other"

    # Records planned more often than the epochs the plan touches allow, by two hosts or more.
    cap = -(-(c0 % n + len(keys)) // n)
    twice = planned > cap
    num["duplicates"] = int(twice.sum())
    if twice.any():
        on = np.zeros(n, np.int64)
        lo = np.full(n, np.iinfo(np.int32).max)
        np.minimum.at(lo, keys, hosts)
        np.maximum.at(on, keys, hosts)
        cross = int((twice & (lo != on)).sum())
        where = np.isin(keys, np.flatnonzero(twice))
        if int(twice.sum()) > slack:
            bad_steps.append(steps_at[where])
        judge("planned_twice", int(twice.sum()), slack, streams_why,
              f"{int(twice.sum()):,} records are planned more often than {horizon} steps allow "
              f"({cross:,} of them on two or more hosts): the hosts' loaders do not read "
              "disjoint shares (sharded twice, per-host seeds, no sharding?)",
              records=int(twice.sum()), on_several_hosts=cross)

    added = max(0, excess1 - excess0)
    num["repeats"] = added
    if added:
        hi = -(-c1 // n)
        again = np.flatnonzero(after > hi)
        mask = np.isin(keys, again) & (before[keys] > 0)
        if mask.any() and added > slack:
            bad_steps.append(steps_at[mask])
        judge("repeats", added, slack, streams_why,
              f"would add {added:,} exposures beyond the ideal ({hi} per record after "
              f"{c1:,} exposures of {n:,} records): records the run already saw as often as "
              "it should, planned again",
              exposures=added, records=int(len(again)))
    num["skipped"] = None
    if num["reached_multiple"]:
        # Only what the plan adds: a record already behind before the step (an earlier fault,
        # or a remainder dropped before) counts when the plan leaves it further behind.
        lo0, lo1 = c0 // n, c1 // n
        grown = np.maximum(lo1 - after, 0) - np.maximum(lo0 - before, 0)
        skipped = int(np.maximum(grown, 0).sum())
        records = int((grown > 0).sum())
        num["skipped"] = skipped
        if skipped:
            end = int(steps_at.max()) if len(steps_at) else num["checkpoint_step"]
            allowed = slack + remainder * (lo1 - lo0)
            if skipped > allowed:
                bad_steps.append(np.array([num["checkpoint_step"], end]))
            judge("skips", skipped, allowed,
                  f"{streams_why}; an epoch may drop N mod hosts + N mod global batch = "
                  f"{remainder:,}",
                  f"would leave {records:,} records below {lo1} exposure(s) when the plan "
                  f"reaches {c1:,} exposures by step {end}: skipped",
                  records=records, exposures=skipped)
    else:
        add("INFO", "horizon_short",
            f"the {horizon}-step horizon ends before the next multiple of the corpus "
            f"({n:,} records): records skipped later are not checked")
    if bad_steps:
        allbad = np.concatenate(bad_steps)
        num["first_bad_step"], num["last_bad_step"] = int(allbad.min()), int(allbad.max())
    else:
        num["first_bad_step"] = num["last_bad_step"] = None


def _done(v: PreflightVerdict, t0: float) -> PreflightVerdict:
    sev = v.findings.severities()
    v.status = "unsafe" if "FAIL" in sev else "unknown" if "UNKNOWN" in sev else "safe"
    v.numbers["seconds"] = round(time.perf_counter() - t0, 3)
    return v


__all__ = ["run_loader_preflight"]
