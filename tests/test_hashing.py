import numpy as np
import pytest
import xxhash

from tally.audit.core.hashing import content_hash, hash_runs


def test_hash_is_xxh3_64_seed0_over_little_endian_int32():
    toks = [1, 2, 3, 70000, -5]
    expected = xxhash.xxh3_64_intdigest(np.array(toks, dtype="<i4").tobytes(), seed=0)
    assert content_hash(toks) == expected
    # Same values in other integer dtypes and byte orders hash the same.
    assert content_hash(np.array(toks, dtype=">i4")) == expected
    assert content_hash(np.array(toks, dtype=np.int64)) == expected
    # Known vector: xxh3_64 of the empty input.
    assert content_hash([]) == 0x2D06800538D394C2


def test_hash_rejects_non_integer_and_out_of_range_tokens():
    with pytest.raises(TypeError):
        content_hash(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="int32"):
        content_hash(np.array([2**31], dtype=np.int64))


def test_hash_runs_equals_content_hash_of_each_slice():
    rng = np.random.default_rng(0)
    flat = rng.integers(0, 50000, 1000, dtype=np.int32)
    starts = np.array([0, 10, 500, 999])
    lengths = np.array([10, 490, 499, 1])
    got = hash_runs(flat, starts, lengths)
    assert got.dtype == np.uint64
    assert [int(h) for h in got] == [content_hash(flat[s : s + n]) for s, n in
                                      zip(starts, lengths, strict=True)]
