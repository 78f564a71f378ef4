"""Array helpers shared by the numpy-vectorised jobs."""

from __future__ import annotations

from typing import Any

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


def sort_in_place(a: np.ndarray) -> np.ndarray:
    """Sort `a` (1-d) in place with whichever of numpy's sorts suits its order; returns `a`.

    numpy's default sort (introsort) does not look for runs, and this box's numpy (AMD EPYC:
    no SIMD sort) took 371 ms for 4M int64 in 8 sorted runs, slower than random (270 ms); its
    stable sort (timsort) merged them in 51 ms, and 4M nearly sorted values in 5 ms, but is
    8% slower on random values (292 ms). Concatenated sorted runs are common here (a row
    store's runs, a record's rows in step order), so the descents are counted first (2-4 ms
    for 4M) and timsort is used when fewer than one value in 8 is one."""
    if len(a) > 1 and 8 * np.count_nonzero(a[1:] < a[:-1]) < len(a):
        a.sort(kind="stable")
    else:
        a.sort()
    return a


def bincount(idx: np.ndarray, weights: np.ndarray | None = None, n: int = 0) -> np.ndarray:
    """`np.bincount` of `idx` with at least `n` bins, as int64 unless the weights are floats
    (an empty `idx` gives `n` zeros)."""
    if idx.size == 0:
        return np.zeros(n, dtype=np.int64)
    out = np.bincount(idx, weights=weights, minlength=n)
    return out.astype(np.int64) if weights is None or weights.dtype.kind in "iu" else out


def spans(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The positions starts[i] .. starts[i] + counts[i] - 1, for every i in order (gathering
    or scattering variable-length slices of a CSR in one indexing)."""
    ends = np.cumsum(counts)
    total = int(ends[-1]) if len(ends) else 0
    return np.repeat(starts - (ends - counts), counts) + np.arange(total)


def ranks(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Each value's position in `ids` (sorted, distinct, holding every value): host numbers as
    indices of structures sized by the hosts that exist, never by the largest host number.
    `values` as they are when `ids` are 0..k-1, the usual case."""
    if not len(ids) or int(ids[-1]) == len(ids) - 1:
        return values
    return np.searchsorted(ids, values)


# Records seen by more hosts than this go through one dense product; the others through their
# explicit host pairs (k^2 for a record on k hosts). A loader's faults leave most records on a
# few hosts (sampling with replacement: about 1 + C / N on average), and a loader that shards
# nothing puts every record on every host: the product is what that case needs.
PAIRS_UP_TO = 16


def host_overlap(rec: np.ndarray, host: np.ndarray, k: np.ndarray,
                 hosts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From distinct (record, host) pairs grouped by record (`rec` sorted), `k` the number of
    hosts of each pair's record: per host, the records it saw and those another host saw too,
    and the host x host overlap matrix (records both saw; the diagonal: records the host saw).

    Memory is proportional to the pairs, not records x hosts: per-host counts are bincounts,
    and the matrix sums each record's ordered host pairs (or, for the records on many hosts,
    one matrix product over those records alone, in bounded chunks). The counts add up over
    disjoint sets of records, so a caller may feed the pairs a slice of records at a time."""
    rec, host, k = (np.asarray(a, np.int64) for a in (rec, host, k))
    unique = np.bincount(host, minlength=hosts).astype(np.int64)
    others = np.bincount(host[k > 1], minlength=hosts).astype(np.int64)
    overlap = np.diag(unique)
    few = (k > 1) & (k <= PAIRS_UP_TO)
    if few.any():
        # Each record's pairs of hosts, by distance within its run of pairs: position i with
        # i + d for d = 1, 2, ... while both are the same record; each unordered pair once, in
        # whatever order its hosts come, so the matrix adds its transpose. No k^2 index arrays:
        # those were most of a 128-host bucket's time (0.30 of 0.50 s at 1.6M pairs).
        r, h = rec[few], host[few]
        pairs = np.zeros(hosts * hosts, np.int64)
        i, d = np.flatnonzero(r[1:] == r[:-1]), 1
        while i.size:
            pairs += np.bincount(h[i] * hosts + h[i + d], minlength=hosts * hosts)
            d += 1
            i = i[i + d < len(r)]
            i = i[r[i + d] == r[i]]
        upper = pairs.reshape(hosts, hosts)
        overlap += upper + upper.T
    many = k > PAIRS_UP_TO
    if many.any():  # records on many hosts: one product over them, in bounded chunks
        r, h = rec[many], host[many]
        row = np.cumsum(np.r_[True, r[1:] != r[:-1]]) - 1  # pairs are grouped by record
        step = max(1, 2**26 // (hosts * 4))  # records a chunk: 64 MB of float32
        for lo in range(0, int(row[-1]) + 1, step):
            a, b = np.searchsorted(row, [lo, lo + step])
            m = np.zeros((min(step, int(row[-1]) + 1 - lo), hosts), np.float32)
            m[row[a:b] - lo, h[a:b]] = 1.0
            # float32 sums of 0/1 are exact below 2^24 records a chunk (it holds fewer)
            prod = np.rint(m.T @ m).astype(np.int64)
            np.fill_diagonal(prod, 0)
            overlap += prod
    return unique, others, overlap


def json_default(o: Any) -> Any:
    """numpy scalars as JSON numbers (json.dumps' `default` for the report files)."""
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    raise TypeError(type(o).__name__)
