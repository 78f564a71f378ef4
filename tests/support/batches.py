"""Deterministic batches, as a keyed loader hands them to the writer: one record per row."""

from __future__ import annotations

import numpy as np


def record_tokens(key: int, length: int = 64) -> np.ndarray:
    return np.random.default_rng(1_000_003 + key).integers(0, 50_000, length, dtype=np.int32)


def unpacked_batch(step: int, rows: int = 4, length: int = 16, n_records: int = 1000,
                   host: int = 0, hosts: int = 1) -> dict[str, np.ndarray]:
    """A deterministic one-record-per-row batch: row r of host h at step s reads one key."""
    keys = (np.arange(rows) + (step * hosts + host) * rows) % n_records
    rng = np.random.default_rng(keys[0])
    lens = rng.integers(1, length + 1, rows)
    tokens = np.zeros((rows, length), np.int32)
    seg = np.zeros((rows, length), np.int32)
    for r, (k, n) in enumerate(zip(keys, lens, strict=True)):
        tokens[r, :n] = record_tokens(int(k))[:n]
        seg[r, :n] = 1
    return {"tokens": tokens, "tokens_segment_ids": seg, "key": keys.astype(np.int64)}
