"""Per-record live state: what the ingesting process keeps in memory for every record key of a
run, so that each batch of files updates the aggregates by what it touches (tally.audit.ledger.
aggregates).

Eight bytes a record key (COMPACT): a saturating exposure level, a few flags, the record's
epochs 0..15 as a bit mask and its hosts in four bytes, laid out by the run's largest host
(HostLayout): a mask while it is below 32, four one-byte slots below 255, else two two-byte
slots. Whatever does not fit lives in three sparse maps beside the rows, exact: the exposures
of records seen 255+ times, the host sets of records on more hosts than the row has slots and
the epoch sets of records seen in an epoch outside 0..15 (the sets in tally.audit.ledger.setmap). A
record is on about as many hosts as it has exposures, so four slots hold every record of a
healthy run of up to four epochs on 128 hosts (two slots put 99.6% of those of a 3.85-epoch
run in the map: 40 bytes a record, bench/state_size.py) and a loader's faults leave few beyond
(sampling with replacement at 1.1 exposures a record: ~0.5% of records on 5+ hosts); a run of
many epochs over a small corpus fills the maps (docs/guides/live.md: what each answer costs).

The three earliest exposure steps of a record (the `agg_ranks` of coverage as of a step) are
not kept per record. Record starts are settled in step order behind a watermark W (`settle`):
each host's files arrive in step order, so once every host of the current attempt has sent
files past step W, no start below W is still to come. A start at or after W is *pending*: the
records with one of their three earliest exposures pending keep those steps in a small sorted
table (`pending`, typically the last seconds of training), and a step below W reads as SETTLED,
already counted. A new start then lands after every settled one, so its rank is known without
the steps before it. A start that arrives below W anyway (a file late or out of order) and a
restart that rolls rows back are the exceptions: their records are recomputed from the ledger
(tally.audit.ledger.aggregates), exact either way.

Before, one 48-byte row a record kept the three earliest steps, a 64-bit host mask and a
64-bit epoch mask: 216 GB at 4.5B records, and no overlap past host 63.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from tally.audit.core.arrays import spans
from tally.audit.core.exposure import effective_before, starts
from tally.audit.ledger.setmap import SetMap

NO_STEP = np.iinfo(np.int64).max  # fewer than three exposures: steps are int64 end to end
SETTLED = np.iinfo(np.int64).min  # an exposure below the watermark, already counted

COMPACT = np.dtype([("level", "u1"),  # exposures, saturating at LEVEL_CAP
                    ("flags", "u1"),  # DUP | MANY_HOSTS | FAR_EPOCHS | PENDING
                    ("epochs", "<u2"),  # mask of the epochs 0..EPOCH_WINDOW-1 seen
                    ("host1", "<u2"),  # the hosts' four bytes, as the run's HostLayout says:
                    ("host2", "<u2")])  # a mask, or slots of host + 1 (0: empty)
LEVEL_CAP = 255  # level 255: the exposures are in RunState.levels
DUP = 1  # the record was seen twice in one epoch
MANY_HOSTS = 2  # its hosts are in RunState.many_hosts (more than the row's slots hold, or
# a host beyond the widest layout's cap)
FAR_EPOCHS = 4  # its epochs are in RunState.epochs (an epoch outside the window)
# Its steps are in RunState.pending (one of its first three exposures at or after the
# watermark): a lookup searches the pending table for these records only. A batch's records
# were mostly last seen long before the watermark (an epoch ago), and searching the table for
# all of them was 646 of 2,070 ms of the lookups of a 10M-row ingest at 128 hosts.
PENDING = 8
EPOCH_WINDOW = 16
HOST_CAP = 65534  # hosts 0..HOST_CAP fit a row (two slots) as host + 1


@dataclass(frozen=True)
class HostLayout:
    """How a run's rows hold each record's hosts in their four host bytes (`host1` the low
    two, `host2` the high two, read as one 32-bit word): `slots` == 0, a mask of hosts
    0..MASK_HOSTS-1 (any number of them a record: 3 epochs on 8 hosts put most records on 3
    hosts, which two slots spilled to the map, 32 bytes a record in bench/restart.py); else
    `slots` slots of 32 / slots bits, each host + 1 (0: empty), ascending from the lowest,
    for hosts 0..cap. A run starts with the mask; its first host beyond a layout moves its
    rows to the next (`RunState._relayout`), never back."""

    slots: int

    @property
    def bits(self) -> int:
        return 32 // self.slots

    @property
    def cap(self) -> int:
        """The largest host a slot holds (as host + 1, below 2^bits)."""
        return MASK_HOSTS - 1 if not self.slots else (1 << self.bits) - 2

    @staticmethod
    def for_host(host: int) -> HostLayout:
        """The narrowest layout that holds `host` (the widest for a host beyond HOST_CAP:
        its records go to the map)."""
        return next((x for x in LAYOUTS if host <= x.cap), LAYOUTS[-1])


MASK_HOSTS = 32
LAYOUTS = (HostLayout(0), HostLayout(4), HostLayout(2))  # the order a run moves through them


def csr(rows: np.ndarray, values: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values per row, sorted, as (pointers [n + 1], values), from (row, value)
    pairs with rows ascending (rows below 2^31; values >= 0, below 2^32: hosts, epochs)."""
    rows, values = np.asarray(rows, np.int64), np.asarray(values, np.int64)
    code = rows << 32 | values
    if len(code) > 1:
        same = rows[1:] == rows[:-1]
        if same.any() and not (code[1:][same] > code[:-1][same]).all():
            # Only the entries of rows with several values need sorting, and rows ascend, so
            # sorting those entries together sorts each row's block in place.
            several = np.r_[same, False] | np.r_[False, same]
            code[several] = np.sort(code[several], kind="stable")  # nearly sorted: see union
        if same.any():
            code = code[np.r_[True, code[1:] != code[:-1]]]
    ptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(code >> 32, minlength=n), out=ptr[1:])
    return ptr, code & ((1 << 32) - 1)


def union(a_ptr: np.ndarray, a: np.ndarray, b_ptr: np.ndarray, b: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """The row-wise union of two CSRs of distinct sorted values over the same rows (one sort
    of both: two sorted runs, which a stable sort (timsort) merges: 31 ms for 8M + 2M codes on
    this box, against 1,141 ms for numpy's default sort, which does not look for runs)."""
    code = np.sort(np.r_[rows_of(a_ptr) << 32 | a, rows_of(b_ptr) << 32 | b], kind="stable")
    if len(code):
        code = code[np.r_[True, code[1:] != code[:-1]]]
    ptr = np.zeros(len(a_ptr), np.int64)
    np.cumsum(np.bincount(code >> 32, minlength=len(a_ptr) - 1), out=ptr[1:])
    return ptr, code & ((1 << 32) - 1)


def _from_counts(counts: np.ndarray) -> np.ndarray:
    ptr = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=ptr[1:])
    return ptr


def bits(masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The set bits of each mask (up to 52 bits), ascending, as a CSR (pointers, positions)."""
    masks = np.asarray(masks, np.int64)
    ptr = np.zeros(len(masks) + 1, np.int64)
    np.cumsum(np.bitwise_count(masks), out=ptr[1:])
    out = np.empty(int(ptr[-1]), np.int64)
    idx = np.flatnonzero(masks)
    pos, m = ptr[idx], masks[idx]
    while len(idx):
        low = m & -m  # the lowest set bit; a power of two, exact in float64
        out[pos] = np.log2(low.astype(np.float64)).astype(np.int64)
        m = m ^ low
        more = m != 0
        idx, pos, m = idx[more], pos[more] + 1, m[more]
    return ptr, out


def rows_of(ptr: np.ndarray) -> np.ndarray:
    """The row of each value of a CSR."""
    n = len(ptr) - 1
    if ptr[-1] == n and (n == 0 or ptr[n - 1] == n - 1):  # one value a row, the common case
        counts = np.diff(ptr)
        if (counts == 1).all():
            return np.arange(n)
        return np.repeat(np.arange(n), counts)
    return np.repeat(np.arange(n), np.diff(ptr))


def _take_csr(ptr: np.ndarray, values: np.ndarray, idx: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    counts = np.diff(ptr)[idx]
    out = np.r_[0, np.cumsum(counts)]
    src = np.repeat(ptr[idx] - out[:-1], counts) + np.arange(out[-1])
    return out, values[src]


@dataclass
class Records:
    """The state of a sorted set of record keys, wide (a batch's arithmetic runs over it)."""

    keys: np.ndarray  # int64, sorted, unique
    exposures: np.ndarray  # int64
    steps: np.ndarray  # int64 [n, 3]: the three earliest exposure steps (SETTLED, NO_STEP)
    host_ptr: np.ndarray  # CSR of the distinct hosts of each record
    hosts: np.ndarray  # int64
    epoch_ptr: np.ndarray  # CSR of the distinct known epochs of each record
    epochs: np.ndarray  # int64
    # Exposures of a known epoch beyond the first in it: absolute when the records come from
    # the ledger or a batch, relative (0) from RunState.get; only differences of two states
    # of the same records are meaningful.
    epoch_dups: np.ndarray  # int64
    dup: np.ndarray  # bool: some epoch seen twice (absolute)

    @classmethod
    def empty(cls, keys: np.ndarray) -> Records:
        n = len(keys)
        z = np.zeros(n + 1, np.int64)
        return cls(np.asarray(keys, np.int64), np.zeros(n, np.int64),
                   np.full((n, 3), NO_STEP, np.int64), z, np.zeros(0, np.int64), z.copy(),
                   np.zeros(0, np.int64), np.zeros(n, np.int64), np.zeros(n, bool))

    @property
    def host_counts(self) -> np.ndarray:
        return np.diff(self.host_ptr)

    @property
    def epoch_counts(self) -> np.ndarray:
        return np.diff(self.epoch_ptr)

    def take(self, idx: np.ndarray) -> Records:
        idx = np.asarray(idx, np.int64)
        hp, h = _take_csr(self.host_ptr, self.hosts, idx)
        ep, e = _take_csr(self.epoch_ptr, self.epochs, idx)
        return Records(self.keys[idx], self.exposures[idx], self.steps[idx], hp, h, ep, e,
                       self.epoch_dups[idx], self.dup[idx])

    @staticmethod
    def concat(parts: list[Records]) -> Records:
        """Records of disjoint key sets, in the order given (keys sorted only if they were)."""
        if len(parts) == 1:
            return parts[0]
        def ptrs(name: str) -> np.ndarray:
            out, base = [np.zeros(1, np.int64)], 0
            for p in parts:
                ptr = getattr(p, name)
                out.append(ptr[1:] + base)
                base += int(ptr[-1])
            return np.concatenate(out)
        cat = {f: np.concatenate([getattr(p, f) for p in parts])
               for f in ("keys", "exposures", "hosts", "epochs", "epoch_dups", "dup")}
        return Records(cat["keys"], cat["exposures"],
                       np.concatenate([p.steps for p in parts]).reshape(-1, 3),
                       ptrs("host_ptr"), cat["hosts"], ptrs("epoch_ptr"), cat["epochs"],
                       cat["epoch_dups"], cat["dup"])

    def overlay(self, other: Records) -> Records:
        """These records, with those `other` holds too taken from `other`."""
        if not len(other.keys) or not len(self.keys):
            return self
        pos = np.minimum(np.searchsorted(other.keys, self.keys), len(other.keys) - 1)
        hit = other.keys[pos] == self.keys
        if not hit.any():
            return self
        both = Records.concat([self.take(np.flatnonzero(~hit)),
                               other.take(pos[hit])])
        return both.take(np.argsort(both.keys, kind="stable"))

    def merged(self, inc: Records) -> Records:
        """This state plus `inc`'s exposures of the same keys (a multiset union)."""
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
        hp, h = union(self.host_ptr, self.hosts, inc.host_ptr, inc.hosts)
        ep, e = union(self.epoch_ptr, self.epochs, inc.epoch_ptr, inc.epochs)
        # inc's known-epoch exposures either add an epoch to the record or repeat one.
        added = (np.diff(ep) - self.epoch_counts) - inc.epoch_counts
        new_dups = inc.epoch_dups - added
        return Records(self.keys, self.exposures + inc.exposures, steps, hp, h, ep, e,
                       self.epoch_dups + new_dups, self.dup | (new_dups > 0) | inc.dup)


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
    attempt: int = 0
    last_step: int | None = None  # the file's last step (its host's files come in step order)
    host_count: int = 1  # the hosts of its attempt

    @classmethod
    def from_table(cls, table: pa.Table, host: int, attempt: int = 0,
                   host_count: int = 1) -> Starts:
        start = starts(table["offset"].to_numpy())
        steps = table["step"].to_numpy()
        return cls(table["record_key"].to_numpy()[start], steps[start],
                   table["epoch"].to_numpy()[start], host, attempt,
                   int(steps.max()) if len(steps) else None, host_count)

    def before(self, cut: int | None) -> Starts:
        """The starts that survive the attempt's rollback cutoff `cut`."""
        if cut is None:
            return self
        keep = effective_before(self.steps, cut)
        return Starts(self.keys[keep], self.steps[keep], self.epochs[keep], self.host,
                      self.attempt, self.last_step, self.host_count)


@dataclass
class Grouped:
    """A batch's starts sorted by record key, steps ascending within a record (`grouped`):
    record i's starts are `first[i]` .. `first[i] + counts[i] - 1`. A record started once needs
    no CSR of hosts or epochs (RunState.once reads its one start): `records` builds them for
    the records that take the general way only. Building them for every record of a batch,
    then taking the short way's records back out, was 38% of the increments' py-spy samples
    (20M rows over 10M records in 1M-row batches, where 79-90% of a batch's records went the
    short way)."""

    keys: np.ndarray  # int64, per start
    steps: np.ndarray  # int64
    hosts: np.ndarray  # int64 (-1: untracked)
    epochs: np.ndarray  # int64 (-1: unknown)
    first: np.ndarray  # int64, per record
    counts: np.ndarray  # int64, per record

    def __len__(self) -> int:
        return len(self.first)

    def records(self, idx: np.ndarray | None = None) -> Records:
        """Records `idx` (positions, ascending; all: None), absolute, as if alone."""
        keys, steps, hosts, epochs = self.keys, self.steps, self.hosts, self.epochs
        first, counts = self.first, self.counts
        if idx is not None and len(idx) < len(first):
            counts = counts[idx]
            at = spans(first[idx], counts)
            keys, steps, hosts, epochs = keys[at], steps[at], hosts[at], epochs[at]
            first = np.zeros(len(counts), np.int64)
            np.cumsum(counts[:-1], out=first[1:])
        n = len(first)
        out = Records.empty(keys[first])
        out.exposures[:] = counts
        for j in range(3):
            ok = np.flatnonzero(counts > j) if j else slice(None)
            out.steps[ok, j] = steps[first[ok] + j]
        row = np.repeat(np.arange(n), counts)
        tracked = hosts >= 0
        out.host_ptr, out.hosts = csr(row[tracked], hosts[tracked], n)
        known = epochs >= 0
        out.epoch_ptr, out.epochs = csr(row[known], epochs[known], n)
        out.epoch_dups = np.bincount(row[known], minlength=n) - out.epoch_counts
        out.dup = out.epoch_dups > 0
        return out


def grouped(parts: list[Starts]) -> Grouped:
    """The starts of several files, sorted by record (key, then step)."""
    parts = [p for p in parts if len(p.keys)]
    if not parts:
        z = np.zeros(0, np.int64)
        return Grouped(z, z, z, z, z, z)
    keys = np.concatenate([p.keys for p in parts]).astype(np.int64, copy=False)
    steps = np.concatenate([p.steps for p in parts]).astype(np.int64, copy=False)
    epochs = np.concatenate([p.epochs for p in parts]).astype(np.int64, copy=False)
    hosts = np.repeat(np.array([p.host for p in parts], np.int64), [len(p.keys) for p in parts])
    base = int(steps.min())
    sbits = (int(steps.max()) - base).bit_length()
    hbits = (int(hosts.max()) + 1).bit_length()
    ebits = (int(epochs.max()) + 1).bit_length()
    low = hbits + ebits
    if (int(keys.max()).bit_length() + sbits + low <= 63 and int(hosts.min()) >= -1
            and int(epochs.min()) >= -1):
        # One int64 per start, (key, step, host, epoch) in that order of significance: a
        # plain sort of it (SIMD, no argsort and no gathers) groups by key, steps ascending.
        code = keys << (sbits + low)
        code |= (steps - base) << low
        code |= (hosts + 1) << ebits
        code |= epochs + 1
        code.sort()
        keys, steps = code >> (sbits + low), (code >> low & ((1 << sbits) - 1)) + base
        hosts, epochs = (code >> ebits & ((1 << hbits) - 1)) - 1, (code & ((1 << ebits) - 1)) - 1
    else:  # keys or a step range too wide to pack
        order = np.lexsort((steps, keys))
        keys, steps, epochs, hosts = keys[order], steps[order], epochs[order], hosts[order]
    first = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    return Grouped(keys, steps, hosts, epochs, first, np.diff(np.r_[first, len(keys)]))


def _settled(steps: np.ndarray, watermark: int) -> np.ndarray:
    """Triples with their steps below the watermark as SETTLED."""
    if watermark == SETTLED:
        return steps
    return np.where((steps < watermark) & (steps != NO_STEP), SETTLED, steps)


def _merged(runs: list[PendingRun]) -> PendingRun:
    """Pending runs as one, sorted by key (live entries only: disjoint across runs)."""
    parts = [r.live() for r in runs]
    pk = np.concatenate([k for k, _ in parts])
    order = np.argsort(pk, kind="stable")
    return PendingRun(pk[order], np.concatenate([s for _, s in parts]).reshape(-1, 3)[order],
                      min(r.lo for r in runs), max(r.hi for r in runs), None, len(pk),
                      max(r.top for r in runs))


def _first_real(steps: np.ndarray) -> np.ndarray:
    """Each triple's first real step (NO_STEP: none). Triples ascend (SETTLED first, NO_STEP
    last), so it is the first column not SETTLED. Column by column: numpy's min along rows of
    three cost 0.4 of 7.8 s of a 20M-row ingest's state work."""
    c0, c1, c2 = steps[:, 0], steps[:, 1], steps[:, 2]
    return np.where(c0 != SETTLED, c0, np.where(c1 != SETTLED, c1,
                                                np.where(c2 != SETTLED, c2, NO_STEP)))


def _live(steps: np.ndarray) -> np.ndarray:
    """Triples with a step at or after the watermark (after `_settled`): a step that is
    neither SETTLED nor NO_STEP, the int64 extremes, column by column (numpy's any(axis=1)
    over three columns cost 2.0 of 28.5 s of a 40M-row ingest's state work)."""
    out = np.zeros(len(steps), bool)
    for j in range(steps.shape[1] if steps.ndim == 2 else 0):
        col = steps[:, j]
        out |= (col != SETTLED) & (col != NO_STEP)
    return out


@dataclass
class Once:
    """Records a batch starts exactly once whose rows alone hold what that start changes
    (RunState.once): their new rows, and what the aggregates need to know of the change."""

    keys: np.ndarray  # int64, sorted
    rows: np.ndarray  # COMPACT: the new rows (PENDING is set when they are put)
    level: np.ndarray  # int64: exposures before
    step: np.ndarray  # int64: the start's step
    host: np.ndarray  # int64: the start's host
    added: np.ndarray  # bool: a host the record had not been on
    before_ptr: np.ndarray  # CSR of the hosts each record was on before
    before: np.ndarray  # int64
    repeat: np.ndarray  # bool: the start's epoch is known and the record was seen in it
    was_dup: np.ndarray  # bool: DUP before
    layout: HostLayout  # the rows' host layout
    # The records that were pending (positions, ascending): their triples before and after
    # (the others' follow from level and step: every earlier exposure settled).
    pend: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pend_old: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    pend_new: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))

    @classmethod
    def empty(cls) -> Once:
        z = np.zeros(0, np.int64)
        b = np.zeros(0, bool)
        return cls(z, np.zeros(0, COMPACT), z, z, z, b, np.zeros(1, np.int64), z, b, b,
                   LAYOUTS[0])

    @property
    def steps(self) -> np.ndarray:
        """int64 [m, 3]: the new three earliest steps (SETTLED, NO_STEP)."""
        return self.triples(slice(None))

    def triples(self, idx: np.ndarray | slice) -> np.ndarray:
        """The new three earliest steps of records `idx` (positions, ascending), built on
        demand (for the records that enter the pending table, not the batch's all): the start
        is the record's (level + 1)-th exposure, the earlier ones settled, unless it was
        pending."""
        return self._triples(idx)[0]

    def _triples(self, idx: np.ndarray | slice) -> tuple[np.ndarray, np.ndarray]:
        """`triples(idx)`, and the positions among them of the records pending before."""
        level, step = self.level[idx], self.step[idx]
        out = np.empty((len(level), 3), np.int64)
        for j in range(3):
            out[:, j] = np.where(level > j, SETTLED, np.where(level == j, step, NO_STEP))
        hit = np.zeros(0, np.int64)
        if len(self.pend):
            # Each record's place in `pend` (-1: none) by one gather: searching `pend` for
            # every record cost 0.57 s of a 40M-row ingest's 20 batches at the shape.
            place = np.full(len(self.keys), -1, np.int64)
            place[self.pend] = np.arange(len(self.pend))
            place = place[idx]
            hit = np.flatnonzero(place >= 0)
            out[hit] = self.pend_new[place[hit]]
        return out, hit

    def pending(self, watermark: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """For the pending table: which records are live (`live`), their triples with the
        steps below `watermark` settled, each one's first real step, and a bound of all
        their real steps (PendingRun.of's `first` and `top`). A record not pending before has
        one real step, its start, at or after the watermark (it is live): only the few pending
        before are settled and searched for their steps (settling and searching the batch's
        all cost 0.85 s of a 40M-row ingest at the issue's shape)."""
        live = self.live(watermark)
        idx = np.flatnonzero(live)
        out, hit = self._triples(idx)
        first = self.step[idx]
        top = int(first.max(initial=SETTLED))
        if len(hit):
            out[hit] = _settled(out[hit], watermark)
            first[hit] = _first_real(out[hit])
            top = max(top, *(int(c[c != NO_STEP].max(initial=SETTLED)) for c in out[hit].T))
        return live, out, first, top

    def live(self, watermark: int) -> np.ndarray:
        """Which records keep a step at or after `watermark` among their three earliest (their
        triples go to the pending table)."""
        out = (self.level < 3) & (self.step >= watermark)
        if len(self.pend):
            out[self.pend] = _live(_settled(self.pend_new, watermark))
        return out

    def records(self) -> Records:
        """These records as Records (an overlay of a change staged in a transaction)."""
        out = Records.empty(self.keys)
        out.exposures = self.level + 1
        out.steps = self.steps.copy()
        if not self.layout.slots:
            out.host_ptr, out.hosts = bits(_host_word(self.rows))
        else:
            slot = _slots(self.rows, self.layout)
            out.host_ptr = _from_counts((slot > 0).sum(axis=1))
            out.hosts = slot[slot > 0].astype(np.int64) - 1
        out.epoch_ptr, out.epochs = bits(self.rows["epochs"].astype(np.int64))
        out.dup = (self.rows["flags"] & DUP) != 0
        return out

    def __len__(self) -> int:
        return len(self.keys)


def _host_word(rows: np.ndarray) -> np.ndarray:
    """The four host bytes of COMPACT rows as one integer each (int64)."""
    return rows["host1"].astype(np.int64) | rows["host2"].astype(np.int64) << 16


def _slots(rows: np.ndarray, layout: HostLayout) -> np.ndarray:
    """COMPACT rows' host slots as a [n, slots] view of host + 1 (0: empty): the four host
    bytes are the slots in order, little-endian (a view, no arithmetic: the [n, 4] int64 of
    shifts and masks cost 28 ms a batch of 230k records)."""
    rows = np.ascontiguousarray(rows)
    at = COMPACT.fields["host1"][1]
    return rows.view(np.uint8).reshape(-1, COMPACT.itemsize)[:, at: at + 4].view(
        f"<u{4 // layout.slots}")


def _to_slots(ptr: np.ndarray, hosts: np.ndarray, layout: HostLayout
              ) -> tuple[np.ndarray, np.ndarray]:
    """Records' host sets (a CSR, each sorted) as host words in `layout`'s slots, and which do
    not fit (more hosts than slots, or a host beyond its cap: their word is 0)."""
    counts = np.diff(ptr)
    n = len(counts)
    largest = np.zeros(n, np.int64)
    has = counts > 0
    largest[has] = hosts[ptr[1:][has] - 1]
    many = (counts > layout.slots) | (largest > layout.cap)
    word = np.zeros(n, np.int64)
    hosts = np.asarray(hosts, np.int64)
    for i in range(layout.slots):
        at = np.flatnonzero((counts > i) & ~many)
        word[at] |= (hosts[ptr[at] + i] + 1) << (i * layout.bits)
    return word, many


class PendingRun(NamedTuple):
    """One run of the pending table: sorted keys, their triples, `lo`, a lower bound of the
    real steps in it (a watermark at or below it skips the run untouched), `hi`, an upper
    bound of its records' first real steps (what a forced watermark can reach), `alive`:
    None, or False where a newer run took the record over (a tombstone: taking it out would
    copy the run, O(pending) a batch), with `count` the live entries, and `top`, an upper
    bound of all its real steps (a watermark above it settles the whole run unread)."""

    keys: np.ndarray
    steps: np.ndarray
    lo: int
    hi: int
    alive: np.ndarray | None = None
    count: int = -1
    top: int = NO_STEP

    @classmethod
    def of(cls, keys: np.ndarray, steps: np.ndarray, top: int | None = None,
           first: np.ndarray | None = None) -> PendingRun:
        """The run of `keys` (sorted) and their triples; `top`, a bound of their real steps,
        and `first`, each one's first real step, where the caller knows them (else found
        here)."""
        if not len(keys):
            return cls(keys, steps, NO_STEP, SETTLED, None, 0)
        if first is None:
            first = _first_real(steps)
        if top is None:  # column by column: a masked max over all three cost 14.6 ms for 2M
            top = max(int(np.where(c != NO_STEP, c, SETTLED).max()) for c in steps.T)
        return cls(keys, steps, int(first.min()), int(first.max()), None, len(keys), top)

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, triples) of the live entries."""
        if self.alive is None:
            return self.keys, self.steps
        return self.keys[self.alive], self.steps[self.alive]

    def without(self, gone: np.ndarray) -> PendingRun | None:
        """The run with the records `gone` (sorted) taken over by a newer run: tombstoned,
        compacted once half of it is dead; None once none is left."""
        pos = np.minimum(np.searchsorted(self.keys, gone), len(self.keys) - 1)
        pos = pos[self.keys[pos] == gone]
        if self.alive is not None:
            pos = pos[self.alive[pos]]
        if not len(pos):
            return self
        count = self.count - len(pos)
        if not count:
            return None
        alive = np.ones(len(self.keys), bool) if self.alive is None else self.alive
        alive[pos] = False
        if 2 * count < len(self.keys):
            return PendingRun(self.keys[alive], self.steps[alive], self.lo, self.hi, None, count,
                              self.top)
        return self._replace(alive=alive, count=count)


@dataclass
class RunState:
    """Per-record state of one run, indexed by record key (keys are manifest rows, so dense).
    Rows never written are zero: never seen."""

    size: int = 0
    data: np.ndarray = field(default_factory=lambda: np.zeros(0, COMPACT))
    top: int = -1  # an upper bound of the keys ever put (it never goes down)
    levels: dict[int, int] = field(default_factory=dict)  # exposures of level-255 records
    # The host sets of MANY_HOSTS records and the epoch sets of FAR_EPOCHS records.
    many_hosts: SetMap = field(default_factory=SetMap)
    hosts_in_rows: HostLayout = LAYOUTS[0]  # how the rows hold hosts (a mask, at first)
    far_epochs: SetMap = field(default_factory=SetMap)
    watermark: int = SETTLED  # starts below it are settled; none is, at first
    # The pending table as runs of (sorted keys, their triples), one a batch, disjoint: a new
    # run takes its records out of the older ones (a filter), never a merge of sorted arrays.
    pending: list[PendingRun] = field(default_factory=list)
    host_last: dict[tuple[int, int], int] = field(default_factory=dict)  # (attempt, host)
    host_count: dict[int, int] = field(default_factory=dict)  # attempt -> hosts

    @classmethod
    def over(cls, rows: np.ndarray, top: int) -> RunState:
        """A state over existing rows (a snapshot's mapping, tally.audit.ledger.snapshot): they are
        neither copied nor read until used."""
        return cls(size=len(rows), data=rows, top=top)

    GROW_ROWS = 1 << 21  # rows grown beyond the need at most (16 MiB)

    def reserve(self, need: int, most: int | None = None) -> None:
        """Room for keys below `need` (MemoryError if it cannot be had); the room beyond
        `need` stops at `most` rows (the process's bound, TALLY_MAX_STATE_GB)."""
        if need <= self.size:
            return
        # Geometric, without doubling memory, and at most GROW_ROWS beyond the need: the room
        # grown into is zeroed, so resident. Random keys over 100M records grew the rows to
        # 112.5M (9.0 bytes a record resident, not 8); a growth is a realloc (mremap: the
        # rows are not copied), so growing more often costs little.
        cap = max(need, min(self.size + self.size // 8, need + self.GROW_ROWS), 1024)
        if most is not None:
            cap = max(need, min(cap, most))
        if not self.size:
            self.data = np.zeros(cap, COMPACT)
        elif not self.data.flags.owndata:
            # Rows mapped from a snapshot cannot grow in place: one copy, once per process.
            data = np.zeros(cap, COMPACT)
            data[: self.size] = self.data
            self.data = data
        else:
            # realloc (mremap for large arrays): the rows already there are neither copied nor
            # faulted in again; the tail is zeroed. No view of `data` outlives a reader's hold
            # of Aggregates.lock, which puts run under.
            self.data.resize(cap, refcheck=False)
        self.size = cap

    # ---- reading ---------------------------------------------------------------------------
    def exposures(self) -> np.ndarray:
        """Exposures per record key (int64, a copy)."""
        out = self.data["level"][: self.size].astype(np.int64)
        for k, v in self.levels.items():
            out[k] = v
        return out

    def seen(self, lo: int = 0) -> np.ndarray:
        """The keys >= lo seen at least once."""
        return lo + np.flatnonzero(self.data["level"][lo: self.size])

    def get(self, keys: np.ndarray) -> Records:
        keys = np.asarray(keys, np.int64)
        n = len(keys)
        inside = keys < self.size
        rows = np.zeros(n, COMPACT)
        # Whole rows as one uint64 each: a gather of plain words, 5x a structured one.
        rows.view(np.uint64)[inside] = np.take(self.data.view(np.uint64), keys[inside])
        out = Records.empty(keys)
        out.exposures = rows["level"].astype(np.int64)
        flags = rows["flags"]
        for i in np.flatnonzero(rows["level"] == LEVEL_CAP):
            out.exposures[i] = self.levels[int(keys[i])]
        # Steps: the pending table's, else SETTLED for each exposure up to three.
        out.steps = np.where(np.arange(3) < np.minimum(out.exposures, 3)[:, None], SETTLED,
                             NO_STEP)
        pend = np.flatnonzero(flags & PENDING)
        if len(pend):
            out.steps[pend] = self._pending_steps(keys[pend], out.steps[pend])
        # Hosts: the row's mask, or its slots (stored in order) else the map's; in row order.
        if not self.hosts_in_rows.slots:
            out.host_ptr, out.hosts = bits(_host_word(rows))
        else:
            self._slot_hosts(out, keys, rows, flags)
        # Epochs: the row's window, else the map's.
        far = (flags & FAR_EPOCHS) != 0
        mask = rows["epochs"].astype(np.int64)
        mask[far] = 0
        out.epoch_ptr, out.epochs = bits(mask)
        if far.any():
            counts = np.diff(out.epoch_ptr)
            window = out.epochs
            counts[far], spilled = self.far_epochs.get(keys[far])
            out.epoch_ptr = _from_counts(counts)
            out.epochs = np.empty(int(out.epoch_ptr[-1]), np.int64)
            out.epochs[spans(out.epoch_ptr[:-1][~far], counts[~far])] = window
            out.epochs[spans(out.epoch_ptr[:-1][far], counts[far])] = spilled
        out.dup = (flags & DUP) != 0
        return out

    def _pending_steps(self, keys: np.ndarray, default: np.ndarray) -> np.ndarray:
        """The pending table's triples of `keys` (records flagged PENDING: each is live in
        one run), `default`'s rows where none is found."""
        out = default.copy()
        for run in self.pending:
            pk, ps, alive = run.keys, run.steps, run.alive
            pos = np.minimum(np.searchsorted(pk, keys), len(pk) - 1)
            hit = pk[pos] == keys
            if alive is not None:
                hit &= alive[pos]
            out[hit] = ps[pos[hit]]
        return out

    def _slot_hosts(self, out: Records, keys: np.ndarray, rows: np.ndarray,
                    flags: np.ndarray) -> None:
        """`out`'s hosts from rows in slots: the row's (stored in order), else the map's."""
        many = (flags & MANY_HOSTS) != 0
        slot = _slots(rows, self.hosts_in_rows)
        filled = slot > 0
        counts = filled.sum(axis=1)
        if many.any():
            filled[many] = False
            counts[many], spilled = self.many_hosts.get(keys[many])
        out.host_ptr = _from_counts(counts)
        out.hosts = np.empty(int(out.host_ptr[-1]), np.int64)
        at = out.host_ptr[:-1]
        # Row-major order of the filled slots is each record's hosts in order, record by record.
        if not many.any():
            out.hosts[:] = slot[filled] - 1
            return
        out.hosts[spans(at[~many], counts[~many])] = slot[filled] - 1
        out.hosts[spans(at[many], counts[many])] = spilled

    def once(self, g: Grouped, watermark: int, exclude: np.ndarray | None = None
             ) -> tuple[np.ndarray, Once]:
        """Which records of `g` (a batch's starts, grouped) go the short way, and their new
        state: started once in the batch, at or after the watermark, on a tracked host, their
        row neither in a map nor near the level cap, the start's epoch unknown or in the row's
        window and its host in the row's layout with room for it. Their rows (and, for those
        pending, their triples in the pending table) then say everything: no CSR of hosts or
        epochs is built. A healthy loader's batch is nearly all of them (a 1M-row batch of 128
        hosts: the general way cost ~0.3 s of state work); the others, and `exclude` (records
        with a change staged in the transaction), take the general way (Records.merged)."""
        layout = self.hosts_in_rows
        if len(g.hosts) and int(g.hosts.max()) > layout.cap:  # the rows change layout
            return np.zeros(len(g), bool), Once.empty()
        idx = np.flatnonzero(g.counts == 1)
        start = g.first[idx]
        host, step = g.hosts[start], g.steps[start]
        ok = (host >= 0) & (step >= watermark)
        keys = g.keys[start]
        if exclude is not None and len(exclude):
            ok &= ~np.isin(keys, exclude)
        if not ok.all():
            idx, start, host, step, keys = idx[ok], start[ok], host[ok], step[ok], keys[ok]
        epoch = g.epochs[start]  # below 0: unknown
        # Each row as one little-endian 64-bit word (COMPACT's fields: level, flags, epochs,
        # then the four host bytes), its fields taken and put back by shifts: structured field
        # access is strided, and cost more than the work.
        word = np.zeros(len(idx), "<u8")
        inside = keys < self.size
        word[inside] = np.take(self.data.view("<u8"), keys[inside])
        level, flags = (word & 0xFF).astype(np.int64), ((word >> 8) & 0xFF).astype(np.int64)
        emask, hword = ((word >> 16) & 0xFFFF).astype(np.int64), (word >> 32).astype(np.int64)
        fits = ((flags & (MANY_HOSTS | FAR_EPOCHS)) == 0) & \
            (level < LEVEL_CAP - 1) & (epoch < EPOCH_WINDOW) & (host <= layout.cap)
        if layout.slots:
            # Slot by slot, as columns: numpy's reductions along a row of four cost 10x.
            cut = (1 << layout.bits) - 1
            cols = [(hword >> (j * layout.bits)) & cut for j in range(layout.slots)]
            v = host + 1
            present = np.zeros(len(idx), bool)
            count = np.zeros(len(idx), np.int64)
            for c in cols:
                present |= c == v
                count += c > 0
            fits &= present | (count < layout.slots)
        mine = np.zeros(len(g), bool)
        if len(fits) and fits.all():  # a healthy batch's records nearly all fit: no copies
            sel = slice(None)
            mine[idx] = True
        else:
            sel = np.flatnonzero(fits)
            mine[idx[sel]] = True
            if not len(sel):
                return mine, Once.empty()
            keys, host, epoch = keys[sel], host[sel], epoch[sel]
            level, flags, emask, hword = level[sel], flags[sel], emask[sel], hword[sel]
            if layout.slots:
                cols = [c[sel] for c in cols]
                present, count = present[sel], count[sel]
        if layout.slots:
            before_ptr = _from_counts(count)
            slot = np.stack(cols, axis=1)
            before = slot[slot > 0] - 1
            # The host into its place among the filled slots (ascending), the rest shifted up.
            v = host + 1
            at = np.zeros(len(keys), np.int64)
            for c in cols:
                at += (c > 0) & (c < v)
            at[present] = layout.slots  # nothing moves
            hword = np.zeros(len(keys), np.int64)
            for j, c in enumerate(cols):
                new = c if j == 0 else np.where(j > at, cols[j - 1], c)
                new = np.where(j == at, v, new)
                hword |= new << (j * layout.bits)
        else:
            present = ((hword >> host) & 1) != 0
            before_ptr, before = bits(hword)
            hword = hword | (1 << host)
        known = epoch >= 0
        ebit = np.where(known, 1 << np.maximum(epoch, 0), 0)
        repeat = known & ((emask & ebit) != 0)
        was_dup = (flags & DUP) != 0
        out = ((level + 1) | np.where(was_dup | repeat, DUP, 0) << 8 | (emask | ebit) << 16
               | hword << 32).astype("<u8").view(COMPACT)
        step = step[sel]
        # Records pending (one of their three earliest steps at or after the watermark): the
        # start goes into the triple the pending table holds, wherever it falls among its
        # steps (hosts' steps interleave). They took the general way, with the records
        # started twice in the batch: 0.28-0.36M of a 2M-row batch's ~1.8M records (8 hosts'
        # files, random keys over 10M records).
        pend = np.flatnonzero(flags & PENDING)
        old = self._pending_steps(keys[pend], np.where(
            np.arange(3) < np.minimum(level[pend], 3)[:, None], SETTLED, NO_STEP))  # as get
        new = np.empty_like(old)
        s = step[pend]
        np.minimum(old[:, 0], s, out=new[:, 0])
        np.minimum(old[:, 1], np.maximum(old[:, 0], s), out=new[:, 1])
        np.minimum(old[:, 2], np.maximum(old[:, 1], s), out=new[:, 2])
        return mine, Once(keys, out, level, step, host, ~present, before_ptr, before,
                          repeat, was_dup, layout, pend, old, new)

    # ---- writing ---------------------------------------------------------------------------
    def put_once(self, q: Once) -> None:
        """`q`'s new rows (their steps below the watermark become SETTLED)."""
        if not len(q):
            return
        if q.layout != self.hosts_in_rows:  # moved since (another change of the transaction)
            self.put(q.records())
            return
        self.reserve(int(q.keys[-1]) + 1)
        self.top = max(self.top, int(q.keys[-1]))
        live, steps, first, top = q.pending(self.watermark)
        words = q.rows.view(np.uint64).copy()
        words[live] |= np.uint64(PENDING << 8 * COMPACT.fields["flags"][1])
        # Those flagged PENDING when `q` was made (`once`): the flags of its records are not
        # read again, a gather over the whole state (0.65 s of a 40M-row ingest over 100M
        # records). Only a restart's `lower` in between can clear a flag, never set one, and a
        # record said pending that is no longer so is simply not found in the older runs.
        was = np.zeros(len(q), bool)
        was[q.pend] = True
        np.put(self.data.view(np.uint64), q.keys, words)
        # Only the live records' triples are built: the others' are settled or past their
        # third exposure (random starts over 10M records: those of about a batch's last step).
        self._pend(q.keys, steps, live, was, top, first)

    def put(self, r: Records) -> None:
        """The records' new state (their steps below the watermark become SETTLED)."""
        if not len(r.keys):
            return
        top = int(r.keys[-1])
        self.reserve(top + 1)
        self.top = max(self.top, top)
        n = len(r.keys)
        if len(r.hosts) and int(r.hosts.max()) > self.hosts_in_rows.cap:
            wider = HostLayout.for_host(int(r.hosts.max()))
            if LAYOUTS.index(wider) > LAYOUTS.index(self.hosts_in_rows):
                self._relayout(wider)
        before = np.take(self.data.view(np.uint64), r.keys).view(COMPACT)
        old, old_capped = before["flags"], before["level"] == LEVEL_CAP
        rows = np.zeros(n, COMPACT)
        rows["level"] = np.minimum(r.exposures, LEVEL_CAP)
        capped = r.exposures >= LEVEL_CAP
        for k in r.keys[old_capped & ~capped].tolist():
            del self.levels[k]
        self.levels.update(zip(r.keys[capped].tolist(), r.exposures[capped].tolist(),
                               strict=True))
        flags = np.where(r.dup, DUP, 0).astype(np.uint8)
        # Hosts: the run's mask, or up to its slots in the row (sorted), else the map.
        if not self.hosts_in_rows.slots:
            m = np.bincount(rows_of(r.host_ptr), minlength=n,
                            weights=np.left_shift(1, r.hosts).astype(np.float64)).astype(np.int64)
        else:
            m, many = _to_slots(r.host_ptr, r.hosts, self.hosts_in_rows)
            flags[many] |= MANY_HOSTS
            self.many_hosts.update(r.keys[many], *_take_csr(r.host_ptr, r.hosts,
                                                            np.flatnonzero(many)),
                                   removed=r.keys[((old & MANY_HOSTS) != 0) & ~many])
        rows["host1"], rows["host2"] = m & 0xFFFF, m >> 16
        # Epochs: the window's bits in the row; else the map.
        erow = rows_of(r.epoch_ptr)
        outside = (r.epochs < 0) | (r.epochs >= EPOCH_WINDOW)
        far = np.bincount(erow[outside], minlength=n) > 0
        inw = ~far[erow]
        # Each record's epochs are distinct: the sum of their bits is their mask (exact in
        # float64 below 2^16).
        rows["epochs"] = np.bincount(erow[inw], weights=np.left_shift(1, r.epochs[inw]),
                                     minlength=n).astype(np.uint16)
        flags[far] |= FAR_EPOCHS
        self.far_epochs.update(r.keys[far], *_take_csr(r.epoch_ptr, r.epochs,
                                                       np.flatnonzero(far)),
                               removed=r.keys[((old & FAR_EPOCHS) != 0) & ~far])
        steps = _settled(r.steps, self.watermark)
        live = _live(steps)
        flags[live] |= PENDING
        rows["flags"] = flags
        np.put(self.data.view(np.uint64), r.keys, rows.view(np.uint64))
        self._pend(r.keys, steps[live], live, (old & PENDING) != 0)

    RELAYOUT_ROWS = 1 << 24  # rows moved to a new host layout at a time (bounded temporaries)

    def _relayout(self, layout: HostLayout) -> None:
        """The run's rows to a wider host layout (a host beyond the current one's cap arrived):
        each record's hosts from its row into the new one, or into the map where they no longer
        fit. One pass over the rows, at most twice in a run's life. Records already in the map
        stay there: they had more hosts than the old slots, so more than the new ones."""
        old, self.hosts_in_rows = self.hosts_in_rows, layout
        for lo in range(0, self.size, self.RELAYOUT_ROWS):
            data = self.data[lo: lo + self.RELAYOUT_ROWS]
            word = _host_word(data)
            keys = np.flatnonzero((word != 0) & ((data["flags"] & MANY_HOSTS) == 0))
            if not len(keys):
                continue
            if not old.slots:
                ptr, hosts = bits(word[keys])
            else:
                slot = _slots(data[keys], old)
                ptr = _from_counts((slot > 0).sum(axis=1))
                hosts = slot[slot > 0].astype(np.int64) - 1
            m, many = _to_slots(ptr, hosts, layout)
            data["host1"][keys], data["host2"][keys] = m & 0xFFFF, m >> 16
            flags = data["flags"][keys]
            flags[many] |= MANY_HOSTS
            data["flags"][keys] = flags
            self.many_hosts.update(lo + keys[many], *_take_csr(ptr, hosts, np.flatnonzero(many)),
                                   removed=np.zeros(0, np.int64))

    # Runs kept at most before the smaller ones merge: a lookup searches each run for its
    # PENDING records only, so many runs cost little; merging all of them whenever there were
    # more than 8 sorted the whole table nearly every batch once a step of all hosts outgrew
    # a few batches (16 hosts x 500k rows: 0.7 s a batch).
    PENDING_RUNS = 32

    def _pend(self, keys: np.ndarray, live_steps: np.ndarray, live: np.ndarray,
              was: np.ndarray, top: int | None = None, first: np.ndarray | None = None
              ) -> None:
        """The pending table takes the triples of these records with a step at or after the
        watermark (`live`, flagged PENDING in their rows; `live_steps` their triples, settled
        below the watermark); `was`: those flagged PENDING before, the only ones an older run
        can hold; `top` and `first`: as PendingRun.of takes them, where the caller knows them."""
        gone = keys[was]
        runs = []
        for run in self.pending:
            kept = run.without(gone) if len(gone) else run
            if kept is not None:  # a run that lost records keeps its bounds (bounds still)
                runs.append(kept)
        if live.any():
            runs.append(PendingRun.of(keys[live], live_steps, top, first))
        if len(runs) > self.PENDING_RUNS:  # the smaller half merged: each entry merges
            runs.sort(key=lambda r: r.count)  # O(log) times over its life, as in an LSM tree
            small, runs = runs[: len(runs) // 2 + 1], runs[len(runs) // 2 + 1:]
            runs.append(_merged(small))
        self.pending = runs

    def _pending_table(self) -> tuple[np.ndarray, np.ndarray]:
        """The pending table as one sorted (keys, triples)."""
        if not self.pending:
            return np.zeros(0, np.int64), np.zeros((0, 3), np.int64)
        merged = _merged(self.pending)
        return merged.keys, merged.steps

    # ---- the watermark ---------------------------------------------------------------------
    def observe(self, attempt: int, host: int, host_count: int, last_step: int | None) -> None:
        """A file of (attempt, host) up to `last_step` was applied."""
        self.host_count[attempt] = max(host_count, self.host_count.get(attempt, 0))
        if last_step is not None:
            key = (attempt, host)
            self.host_last[key] = max(last_step, self.host_last.get(key, last_step))

    PENDING_MAX = 4_000_000  # pending records kept at most (~100 MB): see settle

    def advance(self) -> None:
        """Raise the watermark to where every host of the newest attempt has sent files
        (none of their starts below it is still to come: a host's files come in step order;
        its next file may go on with its last step). Pending steps are settled by `settle`;
        a `put` after this settles its own records' steps below it."""
        if self.host_count:
            attempt = max(self.host_count)
            last = [s for (a, _), s in self.host_last.items() if a == attempt]
            if len(last) >= self.host_count[attempt]:
                self.watermark = max(self.watermark, min(last))

    def settle(self) -> None:
        """`advance`, and settle the pending steps below the watermark. A host that stopped
        sending (ended early, died) would hold the watermark for good: past PENDING_MAX
        pending records it moves on regardless, and a start that arrives below it later takes
        the exact, slower way (recomputed from the ledger)."""
        self.advance()
        total = sum(r.count for r in self.pending)
        if total > self.PENDING_MAX:
            # Forced to where about half the table settles, chosen from the runs' bounds
            # (sorting the table's first steps each batch cost 0.8 s a batch at 8M pending),
            # never past the newest first step present: every pending start at or after the
            # watermark already (one step of all hosts larger than the bound: 16 hosts x 500k
            # rows) settles nothing, and its hosts may still be sending that step.
            runs = sorted(self.pending, key=lambda r: r.hi)
            newest = runs[-1].hi
            done, forced = 0, newest
            for r in runs:
                done += r.count
                if 2 * done >= total:
                    forced = min(r.hi + 1, newest)
                    break
            if forced > min(r.lo for r in runs):
                self.watermark = max(self.watermark, forced)
        self.lower(self.watermark)

    def lower(self, watermark: int) -> None:
        """Set the watermark (a restart lowers it to where its rows were rolled back: the
        caller has recomputed the records with rows at or after it)."""
        self.watermark = watermark
        runs = []
        for run in self.pending:
            if run.lo >= watermark:  # no step of it below the watermark: nothing to settle
                runs.append(run)     # (0.8 s of a 1M-row batch's 3.5 s went to such runs)
                continue
            flags = self.data["flags"]
            if run.top < watermark:  # every step of it settles: its triples are not read
                # (their settling, filtering and copying cost 0.85 s of a 40M-row ingest's
                # 2.1 s here, at the shape, where most runs settle whole)
                pk = run.keys if run.alive is None else run.keys[run.alive]
                flags[pk] &= np.uint8(~PENDING & 0xFF)
                continue
            pk, ps = run.live()
            ps = _settled(ps, watermark)
            live = _live(ps)
            if live.any():
                runs.append(PendingRun.of(pk[live], ps[live]))
            if not live.all():
                flags[pk[~live]] &= np.uint8(~PENDING & 0xFF)
        self.pending = runs

    # ---- persistence (tally.audit.ledger.snapshot) -----------------------------------------------
    def extra(self) -> dict[str, np.ndarray]:
        """Everything beside the rows, as arrays."""
        pending = self._pending_table()
        hl = np.array([(a, h, s) for (a, h), s in sorted(self.host_last.items())],
                      np.int64).reshape(-1, 3)
        return {"level_keys": np.array(list(self.levels), np.int64),
                "level_values": np.array(list(self.levels.values()), np.int64),
                **self.many_hosts.arrays("host"), **self.far_epochs.arrays("epoch"),
                "watermark": np.array([self.watermark], np.int64),
                "host_slots": np.array([self.hosts_in_rows.slots], np.int64),
                "pending_keys": pending[0], "pending_steps": pending[1],
                "host_last": hl,
                "host_count": np.array(sorted(self.host_count.items()), np.int64).reshape(-1, 2)}

    def restore_extra(self, x: dict[str, np.ndarray]) -> None:
        self.levels = dict(zip(x["level_keys"].tolist(), x["level_values"].tolist(),
                               strict=True))
        self.many_hosts = SetMap.from_arrays(x, "host")
        self.far_epochs = SetMap.from_arrays(x, "epoch")
        self.watermark = int(x["watermark"][0])
        layout = HostLayout(int(x["host_slots"][0]))
        if layout not in LAYOUTS:
            raise ValueError(f"host layout of {layout.slots} slots")
        self.hosts_in_rows = layout
        keys = x["pending_keys"].astype(np.int64)
        self.pending = [PendingRun.of(keys, x["pending_steps"].astype(np.int64).reshape(-1, 3))
                        ] if len(keys) else []
        self.host_last = {(int(a), int(h)): int(s) for a, h, s in x["host_last"]}
        self.host_count = {int(a): int(c) for a, c in x["host_count"]}

    def nbytes(self) -> dict[str, int]:
        """Memory of the state by part (approximate for the maps' Python objects)."""
        return {"rows": int(self.size * COMPACT.itemsize),
                "levels": 100 * len(self.levels),
                "many_hosts": self.many_hosts.nbytes(),
                "far_epochs": self.far_epochs.nbytes(),
                "pending": sum(int(r.keys.nbytes + r.steps.nbytes)
                               + (0 if r.alive is None else int(r.alive.nbytes))
                               for r in self.pending)}
