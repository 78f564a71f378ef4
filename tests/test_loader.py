"""The keyed Grain loader on a real ArrayRecord corpus: coverage, faults, state, workers."""

import dataclasses
from collections import Counter, defaultdict

import numpy as np
import pytest

from tally.audit.core.hashing import content_hash
from tally.audit.hook.segments import segments_from_batch
from tally.pipeline.corpus import TokenSource
from tally.pipeline.loader import KeyedLoader, LoaderConfig, LoaderStateError

SEQ = 64


@pytest.fixture(scope="module")
def source(corpora):
    src = TokenSource(corpora.corpus(records=1026, seed=3, shards=3, heldout_fraction=0.0025,
                                     length_scale=0.08, min_len=1, max_len=200))
    assert len(src) == 1024
    return src


def _lengths(source):
    return np.array([len(source[i]) for i in range(len(source))])


def _consume(source, cfg, hosts, steps=None):
    """Segments consumed by every host: list of (host, step, Segments)."""
    out = []
    for h in range(hosts):
        loader = KeyedLoader(source, cfg, h, hosts)
        for step, batch in enumerate(loader):
            if steps is not None and step >= steps:
                break
            out.append((h, step, segments_from_batch(batch, records_per_epoch=len(source))))
    return out


def _exposures(consumed):
    c = Counter()
    for _, _, s in consumed:
        for k, off in zip(s.record_key.tolist(), s.offset.tolist(), strict=True):
            if off == 0:
                c[k] += 1
    return c


@pytest.mark.parametrize("packing", ["none", "first_fit", "concat_split"])
@pytest.mark.parametrize("hosts", [1, 2, 4, 8])
def test_one_epoch_covers_the_train_split_exactly_once(source, packing, hosts):
    cfg = LoaderConfig(seq_len=SEQ, global_batch=8 * hosts, packing=packing, epochs=1,
                       drop_remainder=False, seed=5)
    consumed = _consume(source, cfg, hosts)
    lengths = _lengths(source)
    want = lengths if packing == "concat_split" else np.minimum(lengths, SEQ)
    tokens = np.zeros(len(source), np.int64)
    pieces = defaultdict(list)
    for _, _, s in consumed:
        assert set(s.epoch.tolist()) == {0}
        for i in range(len(s)):
            k, off, n = int(s.record_key[i]), int(s.offset[i]), int(s.n_tokens[i])
            tokens[k] += n
            pieces[k].append((off, n))
            assert int(s.content_hash[i]) == content_hash(source[k][off:off + n])
    # By tokens: every record's tokens exactly once.
    assert (tokens == want).all()
    # By segments: pieces of each record tile it without overlap; unpacked/first-fit: one each.
    for ps in pieces.values():
        ps.sort()
        assert ps[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(ps, ps[1:],
                                                                          strict=False))
        if packing != "concat_split":
            assert len(ps) == 1
    assert len(pieces) == len(source)


def test_per_host_seed_fault_looks_like_sampling_with_replacement(source):
    hosts, n = 8, len(source)
    cfg = LoaderConfig(seq_len=SEQ, global_batch=8 * hosts, fault="per_host_seed", seed=1)
    c = _exposures(_consume(source, cfg, hosts, steps=n // (8 * hosts)))
    unseen = 1 - len(c) / n
    assert abs(unseen - (1 - 1 / hosts) ** hosts) < 0.05  # 0.344 expected
    assert sum(v >= 2 for v in c.values()) / n > 0.15


def test_double_slice_fault_reads_one_in_h_squared_and_repeats(source):
    hosts, n = 4, len(source)
    cfg = LoaderConfig(seq_len=SEQ, global_batch=4 * hosts, fault="double_slice", seed=1,
                       epochs=1, drop_remainder=False)
    one_epoch = _consume(source, cfg, hosts)
    assert sum(len(s) for _, _, s in one_epoch) == n // hosts  # each host read 1/H^2
    cfg = dataclasses.replace(cfg, epochs=None, drop_remainder=True)
    c = _exposures(_consume(source, cfg, hosts, steps=n // (4 * hosts)))
    assert len(c) / n < 0.8 and max(c.values()) >= 2


def test_no_sharding_fault_shows_every_record_to_every_host(source):
    hosts = 4
    cfg = LoaderConfig(seq_len=SEQ, global_batch=8 * hosts, fault="no_sharding", epochs=1,
                       drop_remainder=False)
    c = _exposures(_consume(source, cfg, hosts))
    assert set(c.values()) == {hosts} and len(c) == len(source)


def _reshard(source, old, new, *, elastic, fault=None, steps=10):
    cfg = LoaderConfig(seq_len=SEQ, global_batch=16, elastic=elastic, epochs=1, fault=fault)
    consumed, states = Counter(), []
    for h in range(old):
        loader = KeyedLoader(source, cfg, h, old)
        for _ in range(steps):
            for k in segments_from_batch(next(loader), records_per_epoch=len(source)).record_key:
                consumed[int(k)] += 1
        states.append(loader.get_state())
    for h in range(new):
        loader = KeyedLoader(source, cfg, h, new)
        loader.set_state(states[h % old])
        for batch in loader:
            for k in segments_from_batch(batch, records_per_epoch=len(source)).record_key:
                consumed[int(k)] += 1
    return consumed


@pytest.mark.parametrize("old,new", [(8, 4), (4, 8)])
def test_elastic_reshard_continues_exactly(source, old, new):
    c = _reshard(source, old, new, elastic=True)
    assert len(c) == len(source) and set(c.values()) == {1}


@pytest.mark.parametrize("old,new", [(8, 4), (4, 8)])
def test_naive_reshard_fault_skips_and_repeats_a_band(source, old, new):
    c = _reshard(source, old, new, elastic=False, fault="naive_reshard")
    repeated = sum(v >= 2 for v in c.values())
    skipped = len(source) - len(c)
    if old > new:
        assert repeated > 0  # the new hosts re-read a band the old ones had read
    else:
        assert skipped > 0  # the new hosts jump past a band nobody read
    assert repeated + skipped > 0


def test_restoring_on_another_host_count_without_elastic_is_refused(source):
    cfg = LoaderConfig(seq_len=SEQ, global_batch=16)
    state = KeyedLoader(source, cfg, 0, 8).get_state()
    with pytest.raises(LoaderStateError, match="saved on 8 hosts.*on 4 without the elastic"):
        KeyedLoader(source, cfg, 0, 4).set_state(state)
    other = LoaderConfig(seq_len=SEQ, global_batch=32)
    with pytest.raises(LoaderStateError, match="global_batch was 16 when saved, is 32"):
        KeyedLoader(source, other, 0, 8).set_state(state)


@pytest.mark.parametrize("packing,elastic", [("none", False), ("first_fit", False),
                                             ("concat_split", False), ("none", True)])
def test_restored_state_continues_exactly_where_it_stopped(source, packing, elastic):
    cfg = LoaderConfig(seq_len=SEQ, global_batch=8, packing=packing, elastic=elastic, seed=9)
    a = KeyedLoader(source, cfg, 1, 2)
    for _ in range(7):
        next(a)
    state = a.get_state()
    expected = [next(a) for _ in range(5)]
    b = KeyedLoader(source, cfg, 1, 2)
    b.set_state(state)
    for want in expected:
        got = next(b)
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_bad_configs_are_refused(source):
    with pytest.raises(ValueError, match="not divisible"):
        KeyedLoader(source, LoaderConfig(global_batch=10), 0, 4)
    with pytest.raises(ValueError, match="packing must be 'none'"):
        KeyedLoader(source, LoaderConfig(elastic=True, packing="first_fit"), 0, 1)
    with pytest.raises(ValueError, match="fault"):
        KeyedLoader(source, LoaderConfig(fault="typo"), 0, 1)


@pytest.mark.slow
def test_mp_prefetch_workers_cover_the_epoch_and_restore_exactly(source):
    import subprocess
    import sys

    from tests.support import ROOT
    corpus = str(source.shards[0].path.parent)
    r = subprocess.run([sys.executable, "tests/support/loader_workers.py", corpus], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["first_fit", "ok"]
