"""Array helpers shared by the numpy-vectorised jobs."""

from __future__ import annotations

import numpy as np


def distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values of a 1-d array: `np.unique(values)`, by one sort.

    NumPy 2.3+ answers a plain `np.unique` from a hash table, which is far slower on many
    distinct 64-bit values: measured on this 2-core box (numpy 2.4.6), 2.5M distinct int64 took
    5.0 s with `np.unique` and 0.09 s sorted (with `return_counts`, which still sorts, 0.09 s).
    """
    out = np.sort(np.asarray(values).ravel())
    if out.size:
        out = out[np.r_[True, out[1:] != out[:-1]]]
    return out
