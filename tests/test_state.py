"""The per-record state's short way (RunState.once: records a batch starts once, from their rows
alone) against its general way (Records.merged and aggregates.deltas), batch by batch: the same
agg-table changes and the same state, on every host layout, through epochs, levels near the
cap, records spilling to the maps and a watermark that trails the batches."""

from __future__ import annotations

import numpy as np
import pytest

from tally.audit.ledger.aggregates import Aggregates, Deltas, _Staged
from tally.audit.ledger.state import COMPACT, PENDING, Once, Records, RunState, Starts


def _general_only(agg: Aggregates, run: int) -> None:
    st = agg._state(run)
    st.once = lambda g, w, exclude=None: (np.zeros(len(g), bool), Once.empty())


def _canonical(d: Deltas) -> tuple:
    def rows(t: tuple) -> list:
        return sorted(zip(*(np.asarray(c).tolist() for c in t), strict=True))

    return rows(d.ranks), rows(d.levels), rows(d.pairs), rows(d.shared), d.totals


@pytest.mark.parametrize("hosts", [8, 100, 300])
def test_records_started_once_change_what_the_general_way_changes(hosts):
    rng = np.random.default_rng(hosts)
    records, batches = 20_000, 40
    per_host = 2 * 2000 // hosts  # ~2,000 starts a batch: most records once in it
    ways = [Aggregates(), Aggregates()]
    _general_only(ways[1], 1)
    once_seen = pending_seen = 0
    for b in range(batches):
        # Each host sends one file a batch, steps in order; keys with replacement over a small
        # corpus (records gain hosts batch after batch, some beyond the row's slots, a few
        # reach the level cap), epochs that advance and repeat, some unknown. Host 0 runs two
        # batches behind: the watermark trails it, so records seen since stay pending (their
        # triples in the pending table) and the others' starts land among their steps.
        parts = []
        for h in range(hosts):
            n = int(rng.integers(1, per_host))
            at = max(b - 2, 0) if h == 0 else b
            steps = np.sort(rng.integers(at * 10, at * 10 + 10, n))
            keys = rng.integers(0, records, n)
            keys[: n // 10] = rng.integers(0, 4, n // 10)  # a few hot records: level cap
            epochs = (steps // 40 + rng.integers(-1, 2, n)).astype(np.int32)
            epochs[rng.random(n) < 0.1] = -1
            epochs[rng.random(n) < 0.02] = 17  # beyond the window: the epoch map
            parts.append(Starts(keys.astype(np.int64), steps.astype(np.int64), epochs, h, 0,
                                int(steps[-1]), hosts))
        got, short = [], []
        for agg in ways:
            inc = agg.increments(1, parts)
            got.append(_canonical(inc.deltas))
            short.append(len(inc.once))
            pending_seen += len(inc.once.pend)
            agg._pending.append(_Staged(1, inc.new, inc.seen, once=inc.once))
            agg.reserve()
            agg.commit()
        assert got[0] == got[1], b
        assert short[1] == 0  # the general-only way took none the short way
        once_seen += short[0]
    a, g = ways[0].runs[1], ways[1].runs[1]
    n = min(a.size, g.size)
    pending = np.uint64(PENDING << 8 * COMPACT.fields["flags"][1])
    assert np.array_equal(a.data[:n].view(np.uint64) & ~pending,
                          g.data[:n].view(np.uint64) & ~pending)
    assert (a.levels, a.many_hosts.keys().tolist(), a.far_epochs.keys().tolist()) == (
        g.levels, g.many_hosts.keys().tolist(), g.far_epochs.keys().tolist())
    assert a.levels and len(a.far_epochs)  # the maps were reached
    assert len(a.many_hosts) or hosts <= 32  # (a mask holds any number of hosts)
    assert once_seen > batches * 2000 // 4  # many records went the short way
    assert pending_seen > batches * 10  # among them records whose triples were pending
    ka, sa = a._pending_table()
    kg, sg = g._pending_table()
    assert np.array_equal(ka, kg) and np.array_equal(sa, sg)
    keys = np.arange(n)
    ra, rg = a.get(keys), g.get(keys)
    for name in ("exposures", "host_ptr", "hosts", "epoch_ptr", "epochs", "dup"):
        assert np.array_equal(getattr(ra, name), getattr(rg, name)), name


def _batch(keys: np.ndarray, step: int, host: int, state: RunState) -> Records:
    """The records of `keys` seen once more at `step` on `host` (as aggregates' general way
    puts them), from their state in `state`."""
    r = state.get(keys)
    out = Records.empty(keys)
    n = len(keys)
    out.exposures = r.exposures + 1
    out.steps = r.steps.copy()
    first_three = np.flatnonzero(r.exposures < 3)
    out.steps[first_three, r.exposures[first_three]] = step
    out.host_ptr, out.hosts = np.arange(n + 1), np.full(n, host, np.int64)
    out.epoch_ptr, out.epochs = np.zeros(n + 1, np.int64), np.zeros(0, np.int64)
    out.dup = np.zeros(n, bool)
    return out


def test_a_batch_costs_its_rows_not_the_pending_table():
    """The regression guard of the random-key ingest slowdown (issue 35): while one step of
    all hosts is larger than the pending bound, a batch whose records were not pending leaves
    every older pending run as it was (the same arrays: nothing of size pending copied,
    merged or sorted), and a batch that takes records over tombstones them in place."""
    rng = np.random.default_rng(0)
    st = RunState()
    st.PENDING_MAX = 3_000  # one step of all hosts (4 x 1,000) is larger
    hosts, records = 4, 10_000_000
    for step in range(3):
        for h in range(hosts):
            keys = np.unique(rng.integers(0, records, 1_000))
            before = [(r.keys, r.steps) for r in st.pending]
            st.put(_batch(keys, step, h, st))
            st.observe(0, h, hosts, step)
            st.settle()
            after = {id(r.keys) for r in st.pending}
            # No pending record among them (1,000 of 10M): older runs untouched, unless the
            # watermark moved (a step of all hosts done) and settled them.
            if st.watermark < step:
                assert all(id(k) in after for k, _ in before), (step, h)
            assert len(st.pending) <= RunState.PENDING_RUNS
    # A batch that takes pending records over: tombstones, lookups see the newest triples.
    taken = st.pending[-1].keys[:10]
    st.put(_batch(taken, 3, 0, st))
    assert sum(r.count for r in st.pending) == sum(
        len(r.keys) if r.alive is None else int(r.alive.sum()) for r in st.pending)
    got = st.get(taken)
    assert (got.exposures == 2).all() and (got.steps[:, 1] == 3).all()
    keys, _ = st._pending_table()
    assert len(np.unique(keys)) == len(keys)  # one live entry a record


def test_the_rows_grow_geometrically_but_never_far_beyond_the_need():
    # The room grown into is zeroed, so resident: 100M random keys held 112.5M rows (9 B a
    # record) when growth was 1/8 of the size whatever the need.
    st = RunState()
    st.GROW_ROWS = 1000
    st.reserve(80_000)
    st.data[79_999]["level"] = 7  # rows already there survive a growth
    st.reserve(80_001)
    assert st.size == 81_001  # 1/8 more would be 90,000
    assert st.data[79_999]["level"] == 7 and st.data[80_000]["level"] == 0
    st.reserve(81_002)
    assert st.size == 82_002
    small = RunState()
    small.reserve(4000)
    small.reserve(4001)
    assert small.size == 4500  # below the bound: 1/8 more, so few reallocations


def test_lowering_the_watermark_settles_exactly_the_steps_below_it():
    """A pending run whose steps straddle the watermark keeps the records with a step at or
    after it pending, with that step, and settles the rest (their rows unflagged); a run whose
    steps are all below settles whole. Checked against the triples put, record by record."""
    rng = np.random.default_rng(7)
    st = RunState()
    keys = np.arange(0, 60_000, 3, dtype=np.int64)  # sorted, spread over the rows
    put: dict[int, list[int]] = {}
    for step in (10, 20, 30):  # three batches of one host: three pending runs
        batch = np.sort(rng.choice(keys, 8_000, replace=False))
        st.put(_batch(batch, step, 0, st))
        for k in batch.tolist():
            put.setdefault(k, []).append(step)
    assert len(st.pending) == 3 and st.watermark < 10
    for watermark in (15, 25, 31):
        st.lower(watermark)
        got = st.get(keys)
        flags = st.data["flags"][keys]
        for i, k in enumerate(keys.tolist()):
            steps = put.get(k, [])[:3]
            want = [s if s >= watermark else np.iinfo(np.int64).min for s in steps]
            want += [np.iinfo(np.int64).max] * (3 - len(want))
            assert got.steps[i].tolist() == want, (watermark, k)
            live = any(s >= watermark for s in steps)
            assert bool(flags[i] & PENDING) == live, (watermark, k)
    assert not st.pending
