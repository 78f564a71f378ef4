"""The per-record state's sparse map (tally.audit.ledger.setmap) against a dict, over random
updates and removals, through its merges and a snapshot's arrays."""

import random

import numpy as np
import pytest

from tally.audit.ledger.setmap import SetMap


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_setmap_agrees_with_a_dict(seed):
    rng = random.Random(seed)
    m, want = SetMap(), {}
    layers = set()
    for _ in range(300):
        keys = sorted(rng.sample(range(3000), rng.randint(1, 80)))
        gone = [k for k in rng.sample(sorted(want), min(len(want), rng.randint(0, 25)))
                if k not in keys]
        sets = [sorted(rng.sample(range(70000), rng.randint(0, 6))) for _ in keys]
        m.update(np.array(keys), np.r_[0, np.cumsum([len(v) for v in sets])],
                 np.array([x for v in sets for x in v], np.int32), np.array(sorted(gone)))
        want.update(zip(keys, sets, strict=True))
        for k in gone:
            del want[k]
        layers.add(len(m.layers))
        asked = np.array(rng.sample(sorted(want), min(len(want), 60)), np.int64)
        counts, values = m.get(asked)
        at = np.r_[0, np.cumsum(counts)]
        assert [values[at[i]:at[i + 1]].tolist() for i in range(len(asked))] == \
            [want[k] for k in asked.tolist()]
        with pytest.raises(KeyError):  # a removed or unknown key is no empty set
            m.get(np.array([3000 + rng.randint(0, 9)]))
    assert max(layers) > 1  # updates were layered, and merged
    again = SetMap.from_arrays(m.arrays("x"), "x")
    assert again.keys().tolist() == m.keys().tolist() == sorted(want)
    counts, values = again.get(np.array(sorted(want)))
    assert values.tolist() == [x for k in sorted(want) for x in want[k]]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_runs_host_sets_read_back_through_every_host_layout(seed):
    """RunState's rows hold host sets as a mask, in four one-byte slots or in two two-byte
    slots (the map beyond): random sets put in rounds whose largest host moves the run
    through the layouts (hosts up to 65,535, which no slot holds) read back as put, every
    round, against a dict."""
    from tally.audit.ledger.state import LAYOUTS, Records, RunState, csr

    rng = np.random.default_rng(seed)
    st, want = RunState(), {}
    for top in (31, 31, 200, 254, 255, 9000, 65535):
        keys = np.unique(rng.integers(0, 5000, 800))
        sizes = rng.choice([0, 1, 2, 3, 4, 5, 9], len(keys))
        rows, hosts = [], []
        for i, k in enumerate(keys.tolist()):
            # The first two records on the round's largest host, alone and with another.
            hs = [top] if i == 0 else [0, top] if i == 1 else \
                sorted(set(rng.integers(0, top + 1, sizes[i]).tolist()))
            want[k] = hs
            rows += [i] * len(hs)
            hosts += hs
        r = Records.empty(keys)
        r.exposures[:] = 1
        r.host_ptr, r.hosts = csr(np.array(rows, np.int64), np.array(hosts, np.int64),
                                  len(keys))
        st.put(r)
        assert st.hosts_in_rows == next(x for x in LAYOUTS if top <= x.cap or x is LAYOUTS[-1])
        every = np.array(sorted(want), np.int64)
        got = st.get(every)
        for i, k in enumerate(every.tolist()):
            assert got.hosts[got.host_ptr[i]: got.host_ptr[i + 1]].tolist() == want[k], (top, k)
