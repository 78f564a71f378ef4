"""Partial results of the reconcile job, as one type with its own merge.

Every worker emits a `Partial` holding the few fields it computed (a file's per-step and
per-host counts, a bucket's per-record statistics, a step's replay comparison); the driver
folds them all with `merge`. How each field merges is declared beside it (summed, smallest,
largest, elementwise largest, concatenated), so the rule never depends on a key's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

EXAMPLES = 20  # examples kept per finding (hash mismatches, unknown keys)


class Spans:
    """Per-step counts kept as (first step, counts) pieces. One input file covers a few steps
    of a run that may have a million: padding each file's counts to the run's length would make
    merging cost files x steps."""

    MAX_PIECES = 256  # then fold them into one: merging costs about files / 256 x steps

    def __init__(self, pieces: list[tuple[int, np.ndarray]] | None = None) -> None:
        self.pieces = pieces or []

    def __add__(self, other: Spans) -> Spans:
        out = Spans(self.pieces + other.pieces)
        if len(out.pieces) > self.MAX_PIECES:
            lo = min(p for p, _ in out.pieces)
            out = Spans([(lo, out.dense(lo))])
        return out

    def dense(self, lo: int = 0) -> np.ndarray:
        """The counts of steps lo, lo + 1, ... to the last step counted (no piece before lo)."""
        if not self.pieces:
            return np.zeros(0, np.int64)
        out = np.zeros(max(p + len(c) for p, c in self.pieces) - lo, dtype=np.int64)
        for p, c in self.pieces:
            out[p - lo: p - lo + len(c)] += c
        return out


# ---- merge rules -------------------------------------------------------------------------------

def padded_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise sum of two arrays of any shapes, each padded with zeros to the larger."""
    shape = tuple(max(x, y) for x, y in zip(a.shape, b.shape, strict=True))
    out = np.zeros(shape, dtype=np.result_type(a.dtype, b.dtype))
    out[tuple(slice(0, n) for n in a.shape)] += a
    out[tuple(slice(0, n) for n in b.shape)] += b
    return out


def padded_max(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise maximum of two 1-d series, the shorter padded with zeros."""
    out = np.zeros(max(len(a), len(b)), dtype=np.int64)
    out[: len(a)] = a
    out[: len(b)] = np.maximum(out[: len(b)], b)
    return out


def total(a: Any, b: Any) -> Any:
    """Sums ints, Spans, arrays (padded) and dicts of those, key by key."""
    if isinstance(a, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = total(out[k], v) if k in out else v
        return out
    if isinstance(a, np.ndarray):
        return padded_sum(a, b)
    return a + b


def smallest(a: Any, b: Any) -> Any:
    """The smaller value; dicts key by key."""
    if isinstance(a, dict):
        return {k: smallest(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k))
                for k in a.keys() | b.keys()}
    return min(a, b)


def largest(a: Any, b: Any) -> Any:
    return max(a, b)


def examples(a: list, b: list) -> list:
    return (a + b)[:EXAMPLES]


def joined(a: list, b: list) -> list:
    """All of both (lists bounded by the number of input files)."""
    return a + b


def spans(a: dict, b: dict) -> dict:
    """Per key, the widest (first, last) of both."""
    out = dict(a)
    for k, (lo, hi) in b.items():
        out[k] = (min(lo, out[k][0]), max(hi, out[k][1])) if k in out else (lo, hi)
    return out


def _field(merge: Callable[[Any, Any], Any], default: Any = None,
           factory: Callable[[], Any] | None = None) -> Any:
    if factory is not None:
        return field(default_factory=factory, metadata={"merge": merge})
    return field(default=default, metadata={"merge": merge})


def _summed(factory: Callable[[], Any] = int) -> Any:
    return _field(total, factory=factory)


def _empty() -> np.ndarray:
    return np.zeros(0, np.int64)


@dataclass
class Partial:
    """Aggregates of part of a run's consumption; fields that a worker did not compute stay
    empty (None, 0, an empty array) and merge as such."""

    # ---- per input file (effective rows) ----
    segments: int = _summed()  # effective rows read
    slices_written: int = _summed()  # bucket slices written
    first_step: int | None = _field(smallest)
    last_step: int | None = _field(largest)
    step_segments: Spans = _summed(Spans)
    step_tokens: Spans = _summed(Spans)
    step_rows: Spans = _summed(Spans)  # distinct (host, row) per step
    host_segments: np.ndarray = _summed(_empty)
    host_exposures: np.ndarray = _summed(_empty)
    host_tokens: np.ndarray = _summed(_empty)
    skipped_files: list[tuple[str, str]] = _field(examples, factory=list)  # (path, reason)
    skipped: int = _summed()  # files skipped (all of them; skipped_files keeps examples)
    # What each host consumed step by step (audit.reconcile.host_steps).
    repeated_step_ranges: list[tuple[int, int, int]] = _field(joined, factory=list)
    host_step_edges: list = _field(joined, factory=list)
    host_step_ranges: list[tuple[int, int, int, int]] = _field(joined, factory=list)
    epoch_steps: dict[int, tuple[int, int]] = _field(spans, factory=dict)

    # ---- per record-key bucket ----
    slices_joined: int = _summed()
    unknown_segments: int = _summed()
    unknown_keys: int = _summed()
    unknown_examples: list[dict] = _field(examples, factory=list)
    hash_mismatch_examples: list[dict] = _field(examples, factory=list)
    train_exposures: int = _summed()
    epoch_duplicates: int = _summed()
    epoch_duplicate_records: int = _summed()
    exposure_counts: np.ndarray = _summed(_empty)  # train records seen e times, by e
    hash_checked: int = _summed()
    hash_unverifiable: int = _summed()
    hash_mismatches: int = _summed()
    heldout_consumed_records: int = _summed()
    heldout_exposures: int = _summed()
    overlap: np.ndarray = _summed(lambda: np.zeros((0, 0), np.int64))  # host x host, train
    host_unique: np.ndarray = _summed(_empty)
    host_overlap_with_others: np.ndarray = _summed(_empty)
    new_unique_by_step: np.ndarray = _summed(_empty)
    train_exposures_by_step: np.ndarray = _summed(_empty)
    max_rank_by_step: np.ndarray = _field(padded_max, factory=_empty)
    # Exposures beyond the first of a record in its epoch (epoch known), by step and by host;
    # distinct train records seen per epoch.
    epoch_repeats_by_step: np.ndarray = _summed(_empty)
    epoch_repeats_by_host: np.ndarray = _summed(_empty)
    epoch_duplicated_by_host: np.ndarray = _summed(_empty)  # repeated records a host was in
    records_by_epoch: np.ndarray = _summed(_empty)
    # name -> (records, tokens, exposures, tokens consumed, never seen)
    domain: dict[str, np.ndarray] = _summed(dict)
    source: dict[str, np.ndarray] = _summed(dict)  # name -> (records, never seen)

    # ---- per replayed step ----
    replay: dict[int, np.ndarray] = _summed(dict)  # attempt -> (rolled back, replayed, same)
    first_differing_step: dict[int, int] = _field(smallest, factory=dict)

    def merge(self, other: Partial) -> Partial:
        out = {}
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            out[f.name] = a if b is None else b if a is None else f.metadata["merge"](a, b)
        return Partial(**out)


def merge_all(parts: Iterable[Partial]) -> Partial:
    out = Partial()
    for p in parts:
        out = out.merge(p)
    return out
