"""The per-record state's sparse map (audit.ledger.setmap) against a dict, over random
updates and removals, through its merges and a snapshot's arrays."""

import random

import numpy as np
import pytest

from audit.ledger.setmap import SetMap


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
