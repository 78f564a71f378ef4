"""Two runs' record multisets compared group by group (a group is a step, an epoch or a window
of steps), with numpy over columns: one sort of both runs' (group, key) pairs together.

The diff job (tally.audit.posthoc.diff) runs it on each record-key bucket, where the keys of a group
are split across buckets, so every result is a count that sums over buckets; the live answer
(tally.audit.posthoc.answers) runs it once over the per-record state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tally.audit.core.arrays import sort_in_place

KEY_BITS = 32  # keys are dense codes below 2**32 (a bucket's key offsets, or ranks)
GROUP_LIMIT = 1 << 31  # groups (steps, epochs, windows) are int32 values
# Count (group, key) cells in place when there are at most this many per element compared
# (16 bytes of counts per element); sort the elements otherwise (many steps).
DENSE = 2


@dataclass
class GroupComparison:
    """Per group g (arrays indexed by g from 0): the sizes of A's and B's multisets, their
    distinct keys, the keys both hold, and the L1 distance sum_k |count_A(k) - count_B(k)|
    (0 exactly when the two multisets are equal)."""

    size_a: np.ndarray
    size_b: np.ndarray
    distinct_a: np.ndarray
    distinct_b: np.ndarray
    common: np.ndarray
    l1: np.ndarray


def _bincount(idx: np.ndarray, weights: np.ndarray | None, n: int) -> np.ndarray:
    if not idx.size:
        return np.zeros(n, np.int64)
    return np.bincount(idx, weights, minlength=n).astype(np.int64)


def compare_groups(group_a: np.ndarray, key_a: np.ndarray, group_b: np.ndarray,
                   key_b: np.ndarray, groups: int = 0) -> GroupComparison:
    """`group_x[i]`, `key_x[i]`: the i-th element of run X's multisets (groups >= 0, keys
    < 2**32). Arrays have at least `groups` entries."""
    n = max(groups, int(max(group_a.max(initial=-1), group_b.max(initial=-1))) + 1)
    if n > GROUP_LIMIT:
        raise ValueError(f"group {n - 1} is beyond int32")
    keys = int(max(key_a.max(initial=-1), key_b.max(initial=-1))) + 1
    if n * keys <= DENSE * (len(key_a) + len(key_b)) + 4096:
        return _dense(group_a, key_a, group_b, key_b, n, keys)
    # (group, key, run) packed into one uint64, the run in the lowest bit: a single sort
    # brings each (group, key) pair's elements of both runs together, A's first.
    code = np.concatenate([
        group_a.astype(np.uint64) << np.uint64(KEY_BITS + 1)
        | key_a.astype(np.uint64) << np.uint64(1),
        group_b.astype(np.uint64) << np.uint64(KEY_BITS + 1)
        | key_b.astype(np.uint64) << np.uint64(1) | np.uint64(1)])
    sort_in_place(code)  # each run's elements often come in group order: two sorted runs
    if not code.size:
        zero = np.zeros(n, np.int64)
        return GroupComparison(zero, zero.copy(), zero.copy(), zero.copy(), zero.copy(),
                               zero.copy())
    pair = code >> np.uint64(1)
    head = np.flatnonzero(np.r_[True, pair[1:] != pair[:-1]])
    count = np.diff(np.r_[head, code.size])
    count_b = np.add.reduceat((code & np.uint64(1)).astype(np.int64), head)
    count_a = count - count_b
    g = (pair[head] >> np.uint64(KEY_BITS)).astype(np.int64)
    return GroupComparison(
        size_a=_bincount(g, count_a, n), size_b=_bincount(g, count_b, n),
        distinct_a=_bincount(g[count_a > 0], None, n),
        distinct_b=_bincount(g[count_b > 0], None, n),
        common=_bincount(g[(count_a > 0) & (count_b > 0)], None, n),
        l1=_bincount(g, np.abs(count_a - count_b), n))


def _dense(group_a: np.ndarray, key_a: np.ndarray, group_b: np.ndarray, key_b: np.ndarray,
           n: int, keys: int) -> GroupComparison:
    """Few groups of dense keys (a bucket's steps or epochs): every (group, key) cell counted
    in place, no sort (measured 5x faster than sorting at 25 steps x 600k keys)."""
    ca, cb = (np.bincount(g.astype(np.int64) * keys + k, minlength=n * keys).reshape(n, keys)
              for g, k in ((group_a, key_a), (group_b, key_b)))
    seen_a, seen_b = ca > 0, cb > 0
    out = GroupComparison(
        size_a=ca.sum(axis=1), size_b=cb.sum(axis=1),
        distinct_a=seen_a.sum(axis=1), distinct_b=seen_b.sum(axis=1),
        common=np.logical_and(seen_a, seen_b, out=seen_a).sum(axis=1), l1=ca)
    np.subtract(ca, cb, out=ca)  # in place: the counts are the bucket's largest arrays
    out.l1 = np.abs(ca, out=ca).sum(axis=1)
    return out


def jaccard(distinct_a: np.ndarray, distinct_b: np.ndarray, common: np.ndarray) -> np.ndarray:
    """|A & B| / |A | B| of the groups' key sets (1.0 for two empty sets)."""
    union = distinct_a + distinct_b - common
    return np.where(union > 0, common / np.maximum(union, 1), 1.0)


def dense_codes(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, distinct keys): each key's rank among the distinct keys, for keys that may not
    fit KEY_BITS (whole record keys beyond a manifest)."""
    distinct, codes = np.unique(keys, return_inverse=True)
    return codes.astype(np.int64), distinct
