"""What each host consumed, step by step: the evidence for causes that live on one host or in
one stretch of steps.

- A host whose input pipeline stalled and handed the same batch again: consecutive steps of that
  host with the same multiset of record starts (and epochs). Each batch is reduced to an
  order-independent signature (a sum of mixed keys, and a count), so files are compared step by
  step without keeping their rows, and the steps where two files meet are compared by their edge
  signatures.
- A host that consumed nothing for a stretch of steps while the others did: its covered step
  ranges against theirs.
- Where each epoch starts and ends in steps, so that an epoch the run has left behind can be
  counted as complete.

Every function works on one input file's effective rows (numpy only) or on what the files sent,
merged; nothing is per row in Python.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import numpy as np

from tally.audit.core.exposure import starts

EXAMPLE_HOSTS = 10  # silent hosts named per attempt; the rest are counted

_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9),
        np.uint64(0x94D049BB133111EB))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64: a well-spread 64-bit value per key (sums of them make the signature)."""
    z = x.astype(np.uint64) + _MIX[0]
    z = (z ^ (z >> np.uint64(30))) * _MIX[1]
    z = (z ^ (z >> np.uint64(27))) * _MIX[2]
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True, slots=True)
class Edge:
    """A file's first and last step of one host, with their batch signatures; or, once files
    that meet are fused (`fused_edges`), those of a stretch of files."""

    host: int
    first: int
    first_sig: tuple[int, int]  # (signature, record starts)
    last: int
    last_sig: tuple[int, int]
    # Inside a fused stretch, where two files met with the same batch signature: (step,
    # record starts) of the later one's first step.
    joins: tuple[tuple[int, int], ...] = ()


def _edge_key(e: Edge) -> tuple[int, int]:
    return e.host, e.first


def fused_edges(a: list[Edge], b: list[Edge]) -> list[Edge]:
    """Both lists' edges, the edges of one host that meet (one's first step right after the
    other's last) made one, with where they met when the batches there have the same
    signature: what `repeated_batches` reads of them. Kept as they came, a reconcile's edges
    were one a file (the seed run's ~1.8M segment files: ~0.5 KB each in the driver, and in the
    live reconcile's checkpoint); fused, about one a host. A host's effective steps are
    disjoint from file to file, so edges that meet are neighbours in step order, fused or not.
    Each list is in (host, first step) order with no two neighbours meeting, as `per_file`
    and this give them."""
    if not a or not b:
        return list(a or b)
    if len(a) < len(b):
        a, b = b, a
    if len(b) == 1:  # one file's edge into what a block or a job holds: only its neighbours
        # can meet it (edges that do not meet, as a host's files with gaps between them, or a
        # ledger export's, would make sorting them all at every file quadratic)
        i = bisect.bisect_right(a, _edge_key(b[0]), key=_edge_key)
        lo = max(i - 1, 0)
        return a[:lo] + _fuse_edges(a[lo:i + 1] + b) + a[i + 1:]
    if _edge_key(b[0]) >= _edge_key(a[-1]):  # b after a (a job's chunks, host by host):
        return a[:-1] + _fuse_edges([a[-1], b[0]]) + b[1:]  # they can meet only there
    return _fuse_edges(a + b)


def _fuse_edges(edges: list[Edge]) -> list[Edge]:
    out: list[Edge] = []
    for e in sorted(edges, key=_edge_key):
        p = out[-1] if out else None
        if p is None or e.host != p.host or e.first != p.last + 1:
            out.append(e)
            continue
        met = ((e.first, e.first_sig[1]),) if e.first_sig == p.last_sig else ()
        out[-1] = Edge(p.host, p.first, p.first_sig, e.last, e.last_sig,
                       p.joins + met + e.joins)
    return out


def fused_ranges(a: list[tuple[int, int, int, int]], b: list[tuple[int, int, int, int]]
                 ) -> list[tuple[int, int, int, int]]:
    """Both lists' (attempt, host, first, last step) ranges, those of one attempt and host
    that overlap or meet made one: the steps each host covered, which is all `gaps` reads
    (one range a file kept as they came: see `fused_edges`). Each list is sorted, no two
    neighbours overlapping or meeting."""
    if not a or not b:
        return list(a or b)
    if len(a) < len(b):
        a, b = b, a
    if len(b) == 1:  # one file's range: only the ranges it reaches (see `fused_edges`)
        r = b[0]
        lo = max(bisect.bisect_right(a, r) - 1, 0)
        hi = lo
        while hi < len(a) and (a[hi] <= r or (a[hi][:2] == r[:2] and a[hi][2] <= r[3] + 1)):
            hi += 1
        return a[:lo] + _fuse_ranges(a[lo:hi] + b) + a[hi:]
    if b[0][:2] > a[-1][:2] or (b[0][:2] == a[-1][:2] and b[0][2] > a[-1][3] + 1):
        return a + b  # b wholly after a, apart (a job's chunks, host by host)
    return _fuse_ranges(a + b)


def _fuse_ranges(ranges: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    out: list[tuple[int, int, int, int]] = []
    for r in sorted(ranges):
        p = out[-1] if out else None
        if p is not None and r[:2] == p[:2] and r[2] <= p[3] + 1:
            out[-1] = (p[0], p[1], p[2], max(p[3], r[3]))
        else:
            out.append(r)
    return out


def _runs(values: np.ndarray) -> list[tuple[int, int]]:
    """Sorted unique integers as (first, last) runs of consecutive values."""
    if not len(values):
        return []
    breaks = np.flatnonzero(np.diff(values) != 1)
    firsts = np.r_[values[0], values[breaks + 1]]
    lasts = np.r_[values[breaks], values[-1]]
    return list(zip(firsts.tolist(), lasts.tolist(), strict=True))


def _lexsort(keys: tuple[np.ndarray, ...]) -> np.ndarray | None:
    """np.lexsort(keys), or None when the rows are in that order already: a spool file holds
    one attempt of one host, its steps ascending (two lexsorts were a third of this module's
    time a file)."""
    *minor, major = keys
    if all(len(k) == 0 or (k == k[0]).all() for k in (major, *minor[1:])) and \
            (len(minor[0]) < 2 or bool((minor[0][1:] >= minor[0][:-1]).all())):
        return None
    return np.lexsort(keys)


def per_file(cols: dict[str, np.ndarray], train_records: int) -> dict:
    """One file's effective rows -> repeated-batch step ranges, edges, covered step ranges and
    epoch step spans (the Partial fields of the same names)."""
    step = cols["step"].astype(np.int64, copy=False)
    host = cols["host"].astype(np.int64, copy=False)
    attempt = cols["attempt"].astype(np.int64, copy=False)
    out: dict = {"repeated_step_ranges": [], "host_step_edges": [], "host_step_ranges": [],
                 "epoch_steps": {}}
    # Steps each host consumed at all (any segment), per attempt.
    # (A lexsort: np.unique(..., axis=0) sorts the rows as opaque bytes, 6 ms for a file of
    # 6,500 rows against 0.06 ms; it was 40% of a reconcile of 128 hosts' files.)
    order = _lexsort((step, host, attempt))
    a_, h_, s_ = (attempt, host, step) if order is None else \
        (attempt[order], host[order], step[order])
    pair = np.ones(len(s_), bool)  # the first row of each (attempt, host)
    pair[1:] = (a_[1:] != a_[:-1]) | (h_[1:] != h_[:-1])
    distinct = pair.copy()
    distinct[1:] |= s_[1:] != s_[:-1]
    a_, h_, s_, pair = a_[distinct], h_[distinct], s_[distinct], pair[distinct]
    bounds = np.r_[np.flatnonzero(pair), len(s_)]
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        out["host_step_ranges"] += [(int(a_[lo]), int(h_[lo]), x, y)
                                    for x, y in _runs(s_[lo:hi])]
    # Where each known epoch lies in steps.
    epoch = cols["epoch"].astype(np.int64, copy=False)
    known = epoch >= 0
    if known.any():
        ep, st_ = epoch[known], step[known]
        if len(ep) < 2 or bool((ep[1:] >= ep[:-1]).all()):
            # Epochs in order (a spool file: its steps ascend and each epoch follows the one
            # before): each epoch is one run of rows, reduced in place. np.unique's sort and
            # the two ufunc.at were half of this function's time (2.2 of 4.3 ms a 100k-row file).
            heads = np.flatnonzero(np.r_[True, ep[1:] != ep[:-1]])
            e = ep[heads]
            lo, hi = np.minimum.reduceat(st_, heads), np.maximum.reduceat(st_, heads)
        else:
            e, inv = np.unique(ep, return_inverse=True)
            lo = np.full(len(e), np.iinfo(np.int64).max)
            hi = np.full(len(e), np.iinfo(np.int64).min)
            np.minimum.at(lo, inv, st_)
            np.maximum.at(hi, inv, st_)
        out["epoch_steps"] = {int(x): (int(a), int(b)) for x, a, b in zip(e, lo, hi,
                                                                         strict=True)}
    # Each host-step's batch as (signature, record starts).
    st = starts(cols["offset"])
    if not st.any():
        return out
    h, s = host[st], step[st]
    sig = _mix(cols["record_key"][st].astype(np.uint64) * np.uint64(2**21)
               + (epoch[st] + 1).astype(np.uint64))
    order = _lexsort((s, h))
    if order is not None:
        h, s, sig = h[order], s[order], sig[order]
    heads = np.flatnonzero(np.r_[True, (h[1:] != h[:-1]) | (s[1:] != s[:-1])])
    gh, gs = h[heads], s[heads]
    gsig = np.add.reduceat(sig, heads)
    gcount = np.diff(np.r_[heads, len(s)])
    same = ((gh[1:] == gh[:-1]) & (gs[1:] == gs[:-1] + 1) & (gsig[1:] == gsig[:-1])
            & (gcount[1:] == gcount[:-1]) & (gcount[1:] < max(train_records, 1)))
    for hh in np.unique(gh[1:][same]):
        at = np.sort(gs[1:][same & (gh[1:] == hh)])
        out["repeated_step_ranges"] += [(int(hh), a, b) for a, b in _runs(at)]
    for hh in np.unique(gh):
        idx = np.flatnonzero(gh == hh)
        a, b = idx[0], idx[-1]
        out["host_step_edges"].append(Edge(int(hh), int(gs[a]), (int(gsig[a]), int(gcount[a])),
                                           int(gs[b]), (int(gsig[b]), int(gcount[b]))))
    return out


def repeated_batches(ranges: list[tuple[int, int, int]], edges: list[Edge],
                     train_records: int) -> list[dict]:
    """Per host, the stretches of steps whose batch repeats the step before it: the ranges the
    files found inside themselves, joined with those where two files meet."""
    found = list(ranges)
    by_host: dict[int, list[Edge]] = {}
    for e in edges:
        by_host.setdefault(e.host, []).append(e)
    for host, es in by_host.items():
        es.sort(key=lambda e: e.first)
        found += [(host, step, step) for e in es for step, count in e.joins
                  if 0 < count < max(train_records, 1)]
        for a, b in zip(es, es[1:], strict=False):
            if b.first == a.last + 1 and b.first_sig == a.last_sig and \
                    0 < b.first_sig[1] < max(train_records, 1):
                found.append((host, b.first, b.first))
    out = []
    for host in sorted({h for h, _, _ in found}):
        steps = np.unique(np.concatenate([np.arange(a, b + 1) for h, a, b in found
                                          if h == host]))
        out += [{"host": host, "first_step": a, "last_step": b, "steps": b - a + 1}
                for a, b in _runs(steps)]
    return out


def gaps(ranges: list[tuple[int, int, int, int]], host_counts: dict[int, int],
         ended: dict[int, bool]) -> tuple[list[dict], list[dict]]:
    """Stretches of steps of an attempt in which one of its hosts consumed nothing while the
    others did. Within each attempt's span (its first to its last effective step), every host
    of the attempt should hold every step. The tail of a span counts only for an attempt that
    has ended (`ended[a]`: a later attempt replaced it, or the run finished): in a run still
    going, hosts publish at their own pace and one lagging behind is no gap.

    Returns (gaps of the hosts that consumed something, one entry per attempt for its hosts that
    consumed nothing at all). The silent hosts are counted, not listed: an attempt declaring
    65,536 hosts of which one wrote made 65,535 findings (a 100 MB report) when each was a gap."""
    out, silent = [], []
    for a in sorted({r[0] for r in ranges}):
        by_host: dict[int, list[tuple[int, int]]] = {}
        for _, h, x, y in (r for r in ranges if r[0] == a):
            by_host.setdefault(h, []).append((x, y))
        first = min(x for v in by_host.values() for x, _ in v)
        last = max(y for v in by_host.values() for _, y in v)
        for host in sorted(by_host):
            cursor, holes = first, []
            for x, y in sorted(by_host[host]):
                if x > cursor:
                    holes.append((cursor, x - 1))
                cursor = max(cursor, y + 1)
            if cursor <= last and ended.get(a):
                holes.append((cursor, last))
            out += [{"attempt": a, "host": host, "first_step": x, "last_step": y,
                     "steps": y - x + 1} for x, y in holes]
        n = host_counts.get(a, 0)
        quiet = n - sum(1 for h in by_host if h < n)
        if quiet > 0 and ended.get(a):
            examples = list(itertools.islice((h for h in range(n) if h not in by_host),
                                             EXAMPLE_HOSTS))
            silent.append({"attempt": a, "hosts": quiet, "examples": examples,
                           "first_step": first, "last_step": last, "steps": last - first + 1})
    return out, silent
