"""Exposure maths, in one place: what "right" means and what known faults look like.

With C exposures of a train split of N records, the ideal is every record seen floor(C/N) or
ceil(C/N) times. Sampling with replacement (per-host shuffle seeds, a second slice) gives a
Poisson-like spread instead: with H hosts each drawing m = C/H distinct records independently,
a record is missed by every host with probability (1 - m/N)^H, -> e^(-C/N) for many hosts.
"""

from __future__ import annotations

import numpy as np

HIST_BINS = ("0", "1", "2", "3+")


def histogram(counts: np.ndarray) -> np.ndarray:
    """Records seen 0, 1, 2 and 3+ times, from counts[e] = number of records seen e times."""
    c = np.zeros(max(4, len(counts)), dtype=np.int64)
    c[: len(counts)] = counts
    return np.array([c[0], c[1], c[2], c[3:].sum()], dtype=np.int64)


def ideal_bounds(total: int, n: int) -> tuple[int, int]:
    """floor(C/N), ceil(C/N): what every record should have been seen."""
    return (total // n, -(-total // n)) if n else (0, 0)


def ideal_coverage(cum_exposures: np.ndarray | int, n: int) -> np.ndarray | float:
    """Coverage a perfect loader reaches after `cum_exposures` exposures."""
    return np.minimum(1.0, np.asarray(cum_exposures, dtype=np.float64) / n) if n else 0.0


def excess(counts: np.ndarray, total: int, n: int) -> tuple[int, int]:
    """(exposures beyond ceil(C/N), exposures missing below floor(C/N)), over all records,
    from counts[e] = number of records seen e times."""
    lo, hi = ideal_bounds(total, n)
    levels = np.arange(len(counts))
    counts = np.asarray(counts, dtype=np.int64)
    return (int((np.maximum(0, levels - hi) * counts).sum()),
            int((np.maximum(0, lo - levels) * counts).sum()))


def independent_hosts(total: int, n: int, hosts: int) -> dict[str, float]:
    """Expected never-seen and seen-2+ fractions when each host draws C/H records on its own."""
    if not n or not hosts:
        return {"never_seen": 0.0, "seen_2plus": 0.0}
    p = min(1.0, total / hosts / n)  # chance one host's draw includes a given record
    p0 = (1 - p) ** hosts
    p1 = hosts * p * (1 - p) ** (hosts - 1)
    return {"never_seen": p0, "seen_2plus": max(0.0, 1 - p0 - p1)}
