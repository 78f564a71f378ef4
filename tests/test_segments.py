"""Segments from real Grain pipelines: unpacked, first-fit packed and concat-then-split."""

import grain
import numpy as np
import pytest
from grain import experimental as gx

from tally.audit.core.hashing import content_hash
from tally.audit.hook.segments import Segments, segments_from_batch

N = 40
LENGTH = 16


def _corpus():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 1000, rng.integers(1, 30), dtype=np.int32) for _ in range(N)]


def _keyed(corpus, epochs=1, truncate=None):
    def keyed(i, x):
        x = x[:truncate]
        return {"tokens": x, "key": np.full(len(x), i, np.int64),
                "pos": np.arange(len(x), dtype=np.int32)}

    return grain.MapDataset.source(corpus).repeat(epochs).map_with_index(keyed)


def _check_all(batches, corpus, *, expect_whole: bool, epochs=1):
    seen: dict[tuple[int, int], int] = {}
    for b in batches:
        segs = segments_from_batch(b, records_per_epoch=N)
        for i in range(len(segs)):
            k, off, n = int(segs.record_key[i]), int(segs.offset[i]), int(segs.n_tokens[i])
            rec = corpus[k]
            assert int(segs.content_hash[i]) == content_hash(rec[off : off + n])
            assert b["tokens"][segs.row[i]].size == LENGTH
            e = int(segs.epoch[i])
            seen[(e, k)] = seen.get((e, k), 0) + n
    # Every record of every epoch appears, with exactly its tokens (or truncated to a row).
    assert set(seen) == {(e, k) for e in range(epochs) for k in range(N)}
    for (_, k), n in seen.items():
        want = len(corpus[k]) if expect_whole else min(len(corpus[k]), LENGTH)
        assert n == want


def test_first_fit_packing():
    corpus = _corpus()
    ds = gx.FirstFitPackIterDataset(
        _keyed(corpus, truncate=LENGTH).to_iter_dataset(),
        length_struct={"tokens": LENGTH, "key": LENGTH, "pos": LENGTH},
        num_packing_bins=4,
    ).batch(3)
    batches = list(ds)
    _check_all(batches, corpus, expect_whole=False)
    # The same batch under MaxText's field names gives the same segments.
    names = {"tokens": "inputs", "tokens_segment_ids": "inputs_segmentation",
             "pos": "inputs_position", "key": "inputs_key"}
    renamed = {names[k]: v for k, v in batches[0].items() if k in names}
    other = segments_from_batch(renamed, feature="inputs", segment_ids="inputs_segmentation",
                                position="inputs_position", key="inputs_key")
    mine = segments_from_batch(batches[0])
    assert len(other) == len(mine) > 0
    for field in ("row", "record_key", "offset", "n_tokens", "content_hash"):
        np.testing.assert_array_equal(getattr(other, field), getattr(mine, field))


def test_concat_then_split_keeps_true_offsets_across_rows():
    corpus = _corpus()
    ds = gx.ConcatThenSplitIterDataset(
        _keyed(corpus, epochs=2).to_iter_dataset(),
        length_struct={"tokens": LENGTH, "key": LENGTH, "pos": LENGTH},
    ).batch(4)
    batches = list(ds)
    # Records longer than a row are cut, so some segment must start mid-record.
    offsets = np.concatenate([segments_from_batch(b, records_per_epoch=N).offset
                              for b in batches])
    assert offsets.max() > 0
    _check_all(batches, corpus, expect_whole=True, epochs=2)


def test_unpacked_rows_with_per_row_keys():
    tokens = np.arange(12, dtype=np.int32).reshape(3, 4)
    segs = segments_from_batch({"tokens": tokens, "key": np.array([5, 47, 90])},
                               records_per_epoch=N)
    assert segs.record_key.tolist() == [5, 7, 10]
    assert segs.epoch.tolist() == [0, 1, 2]
    assert segs.n_tokens.tolist() == [4, 4, 4]
    assert segs.offset.tolist() == [0, 0, 0]
    assert [int(h) for h in segs.content_hash] == [content_hash(r) for r in tokens]


def test_without_records_per_epoch_the_index_is_the_key():
    segs = segments_from_batch({"tokens": np.ones((2, 3), np.int32), "key": np.array([3, 9])})
    assert segs.record_key.tolist() == [3, 9]
    assert segs.epoch.tolist() == [-1, -1]


def test_bad_shapes_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"batch\['key'\] has shape"):
        segments_from_batch({"tokens": np.ones((2, 3), np.int32), "key": np.array([1, 2, 3])})
    with pytest.raises(ValueError, match="must be"):
        segments_from_batch({"tokens": np.ones(3, np.int32), "key": np.array([1])})
    with pytest.raises(ValueError, match="at least one token"):
        Segments.build(row=[0], record_key=[1], n_tokens=[0], content_hash=[1])
