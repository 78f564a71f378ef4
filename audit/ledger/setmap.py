"""A map from record keys to small sets of integers, for millions of keys, in numpy.

The per-record state (tally.audit.ledger.state) keeps what does not fit a record's 8-byte row here:
the hosts of records on three or more hosts, the epochs of records seen outside the row's epoch
window. A Python dict of them cost ~100 bytes a record and Python work per record (measured
with bench/state_size.py: 107 bytes a record on 3+ hosts, and a restore of 2.7M entries took
seconds; here ~16 + 4 a value, and a restore is the arrays' read). The map is a few sorted
layers of (keys, CSR of values), newest last: an update is one new layer (a batch's records, set or
removed), a lookup one binary search per layer, and layers merge size-tiered (the newest into
the one before while it is at least a quarter of its size), so a key is rewritten O(log n)
times and lookups see O(log n) layers. Values are int32 (hosts < 65,536; epochs are int32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tally.audit.core.arrays import spans

MERGE_RATIO = 4


@dataclass
class _Layer:
    keys: np.ndarray  # int64, sorted, unique
    ptr: np.ndarray  # int64 [n + 1]
    values: np.ndarray  # int32
    dead: np.ndarray  # bool: removed (a tombstone over older layers)

    @property
    def size(self) -> int:
        return len(self.keys)


class SetMap:
    """key -> a sorted set of int32 values."""

    def __init__(self) -> None:
        self.layers: list[_Layer] = []

    # ---- reading ---------------------------------------------------------------------------
    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(counts, values) of `keys` (any order; each must be in the map): the values of
        key i are values[sum(counts[:i]):][:counts[i]]."""
        keys = np.asarray(keys, np.int64)
        n = len(keys)
        counts = np.full(n, -1, np.int64)
        found: list[tuple[_Layer, np.ndarray, np.ndarray]] = []
        todo = np.arange(n)
        for layer in reversed(self.layers):
            if not len(todo):
                break
            pos = np.minimum(np.searchsorted(layer.keys, keys[todo]), layer.size - 1)
            hit = layer.keys[pos] == keys[todo]
            idx, p = todo[hit], pos[hit]
            if layer.dead[p].any():
                raise KeyError(f"record {int(keys[idx][layer.dead[p]][0])} is not in the map")
            counts[idx] = layer.ptr[p + 1] - layer.ptr[p]
            found.append((layer, idx, p))
            todo = todo[~hit]
        if len(todo):
            raise KeyError(f"record {int(keys[todo[0]])} is not in the map")
        out_ptr = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=out_ptr[1:])
        values = np.empty(int(out_ptr[-1]), np.int32)
        for layer, idx, p in found:
            c = counts[idx]
            values[spans(out_ptr[idx], c)] = layer.values[spans(layer.ptr[p], c)]
        return counts, values

    def keys(self) -> np.ndarray:
        """The keys in the map, sorted."""
        return self._whole().keys.copy()

    def __len__(self) -> int:
        return len(self.keys())

    def nbytes(self) -> int:
        return sum(x.keys.nbytes + x.ptr.nbytes + x.values.nbytes + x.dead.nbytes
                   for x in self.layers)

    # ---- writing ---------------------------------------------------------------------------
    def update(self, keys: np.ndarray, ptr: np.ndarray, values: np.ndarray,
               removed: np.ndarray) -> None:
        """Set the values of `keys` (sorted; CSR `ptr`, `values`) and remove `removed` (keys
        in the map, none of `keys`)."""
        keys, removed = np.asarray(keys, np.int64), np.asarray(removed, np.int64)
        if not len(keys) and not len(removed):
            return
        all_keys = np.r_[keys, removed]
        counts = np.r_[np.diff(ptr), np.zeros(len(removed), np.int64)]
        order = np.argsort(all_keys, kind="stable")
        starts = np.r_[ptr[:-1], np.zeros(len(removed), np.int64)][order]
        counts = counts[order]
        new_ptr = np.zeros(len(order) + 1, np.int64)
        np.cumsum(counts, out=new_ptr[1:])
        layer = _Layer(all_keys[order], new_ptr,
                       np.asarray(values, np.int32)[spans(starts, counts)],
                       np.r_[np.zeros(len(keys), bool), np.ones(len(removed), bool)][order])
        self.layers.append(layer)
        while len(self.layers) >= 2 and \
                self.layers[-1].size * MERGE_RATIO >= self.layers[-2].size:
            bottom = len(self.layers) == 2
            self.layers[-2:] = [_merge(self.layers[-2], self.layers[-1], drop_dead=bottom)]

    def _whole(self) -> _Layer:
        """The map as one layer, without tombstones; the map itself is left as it is (a
        snapshot writes it while readers of the state look keys up)."""
        layers = list(self.layers)
        while len(layers) >= 2:
            layers[-2:] = [_merge(layers[-2], layers[-1], drop_dead=len(layers) == 2)]
        if not layers:
            return _empty()
        return _merge(layers[0], _empty(), drop_dead=True) if layers[0].dead.any() \
            else layers[0]

    # ---- persistence -----------------------------------------------------------------------
    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        x = self._whole()
        return {f"{prefix}_keys": x.keys, f"{prefix}_ptr": x.ptr, f"{prefix}_values": x.values}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], prefix: str) -> SetMap:
        out = cls()
        keys = arrays[f"{prefix}_keys"].astype(np.int64, copy=False)  # as saved: no copy
        if len(keys):
            out.layers = [_Layer(keys, arrays[f"{prefix}_ptr"].astype(np.int64, copy=False),
                                 arrays[f"{prefix}_values"].astype(np.int32, copy=False),
                                 np.zeros(len(keys), bool))]
        return out


def _empty() -> _Layer:
    return _Layer(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int32),
                  np.zeros(0, bool))


def _merge(old: _Layer, new: _Layer, *, drop_dead: bool) -> _Layer:
    """`new` over `old`: a key in both takes `new`'s entry; tombstones go when nothing older
    remains below (`drop_dead`). Both layers are sorted with unique keys: one binary search of
    `new`'s keys in `old`'s places them, and the values move by boolean masks repeated over
    the counts (one byte a value) rather than gathered through index arrays (a lexsort, then
    int64 spans, took 0.45-0.8 s to merge 685k keys into 2M of 3.4 hosts each on this
    box; 0.25 s this way)."""
    pos = np.searchsorted(old.keys, new.keys)  # old keys before each new one
    drop_old = np.zeros(old.size, bool)
    if old.size and new.size:
        inside = np.flatnonzero(pos < old.size)
        drop_old[pos[inside][old.keys[pos[inside]] == new.keys[inside]]] = True
    keep_new = np.ones(new.size, bool)
    if drop_dead:
        drop_old |= old.dead
        keep_new = ~new.dead
    keep_old = ~drop_old
    kept_before = np.zeros(old.size + 1, np.int64)
    np.cumsum(keep_old, out=kept_before[1:])
    at_new = kept_before[pos[keep_new]] + np.arange(int(keep_new.sum()))
    is_new = np.zeros(int(kept_before[-1]) + len(at_new), bool)
    is_new[at_new] = True
    is_old = ~is_new
    keys = np.empty(len(is_new), np.int64)
    keys[is_new], keys[is_old] = new.keys[keep_new], old.keys[keep_old]
    dead = np.empty(len(is_new), bool)
    dead[is_new], dead[is_old] = new.dead[keep_new], old.dead[keep_old]
    old_counts, new_counts = np.diff(old.ptr), np.diff(new.ptr)
    counts = np.empty(len(is_new), np.int64)
    counts[is_new], counts[is_old] = new_counts[keep_new], old_counts[keep_old]
    ptr = np.zeros(len(keys) + 1, np.int64)
    np.cumsum(counts, out=ptr[1:])
    values = np.empty(int(ptr[-1]), np.int32)
    value_is_new = np.repeat(is_new, counts)
    values[value_is_new] = new.values if keep_new.all() else \
        new.values[np.repeat(keep_new, new_counts)]
    values[~value_is_new] = old.values if keep_old.all() else \
        old.values[np.repeat(keep_old, old_counts)]
    return _Layer(keys, ptr, values, dead)
