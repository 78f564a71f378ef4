"""Per-record live state: what the ingesting process keeps in memory for every record key of a
run, so that each batch of files updates the aggregates by what it touches (audit.ledger.
aggregates).

One 48-byte row per record key: exposures (effective record starts), those whose epoch is
known, the three earliest exposure steps, the set of hosts and the set of epochs. Keeping it as
a DuckDB table was measured at ~0.1 s per 100k-row file for the join alone (10M records) and
1.6 s with an indexed upsert; one packed numpy row per record costs one cache miss to read and
one to write.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from audit.core.exposure import effective_before, starts

HOST_BITS = 64  # host sets are uint64 masks: overlap is tracked for hosts 0..63
EPOCH_BITS = 64  # epoch sets are masks of epoch % 64: exact for runs of fewer than 64 epochs
NO_STEP = np.iinfo(np.int64).max  # steps are int64 end to end (audit.core.schema.MAX_STEP)

# One record's state. Fields are aligned so that column views are plain strided arrays; the
# whole row moves as one 48-byte item (np.take / np.put on a void view), which is what keeps
# the random-key gathers and scatters of a batch cheap.
STATE = np.dtype([("exposures", "<i4"),  # effective record starts
                  ("epoch_exposures", "<i4"),  # exposures whose epoch is known
                  ("steps", "<i8", (3,)),  # the three earliest exposure steps, NO_STEP if fewer
                  ("hosts", "<u8"),  # mask of hosts < HOST_BITS
                  ("epochs", "<u8")])  # mask of epoch % EPOCH_BITS, known epochs only
_ROW = np.dtype((np.void, STATE.itemsize))  # a whole row as one item

# Codes used while sorting a batch's starts: host code 64 = not tracked, epoch code 0 = unknown.
_HOST_BIT = np.array([1 << i for i in range(HOST_BITS)] + [0] * 64, np.uint64)
_EPOCH_BIT = np.array([0] + [1 << i for i in range(EPOCH_BITS)] + [0] * 63, np.uint64)


@dataclass
class Records:
    """Per-record state for a sorted set of record keys, one array per field (the arithmetic
    of a batch runs over contiguous columns; RunState stores rows)."""

    keys: np.ndarray  # int64, sorted, unique
    exposures: np.ndarray  # int32
    steps: np.ndarray  # int64 [n, 3]: the three earliest exposure steps, NO_STEP when fewer
    hosts: np.ndarray  # uint64 mask of hosts < HOST_BITS
    epochs: np.ndarray  # uint64 mask of epoch % EPOCH_BITS, known epochs only
    epoch_exposures: np.ndarray  # int32: exposures whose epoch is known

    @classmethod
    def empty(cls, keys: np.ndarray) -> Records:
        n = len(keys)
        return cls(np.asarray(keys, np.int64), np.zeros(n, np.int32),
                   np.full((n, 3), NO_STEP, np.int64), np.zeros(n, np.uint64),
                   np.zeros(n, np.uint64), np.zeros(n, np.int32))

    @classmethod
    def from_rows(cls, keys: np.ndarray, rows: np.ndarray) -> Records:
        r = cls(keys, *(rows[f].copy() for f in ("exposures", "steps", "hosts", "epochs",
                                                  "epoch_exposures")))
        r.steps[r.exposures == 0] = NO_STEP  # zeroed memory: never seen
        return r

    def rows(self) -> np.ndarray:
        rows = np.empty(len(self.keys), STATE)
        for f in ("exposures", "epoch_exposures", "steps", "hosts", "epochs"):
            rows[f] = getattr(self, f)
        return rows

    def take(self, idx: np.ndarray) -> Records:
        return Records(self.keys[idx], self.exposures[idx], self.steps[idx], self.hosts[idx],
                       self.epochs[idx], self.epoch_exposures[idx])

    def set(self, pos: np.ndarray, other: Records) -> None:
        """Rows at `pos` take `other`'s values."""
        for f in ("exposures", "steps", "hosts", "epochs", "epoch_exposures"):
            getattr(self, f)[pos] = getattr(other, f)

    def merged(self, inc: Records) -> Records:
        """This state plus `inc`'s exposures of the same keys."""
        a, b = self.steps, inc.steps
        # The three smallest of two sorted triples: r_k = min over i + j = k of max(a_i, b_j).
        # It leaves a row alone when no incoming step enters its three, so it runs on all rows
        # when most change, and on those that can change otherwise.
        todo = np.flatnonzero(b[:, 0] < a[:, 2])
        if len(todo) > len(a) // 4:
            steps = _three_smallest(a, b)
        else:
            steps = a.copy()
            if len(todo):
                steps[todo] = _three_smallest(a[todo], b[todo])
        return Records(self.keys, self.exposures + inc.exposures, steps,
                       self.hosts | inc.hosts, self.epochs | inc.epochs,
                       self.epoch_exposures + inc.epoch_exposures)


def _three_smallest(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    (a1, a2, a3), (b1, b2, b3) = a.T, b.T
    out = np.empty_like(a)
    np.minimum(a1, b1, out=out[:, 0])
    np.minimum(np.minimum(a2, b2), np.maximum(a1, b1), out=out[:, 1])
    np.minimum(np.minimum(a3, b3), np.minimum(np.maximum(a1, b2), np.maximum(a2, b1)),
               out=out[:, 2])
    return out


@dataclass
class Starts:
    """A file's record starts (offset 0), prepared off the ingest transaction, in the
    read-ahead thread."""

    keys: np.ndarray  # int64
    steps: np.ndarray  # int64
    epochs: np.ndarray  # int32
    host: int  # a spool file holds one host's rows (checked at read)

    @classmethod
    def from_table(cls, table: pa.Table, host: int) -> Starts:
        start = starts(table["offset"].to_numpy())
        return cls(table["record_key"].to_numpy()[start], table["step"].to_numpy()[start],
                   table["epoch"].to_numpy()[start], host)

    def before(self, cut: int | None) -> Starts:
        """The starts that survive the attempt's rollback cutoff `cut`."""
        if cut is None:
            return self
        keep = effective_before(self.steps, cut)
        return Starts(self.keys[keep], self.steps[keep], self.epochs[keep], self.host)


def group(parts: list[Starts]) -> Records:
    """The starts of several files as per-record increments."""
    parts = [p for p in parts if len(p.keys)]
    if not parts:
        return Records.empty(np.zeros(0, np.int64))
    keys = np.concatenate([p.keys for p in parts]).astype(np.int64, copy=False)
    steps = np.concatenate([p.steps for p in parts]).astype(np.int64, copy=False)
    epochs = np.concatenate([p.epochs for p in parts]).astype(np.int64, copy=False)
    hcode = np.repeat(np.array([min(p.host, HOST_BITS) if p.host >= 0 else HOST_BITS
                                for p in parts], np.int64), [len(p.keys) for p in parts])
    ecode = np.where(epochs >= 0, 1 + (epochs & (EPOCH_BITS - 1)), 0)
    base = int(steps.min())
    sbits = (int(steps.max()) - base).bit_length()
    shift = sbits + 14
    if int(keys.max()).bit_length() + shift <= 63:
        # One int64 per start, (key, step, host, epoch) in that order of significance: a plain
        # sort of it (SIMD, no argsort) groups by key with steps ascending.
        code = keys << shift | (steps - base) << 14 | hcode << 7 | ecode
        code.sort()
        keys, steps = code >> shift, (code >> 14 & ((1 << sbits) - 1)) + base
        hcode, ecode = code >> 7 & 127, code & 127
    else:  # keys or a step range too wide to pack
        order = np.lexsort((steps, keys))
        keys, steps, hcode, ecode = keys[order], steps[order], hcode[order], ecode[order]
    n = len(keys)
    first = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    out = Records.empty(keys[first])
    hb, eb = _HOST_BIT[hcode], _EPOCH_BIT[ecode]
    if len(first) == n:  # every key once
        out.exposures[:] = 1
        out.steps[:, 0] = steps
        out.hosts, out.epochs, out.epoch_exposures = hb, eb, (ecode > 0).astype(np.int32)
        return out
    counts = np.diff(np.r_[first, n])
    out.exposures[:] = counts
    for j in range(3):
        ok = np.flatnonzero(counts > j) if j else slice(None)
        out.steps[ok, j] = steps[first[ok] + j]
    out.hosts, out.epochs = hb[first], eb[first]
    out.epoch_exposures = (ecode[first] > 0).astype(np.int32)
    multi = np.flatnonzero(counts > 1)
    if len(multi):  # reductions over the starts of keys seen more than once only
        sel = np.repeat(counts > 1, counts)
        at = np.r_[0, np.cumsum(counts[multi])[:-1]]
        out.hosts[multi] = np.bitwise_or.reduceat(hb[sel], at)
        out.epochs[multi] = np.bitwise_or.reduceat(eb[sel], at)
        out.epoch_exposures[multi] = np.add.reduceat((ecode[sel] > 0).astype(np.int32), at)
    return out


class RunState:
    """Per-record state of one run, indexed by record key (keys are manifest rows, so dense).
    Rows never written are zero: a row with no exposure reads as "no steps"."""

    def __init__(self) -> None:
        self.size = 0
        self.data = np.zeros(0, STATE)
        self.top = -1  # an upper bound of the keys ever put (it never goes down)

    @classmethod
    def over(cls, rows: np.ndarray, top: int) -> RunState:
        """A state over existing rows (a snapshot's mapping, audit.ledger.snapshot): they are
        neither copied nor read until used."""
        st = cls()
        st.data, st.size, st.top = rows, len(rows), top
        return st

    def reserve(self, need: int) -> None:
        """Room for keys below `need` (MemoryError if it cannot be had)."""
        self._grow(need)

    def _grow(self, need: int) -> None:
        if need <= self.size:
            return
        cap = max(need, self.size + self.size // 8, 1024)  # geometric, without doubling memory
        if not self.size:
            self.data = np.zeros(cap, STATE)
        elif not self.data.flags.owndata:
            # Rows mapped from a snapshot cannot grow in place: one copy, once per process.
            data = np.zeros(cap, STATE)
            data[: self.size] = self.data
            self.data = data
        else:
            # realloc (mremap for large arrays): the rows already there are neither copied nor
            # faulted in again; the tail is zeroed. No view of `data` outlives a reader's hold
            # of Aggregates.lock, which puts run under.
            self.data.resize(cap, refcheck=False)
        self.size = cap

    @property
    def exposures(self) -> np.ndarray:
        return self.data["exposures"]

    def get(self, keys: np.ndarray) -> Records:
        keys = np.asarray(keys, np.int64)
        inside = keys < self.size
        if inside.all():
            return Records.from_rows(keys, np.take(self.data.view(_ROW), keys).view(STATE))
        rows = np.zeros(len(keys), STATE)
        rows[inside] = np.take(self.data.view(_ROW), keys[inside]).view(STATE)
        return Records.from_rows(keys, rows)

    def beyond(self, n: int) -> Records | None:
        """State of the records seen with key >= n (outside a universe of n records)."""
        if self.top < n:
            return None
        keys = n + np.flatnonzero(self.data["exposures"][n: self.size] > 0)
        return self.get(keys) if len(keys) else None

    def put(self, r: Records) -> None:
        if not len(r.keys):
            return
        top = int(r.keys[-1])
        self._grow(top + 1)
        np.put(self.data.view(_ROW), r.keys, r.rows().view(_ROW))
        self.top = max(self.top, top)
