"""The per-record state's short way (RunState.once: records a batch starts once, from their rows
alone) against its general way (Records.merged and aggregates.deltas), batch by batch: the same
agg-table changes and the same state, on every host layout, through epochs, levels near the
cap, records spilling to the maps and a watermark that trails the batches."""

from __future__ import annotations

import numpy as np
import pytest

from audit.ledger.aggregates import Aggregates, Deltas, _Staged
from audit.ledger.state import COMPACT, PENDING, Once, Starts


def _general_only(agg: Aggregates, run: int) -> None:
    st = agg._state(run)
    st.once = lambda inc, w, exclude=None: (np.zeros(len(inc.keys), bool), Once.empty())


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
    once_seen = 0
    for b in range(batches):
        # Each host sends one file a batch, steps in order; keys with replacement over a small
        # corpus (records gain hosts batch after batch, some beyond the row's slots, a few
        # reach the level cap), epochs that advance and repeat, some unknown.
        parts = []
        for h in range(hosts):
            n = int(rng.integers(1, per_host))
            steps = np.sort(rng.integers(b * 10, b * 10 + 10, n))
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
    ka, sa = a._pending_table()
    kg, sg = g._pending_table()
    assert np.array_equal(ka, kg) and np.array_equal(sa, sg)
    keys = np.arange(n)
    ra, rg = a.get(keys), g.get(keys)
    for name in ("exposures", "host_ptr", "hosts", "epoch_ptr", "epochs", "dup"):
        assert np.array_equal(getattr(ra, name), getattr(rg, name)), name
