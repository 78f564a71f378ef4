"""Exposure semantics, in one place: which rows count, what an exposure is, what "right" means,
and the shapes of the answers built from them (docs/DESIGN.md, "Exposure semantics").

Each rule is written here once, as the SQL fragment the ledger's queries use and the numpy form
the ingester and the reconcile job use, side by side so that a reader sees they agree. The
test oracle (bench/reference/reconcile_sql.py) restates them independently, on purpose.

- Which rows count: attempt `a` resumed from step `s` rolls back every row of earlier attempts
  at steps >= s (`rolled_back_from`). Rolled-back rows stay in the ledger (they prove whether
  the replay was exact) but leave effective exposure.
- An exposure is one consumption of a record's start (offset 0) among the effective rows; a
  record cut across rows counts once, where it starts.
- The ideal after C exposures of N train records: every record seen floor(C/N) or ceil(C/N)
  times, coverage min(1, C/N). Excess and missing exposures measure the distance from it; the
  first bad step is the first step at which some record's exposure rank exceeds
  ceil(C_s / N), C_s the exposures up to and including that step.
- A mixture that weights its domains (some read in more passes than others) is measured
  against each domain's own ideal, floor or ceil of C_d / N_d, when those account for nearly
  all of its distance from the split's (`weighted_domains`).
  Its within-epoch duplicates are then those beyond what each domain's share of the epoch
  forces (`domain_epoch_duplicates`); where each epoch read each domain evenly, a distance
  over the whole run is the loader restarting a domain's partial pass each epoch
  (`domain_epoch_distance`).
- Within one epoch a record is due at most once: exposures beyond the first of a record in the
  same (known) epoch are within-epoch duplicates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# ---- which rows count ------------------------------------------------------------------------


def rolled_back_from(resumed: dict[int, int | None]) -> dict[int, int | None]:
    """The restart-lineage rule, for every attempt of one run.

    `resumed` maps attempt -> resumed_from_step (None for a fresh start). Attempt a's rows at
    or after the smallest resumed_from_step of any later attempt are rolled back; the result
    maps attempt -> that step (None: nothing rolled back).
    """
    out: dict[int, int | None] = {}
    later: int | None = None
    for a in sorted(resumed, reverse=True):
        out[a] = later
        s = resumed[a]
        if s is not None:
            later = s if later is None else min(later, s)
    return out


def effective_sql(rows: str = "c", attempts: str = "a") -> str:
    """SQL: the row (alias `rows`, with a `step`) survives its attempt's rollback (alias
    `attempts`, a row of the ledger's `attempts` table joined on run and attempt)."""
    return (f"({attempts}.rolled_back_from_step IS NULL "
            f"OR {rows}.step < {attempts}.rolled_back_from_step)")


def rolled_back_sql(rows: str = "c", attempts: str = "a") -> str:
    """SQL: the complement of `effective_sql`."""
    return f"({rows}.step >= {attempts}.rolled_back_from_step)"


def effective(steps: np.ndarray, attempts: np.ndarray,
              cutoffs: dict[int, int | None]) -> np.ndarray:
    """numpy: the rows (`steps`, `attempts`) that survive `cutoffs` (attempt ->
    rolled_back_from_step, from `rolled_back_from`). Attempts not in `cutoffs` are kept."""
    never = np.iinfo(np.int64).max
    lut = np.full(max(cutoffs, default=0) + 1, never, np.int64)
    for a, cut in cutoffs.items():
        if cut is not None:
            lut[a] = cut
    known = attempts < len(lut)
    return ~known | (steps < lut[np.where(known, attempts, 0)])


def effective_before(steps: np.ndarray, cut: int | None) -> np.ndarray | slice:
    """numpy, one attempt: the rows kept under its cutoff `cut` (all when None)."""
    return slice(None) if cut is None else steps < cut


# ---- what an exposure is ---------------------------------------------------------------------

def start_sql(rows: str = "") -> str:
    """SQL: the segment starts its record (an exposure)."""
    return f'{rows + "." if rows else ""}"offset" = 0'


def starts(offset: np.ndarray) -> np.ndarray:
    """numpy: the segments that start their record (exposures)."""
    return np.asarray(offset) == 0


def hash_checks(is_start: np.ndarray, n_tokens: np.ndarray, content_hash: np.ndarray,
                want_tokens: np.ndarray, want_hash: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy, per consumed row against its manifest record's length and hash: (checked,
    mismatch). A row is checked when it starts its record and holds the whole record (a
    segment cut from a longer record cannot be hashed against the record's hash); a checked
    row whose hash differs is a mismatch. Reconcile's join and ingest's integrity both count
    these."""
    checked = is_start & (n_tokens == want_tokens)
    return checked, checked & (content_hash != want_hash)


# ---- the ideal and the distance from it ------------------------------------------------------

HIST_BINS = ("0", "1", "2", "3+")


def histogram(counts: np.ndarray) -> np.ndarray:
    """Records seen 0, 1, 2 and 3+ times, from counts[e] = number of records seen e times."""
    c = np.zeros(max(4, len(counts)), dtype=np.int64)
    c[: len(counts)] = counts
    return np.array([c[0], c[1], c[2], c[3:].sum()], dtype=np.int64)


def ideal_bounds(total: int, n: int) -> tuple[int, int]:
    """floor(C/N), ceil(C/N): how often every record should have been seen."""
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


def first_bad_step(max_rank_by_step: np.ndarray, exposures_by_step: np.ndarray,
                   n: int) -> int | None:
    """The first step at which a record's exposure rank (its 1st, 2nd, ... exposure) exceeds
    ceil(C_s / N), what a perfect loader allows after C_s exposures; None if there is none.
    Both series are indexed by step from 0."""
    cum = np.cumsum(np.asarray(exposures_by_step, np.int64))
    allowed = -(-cum // n) if n else cum
    rank = np.zeros(len(cum), np.int64)
    k = min(len(rank), len(max_rank_by_step))
    rank[:k] = np.asarray(max_rank_by_step)[:k]
    bad = np.flatnonzero(rank > allowed)
    return int(bad[0]) if bad.size else None


# A mixture that weights its domains reads some in more passes than others: each record is
# then due floor or ceil of its own domain's passes, C_d / N_d. The run is measured against
# those when they account for nearly all of its distance from the split's ideal (at most a
# tenth is left). Not on a rate difference alone: a loader drawing with replacement over one
# epoch's worth has domains on both sides of one pass by chance, and their own ideals take
# about half of its distance away (the split's ideal is a single level there).
WEIGHTED = 0.1
# ... and when the domains' passes differ by a tenth or more: a sampler's padding adds at most
# a global batch an epoch, which lands in some domains and reads as a weight just as well (the
# few records it repeats are "forced" in those domains), but moves their passes far less.
WEIGHT_RATIO = 1.1


def domain_distance(levels: dict[str, np.ndarray]) -> dict[str, tuple[int, int]]:
    """Each domain's (excess, missing) exposures against its own ideal, floor or ceil of
    C_d / N_d, from levels[d][e] = the domain's train records seen e times."""
    out = {}
    for d, counts in levels.items():
        counts = np.asarray(counts, np.int64)
        total = int((np.arange(len(counts)) * counts).sum())
        out[d] = excess(counts, total, int(counts.sum()))
    return out


def weighted_domains(split: tuple[int, ...], own: tuple[int, ...],
                     levels: dict[str, np.ndarray]) -> bool:
    """Whether the run weights its domains: it is off the split's ideal (`split`: excess,
    missing and within-epoch duplicates), it read every domain (`levels`, as for
    `domain_distance`: a domain left out is a fault, not a weight of zero), and measured by
    each domain's own (`own`: the same three, from `domain_distance` and
    `domain_epoch_duplicates`) all but a tenth of that is gone (`WEIGHTED`), and the
    domains' passes differ by a tenth or more (`WEIGHT_RATIO`)."""
    passes = [int((np.arange(len(c)) * c).sum()) / int(c.sum()) for c in map(np.asarray,
                                                                             levels.values())]
    off = sum(split)
    return (len(levels) > 1 and min(passes) > 0 and max(passes) >= WEIGHT_RATIO * min(passes)
            and off > 0 and sum(own) <= WEIGHTED * off)


def domain_epoch_duplicates(records: dict[str, int], levels: dict[str, np.ndarray]) -> int:
    """Within-epoch duplicates that a mixture's weights do not explain. A domain of N_d train
    records given C_de exposures in epoch e (a loader that restarts a small domain within
    the epoch, e.g. interleaving until every source is exhausted) must repeat C_de - N_d of
    them when C_de > N_d; the rest, min(N_d, C_de) - (its distinct records in the epoch),
    are repeats it did not need. `records`: N_d; `levels`: per domain, [epoch, e] = its
    records seen e times in the epoch (e >= 1)."""
    out = 0
    for d, h in levels.items():
        h = np.asarray(h, np.int64)
        exposed = h @ np.arange(h.shape[1])
        out += int((np.minimum(records[d], exposed) - h[:, 1:].sum(axis=1)).sum())
    return out


def domain_epoch_repeats(levels: dict[str, np.ndarray]) -> dict[str, int]:
    """Each domain's exposures that repeat a record within its epoch, all of them (`levels` as
    for `domain_epoch_duplicates`): what no sharding makes of every domain alike, where a
    mixture's weights force repeats only in the domains it reads more than once an epoch."""
    out = {}
    for d, h in levels.items():
        h = np.asarray(h, np.int64)
        out[d] = int((h @ np.arange(h.shape[1])).sum() - h[:, 1:].sum())
    return out


def domain_epoch_distance(records: dict[str, int], levels: dict[str, np.ndarray]
                          ) -> tuple[int, int]:
    """(excess, missing) exposures of every domain in every epoch against that epoch's own
    ideal for it: floor or ceil of C_de / N_d (`records`, `levels` as for
    `domain_epoch_duplicates`). Zero where each epoch read each domain evenly, even when
    the run as a whole did not: a loader that restarts a domain's partial pass every epoch
    gives the extra read to other records each time."""
    out = np.zeros(2, np.int64)
    for d, h in levels.items():
        for row in np.asarray(h, np.int64):
            if row.any():
                counts = row.copy()
                counts[0] = records[d] - row[1:].sum()  # not seen in the epoch
                out += excess(counts, int(row @ np.arange(len(row))), records[d])
    return int(out[0]), int(out[1])


def independent_hosts(total: int, n: int, hosts: int) -> dict[str, float]:
    """Expected never-seen and seen-2+ fractions when each host draws C/H records on its own
    (sampling with replacement: per-host shuffle seeds, a second per-host slice). With many
    hosts this tends to 1/e never seen and 1 - 2/e seen 2+ after one epoch's worth."""
    if not n or not hosts:
        return {"never_seen": 0.0, "seen_2plus": 0.0}
    p = min(1.0, total / hosts / n)  # chance one host's draw includes a given record
    p0 = (1 - p) ** hosts
    p1 = hosts * p * (1 - p) ** (hosts - 1)
    return {"never_seen": p0, "seen_2plus": max(0.0, 1 - p0 - p1)}


# ---- the coverage answer ---------------------------------------------------------------------

@dataclass(frozen=True)
class Coverage:
    """Coverage of N train records after some exposures: the one shape the report and the API
    both serve (each adds its own context around it)."""

    train_records: int | None  # N; None when the universe is unknown
    exposures: int  # C, effective exposures of train records
    seen: int  # records seen at least once
    seen_twice: int  # ... at least twice
    seen_thrice: int  # ... three times or more
    excess_exposures: int | None = None  # beyond ceil(C/N); None when not computed
    missing_exposures: int | None = None  # below floor(C/N)

    @classmethod
    def from_levels(cls, n: int, exposures: int, counts: np.ndarray) -> Coverage:
        """From counts[e] = records seen e times (counts[0] = never seen)."""
        hist = histogram(counts)
        ex, miss = excess(counts, exposures, n)
        return cls(n, exposures, int(hist[1:].sum()), int(hist[2:].sum()), int(hist[3]), ex,
                   miss)

    @property
    def histogram(self) -> list[int | None]:
        """Records seen 0, 1, 2, 3+ times (the 0 bin is None when N is unknown)."""
        n = self.train_records
        return [None if n is None else n - self.seen, self.seen - self.seen_twice,
                self.seen_twice - self.seen_thrice, self.seen_thrice]

    def to_dict(self) -> dict[str, Any]:
        n = self.train_records
        hist = self.histogram
        out: dict[str, Any] = {
            "train_records": n, "exposures": self.exposures, "seen": self.seen,
            "coverage": None if n is None else self.seen / n if n else 0.0,
            "never_seen": hist[0],
            "histogram": dict(zip(HIST_BINS, hist, strict=True)),
        }
        if n is not None:
            lo, hi = ideal_bounds(self.exposures, n)
            out["never_seen_fraction"] = hist[0] / n if n else 0.0
            out["histogram_fraction"] = {b: (v / n if n else 0.0)
                                         for b, v in zip(HIST_BINS, hist, strict=True)}
            ideal = float(ideal_coverage(self.exposures, n))
            out["ideal"] = {"min": lo, "max": hi, "coverage": ideal,
                            "never_seen": max(0, n - self.exposures)}
            out["behind_ideal"] = ideal - out["coverage"]
        if self.excess_exposures is not None:
            out["excess_exposures"] = self.excess_exposures
            out["missing_exposures"] = self.missing_exposures
        return out


# ---- findings --------------------------------------------------------------------------------

SEVERITIES = ("FAIL", "WARN", "INFO", "UNKNOWN")


@dataclass(frozen=True)
class Finding:
    """One thing a check found: how bad, a stable code, a sentence naming the likely cause, and
    the numbers behind it."""

    severity: str  # FAIL | WARN | INFO | UNKNOWN (cannot tell)
    code: str
    message: str
    numbers: dict[str, Any] = field(default_factory=dict)
    # What it points at, when the check can name it: {"steps": [...], "hosts": [...],
    # "records": [...]}, a few of each, each item with the API path that shows it
    # (tally.audit.reconcile.evidence). None: nothing to point at.
    evidence: dict[str, list[dict[str, Any]]] | None = None

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"finding severity {self.severity!r} is not one of {SEVERITIES}")

    def to_dict(self) -> dict[str, Any]:
        out = {"severity": self.severity, "code": self.code, "message": self.message,
               "numbers": self.numbers}
        if self.evidence is not None:
            out["evidence"] = self.evidence
        return out


class Findings(list):
    """Findings in the order they were found."""

    def add(self, severity: str, code: str, message: str, *,
            evidence: dict[str, list[dict[str, Any]]] | None = None, **numbers: Any) -> Finding:
        f = Finding(severity, code, message, numbers, evidence)
        self.append(f)
        return f

    def severities(self) -> set[str]:
        return {f.severity for f in self}

    def to_list(self) -> list[dict[str, Any]]:
        return [f.to_dict() for f in self]


def verdict(findings: list[Finding] | list[dict[str, Any]]) -> str:
    """PASS, WARN or FAIL: the worst severity found (INFO does not count)."""
    sev = {f.severity if isinstance(f, Finding) else f["severity"] for f in findings}
    return "FAIL" if "FAIL" in sev else "WARN" if "WARN" in sev else "PASS"
