"""Run as a script (Grain worker processes need a __main__ guard): the keyed loader with
mp_prefetch workers covers one epoch exactly once and restores its state exactly."""

import dataclasses
import sys
from collections import Counter

import numpy as np

from tally.audit.hook.segments import segments_from_batch
from tally.pipeline.corpus import TokenSource
from tally.pipeline.loader import KeyedLoader, LoaderConfig


def main(corpus: str) -> None:
    src = TokenSource(corpus)
    for packing in ("first_fit",):
        cfg = LoaderConfig(seq_len=64, global_batch=8, packing=packing, seed=2, workers=2,
                           epochs=1, drop_remainder=False)
        seen = Counter()
        for host in range(2):
            with KeyedLoader(src, cfg, host, 2) as loader:
                for batch in loader:
                    segs = segments_from_batch(batch, records_per_epoch=len(src))
                    seen.update(segs.record_key.tolist())
        assert len(seen) == len(src) and set(seen.values()) == {1}, packing

        cfg = dataclasses.replace(cfg, epochs=None, drop_remainder=True)
        with KeyedLoader(src, cfg, 1, 2) as a:
            for _ in range(5):
                next(a)
            state = a.get_state()
            want = [next(a) for _ in range(4)]
        with KeyedLoader(src, cfg, 1, 2) as b:
            b.set_state(state)
            for w in want:
                got = next(b)
                assert all(np.array_equal(got[k], w[k]) for k in w), packing
        print(packing, "ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
