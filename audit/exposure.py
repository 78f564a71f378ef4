"""Exposure maths, in one place: what "right" means and what known faults look like.

With C exposures of a train split of N records, the ideal is every record seen floor(C/N) or
ceil(C/N) times. Sampling with replacement (per-host shuffle seeds, a second slice) gives a
Poisson-like spread instead: with H hosts each drawing m = C/H distinct records independently,
a record is missed by every host with probability (1 - m/N)^H, -> e^(-C/N) for many hosts.
"""

from __future__ import annotations

import math

import numpy as np

HIST_BINS = ("0", "1", "2", "3+")


def histogram(exposures: np.ndarray) -> np.ndarray:
    """Counts of records seen 0, 1, 2 and 3+ times."""
    e = np.asarray(exposures)
    return np.array([(e == 0).sum(), (e == 1).sum(), (e == 2).sum(), (e >= 3).sum()],
                    dtype=np.int64)


def ideal_bounds(total: int, n: int) -> tuple[int, int]:
    """floor(C/N), ceil(C/N): what every record should have been seen."""
    return (total // n, -(-total // n)) if n else (0, 0)


def ideal_coverage(cum_exposures: np.ndarray | int, n: int) -> np.ndarray | float:
    """Coverage a perfect loader reaches after `cum_exposures` exposures."""
    return np.minimum(1.0, np.asarray(cum_exposures, dtype=np.float64) / n) if n else 0.0


def excess(exposures: np.ndarray, total: int, n: int) -> tuple[int, int]:
    """(exposures beyond ceil(C/N), exposures missing below floor(C/N)), summed over records."""
    lo, hi = ideal_bounds(total, n)
    e = np.asarray(exposures, dtype=np.int64)
    return int(np.maximum(0, e - hi).sum()), int(np.maximum(0, lo - e).sum())


def independent_hosts(total: int, n: int, hosts: int) -> dict[str, float]:
    """Expected never-seen and seen-2+ fractions when each host draws C/H records on its own."""
    if not n or not hosts:
        return {"never_seen": 0.0, "seen_2plus": 0.0}
    p = min(1.0, total / hosts / n)  # chance one host's draw includes a given record
    p0 = (1 - p) ** hosts
    p1 = hosts * p * (1 - p) ** (hosts - 1)
    return {"never_seen": p0, "seen_2plus": max(0.0, 1 - p0 - p1)}


def poisson(total: int, n: int) -> dict[str, float]:
    """Sampling with replacement: never seen e^-l, seen 2+ 1 - e^-l (1 + l), l = C/N."""
    lam = total / n if n else 0.0
    return {"never_seen": math.exp(-lam), "seen_2plus": 1 - math.exp(-lam) * (1 + lam)}
