"""What a reconcile job reads and how it cuts the work: the input files (a run's spool segment
files, or an export of the ledger), the attempts and their rollback cutoffs, and the record-key
buckets sized to the memory budget. Decided once, before the pipeline starts (`Plan`)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tally.audit.core.arrays import ranks
from tally.audit.core.errors import TallyError
from tally.audit.core.exposure import effective, effective_sql, rolled_back_from
from tally.audit.core.schema import SEGMENT_COLUMNS_ALL, names, sql_select
from tally.audit.hook import spool as sp
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.queries import (
    finished_hosts,
    non_finite_losses,
    quarantined_of,
    replayed_of,
)
from tally.audit.provenance import input_print

# What the job reads of each row: the segment columns, with the row's attempt.
COLUMNS = ("attempt", *names(SEGMENT_COLUMNS_ALL))
# Memory a bucket takes in its worker: per consumption row (its columns, sort keys, masks) and
# per manifest record (its columns, per-record results, one byte per host).
BYTES_PER_ROW, BYTES_PER_RECORD = 120, 160
# Buckets in memory at once, with room to spare: one per worker (process, or thread of the
# in-memory runner: tally.pipeline.runners.threaded) plus the runner's; more where the runner
# says it works on more at once (`in_flight`).
BUCKETS_IN_FLIGHT = 4
# Rows per bucket at most: keeps each int64 temporary under glibc's largest mmap threshold
# (32 MiB), so that the allocator reuses heap memory instead of mapping, faulting in and
# unmapping fresh pages for every temporary (measured: 30% of a bucket's time).
BUCKET_ROWS = 2_500_000
# Windows of steps the loss by exposure rank is split into: at most this many, each a power of
# two steps long, so that a run's windows grow by merging pairs (the live reconcile keeps its
# sums as the run grows, tally.audit.reconcile.follow) rather than by cutting them anew.
LOSS_WINDOWS = 256
# Steps are int64 and a run may start at any of them, but the job keeps per-step series from a
# run's first step to its last: a run spans fewer than 2^31 steps (a million-step run spans
# 2^20).
MAX_RUN_STEPS = 2**31
# Bytes of per-step series a job holds per step of the span (first to last step), measured as
# peak memory over a 2-step run at steps 0 and 10^6 against one at 0 and 10^3: reconcile 190,
# diff 435 (both runs). The span is bounded by --memory-gb with this margin, so that a file
# whose step jumps far ahead gets one line instead of exhausting the machine (a live service
# runs a live reconcile, which plans each round).
STEP_BYTES = {"reconcile": 256, "diff": 512}


@dataclass(frozen=True, slots=True)
class InputFile:
    path: str
    spool_file: sp.SpoolFile | None = None  # None: a ledger export with an `attempt` column
    rows: int = 0  # as its metadata says (chunks are cut by it)
    bytes: int | None = None  # a spool file's size when listed (None: stat it)


# Input files are read CHUNK_ROWS rows at a time (whole files): a worker's task, one bucket
# file and one partial result each. One task a spool file made a 100M-row reconcile of 128 hosts
# 7,296 tasks, 292k bucket slices (each an element the runner moved, and a read in the join)
# and 7,296 partials for the driver to merge: 35 s of reading, a 6.6 s shuffle, 8 s of merging.
CHUNK_ROWS = 2_500_000
TASKS = 32  # a smaller job is cut into about this many tasks (whole files), for the workers


def chunks(files: list, rows: int | None = None) -> list[tuple]:
    """`files` (with a `rows` count each) in order, cut into runs of about `rows` rows
    (default: CHUNK_ROWS, or fewer where that leaves fewer than TASKS tasks)."""
    if rows is None:
        rows = min(CHUNK_ROWS, max(1, sum(f.rows for f in files) // TASKS))
    out, cur, n = [], [], 0
    for f in files:
        if cur and n + f.rows > rows:
            out.append(tuple(cur))
            cur, n = [], 0
        cur.append(f)
        n += f.rows
    if cur:
        out.append(tuple(cur))
    return out


@dataclass
class Plan:
    """Everything the workers need to know, decided before the pipeline starts."""

    run_id: str
    files: list[InputFile]
    attempts: dict[int, dict[str, Any]]  # attempt -> resumed_from_step, host_count, last_step
    manifest: str
    records: int  # manifest rows
    train_records: int
    fingerprint: str
    run_fingerprint: str | None
    at_step: int | None
    hosts: int  # the run's host count: the most any attempt declared
    bucket_size: int
    buckets: int
    rows: int = 0  # consumption rows
    left_out: list[tuple[str, str]] = field(default_factory=list)  # (path, reason), see Inputs
    non_finite_losses: dict[str, Any] = field(default_factory=dict)  # see Inputs
    finished: bool = False  # every host of the last attempt said it finished
    loss_window: int = 1  # steps per window of the loss split by exposure rank
    first_step: int = 0  # the run's first consumed step: per-step series and windows start here
    milestones: list[dict[str, Any]] = field(default_factory=list)  # see Inputs
    finished_step: int | None = None
    # The run's metric files, read by the job (tally.audit.reconcile.job.ReadMetrics), which then
    # sets non_finite_losses, finished, finished_step and milestones; none for a ledger's run
    # (read by SQL, in Inputs).
    metric_files: list[sp.SpoolFile] = field(default_factory=list)
    cutoffs: dict[int, int | None] = field(default_factory=dict)
    replay_ranges: list[tuple[int, int]] = field(default_factory=list)
    # Segment files written by `tally replay` from the loader's contract, not by the run
    # (tally.audit.hook.spool.is_replayed), of the run's segment files: the spool's files read, or
    # the files the ledger ingested (a ledger's run is read from an export of other files).
    replayed_files: int = 0
    segment_files: int = 0
    # The hosts that sent segment rows, ascending. Per-host counts and the host overlap are
    # indexed by a host's position here (`host_index`), so that they are sized by the hosts
    # that exist: by host number, one file of host 65,535 sized the overlap 65,536 x 65,536
    # (32 GiB) and the report listed 65,536 hosts.
    host_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # What content hashes are taken over (tally.pipeline.text.ContentBasis, JSON): the manifest's
    # ("": token ids), and each the run's files said, distinct, in file order (none: unknown).
    content_basis: str = ""
    run_content_bases: list[str] = field(default_factory=list)
    files_print: int | None = None  # see Inputs

    def host_index(self, host: np.ndarray) -> np.ndarray:
        """The positions of hosts (numbers of hosts in `host_ids`) in `host_ids`."""
        return ranks(self.host_ids, host)

    def for_workers(self) -> Plan:
        """This plan without its lists of input files, which the workers get as their tasks:
        every transform that holds the plan is pickled into the pipeline and sent to each
        worker (at the seed run's 500k spool files, the lists alone were hundreds of MB)."""
        return replace(self, files=[], metric_files=[], left_out=[])


# ---- inputs -------------------------------------------------------------------------------

@dataclass
class Inputs:
    """What a reconcile reads, and what it leaves out with the reason."""

    files: list[InputFile]
    attempts: dict[int, dict[str, Any]]
    fingerprint: str | None
    left_out: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    # Loss values logged as NaN or infinite: {"count", "first_step"}
    non_finite_losses: dict[str, Any] = field(default_factory=lambda: {"count": 0,
                                                                        "first_step": None})
    finished: dict[tuple[int, int], int] = field(default_factory=dict)  # (attempt, host) -> step
    # Held-out loss milestones with the train loss there: {"step", "heldout_loss", "train_loss"}
    milestones: list[dict[str, Any]] = field(default_factory=list)
    # A spool's metric files: the facts above are read from them by the job instead.
    metric_files: list[sp.SpoolFile] = field(default_factory=list)
    # Segment files written by `tally replay` (tally.audit.hook.spool.is_replayed), of the run's
    # segment files (None: `files`, a spool's; a ledger counts the files it ingested).
    replayed_files: int = 0
    segment_files: int | None = None
    # The hosts with segment rows (None: the hosts of `files`, a spool's).
    host_ids: list[int] | None = None
    # The content bases (JSON) the run's files said, distinct, in file order; none: unknown.
    content_bases: list[str] = field(default_factory=list)
    # `files`' fingerprint parts summed as they were gathered (tally.audit.provenance; None:
    # made from `files` when asked).
    files_print: int | None = None


# The footer keys `spool_inputs` reads, whose values a footer is kept as (a tuple, in this
# order; None: absent), the counts as ints and the values that repeat from file to file
# interned: the live reconcile keeps a footer for every file, in memory and in its checkpoint
# (Arrow's schema and every key: ~2.7 KB a file in its checkpoint; a dict of all `tally.*`
# keys: 499 B).
_FOOTER_KEYS = tuple(f"{sp.META_PREFIX}{k}" for k in (
    "rows", "first_step", "last_step", "resumed_from_step", "host_count",
    "manifest_fingerprint", "content_basis", "replayed", "writer_version"))
_COUNTS, _REPEATED = frozenset(_FOOTER_KEYS[:3]), frozenset(_FOOTER_KEYS[3:])
Footer = tuple[int | str | None, ...]


def _footer(f: sp.SpoolFile) -> Footer | None:
    """The Tally metadata `spool_inputs` reads of a spool file; None when unreadable (the
    worker says why)."""
    try:
        raw = pq.read_metadata(f.path).metadata or {}
        out = []
        for key in _FOOTER_KEYS:
            value = raw.get(key.encode())
            if value is not None:
                value = value.decode()
                if key in _REPEATED:
                    value = sys.intern(value)
                elif key in _COUNTS and value.isdigit():  # else kept: the worker says why
                    value = int(value)
            out.append(value)
        return tuple(out)
    except Exception:
        return None


def _said(footer: Footer | None) -> dict[str, int | str]:
    """A footer kept as `_footer` keeps it, as its key-value metadata ({}: none read; the
    counts as ints)."""
    return {} if footer is None else {
        k: v for k, v in zip(_FOOTER_KEYS, footer, strict=True) if v is not None}


def spool_inputs(spool: Path, run_id: str, footers: dict[str, Footer] | None = None,
                 listing: sp.Listing | None = None, memo: SpoolMemo | None = None) -> Inputs:
    """The run's published segment files. Entries under the run's directory that are not
    spool files are left out with their reason, and so is a file repeating a (attempt, host,
    step) of a file before it, the rule ingest applies (each host-step counts once).
    `footers`: the files' metadata already read, by path relative to the spool (published
    files never change),
    kept up to date here; `listing`, the spool's listing from round to round; `memo`, what
    the last call gathered file by file (the live reconcile lists the spool every round: see
    SpoolMemo)."""
    try:
        acc, strays = _gather(spool, run_id, {} if footers is None else footers, listing, memo)
    except BaseException:
        if memo is not None:  # what it holds may be half made: all again next time
            memo.gathered = None
        raise
    files = acc.files()
    if not files:
        here = sorted(p.name for p in Path(spool).iterdir()
                      if p.is_dir() and not p.name.startswith(".")) if Path(spool).is_dir() else []
        raise TallyError(f"no segment files for run {run_id!r} in spool {spool}; "
                         + (f"runs here: {', '.join(here[:10])}" + (" ..." if len(here) > 10
                                                                     else "")
                            if here else "it holds no run"))
    left_out = [(path, why) for _, path, why in sorted(strays + acc.duplicates)]
    return Inputs(files, acc.attempts_now(), acc.fingerprint[1] if acc.fingerprint else None,
                  left_out, metric_files=acc.metric_files(), replayed_files=acc.replayed,
                  segment_files=len(files),
                  content_bases=[b for b, _ in sorted(acc.bases.items(), key=lambda x: x[1])],
                  files_print=acc.printed)


def _gather(spool: Path, run_id: str, known: dict[str, Footer], listing: sp.Listing | None,
            memo: SpoolMemo | None) -> tuple[_Gathered, list[tuple[tuple, str, str]]]:
    """`spool_inputs`' files gathered, and its strays (place, path, why). With a listing and
    a memo, only the files the listing found new since the last call are taken, on top of
    what the memo holds, unless a file of the run is gone, one is published late (below its
    host directory's newest) or a footer that could not be read reads at last: then all again,
    from the listing's files."""
    def mine(entries: Iterable[tuple[sp.SpoolFile | sp.Stray, int]]) -> list:
        return [(f, size) for f, size in entries if not isinstance(f, sp.Stray)
                and f.run_id == run_id and f.kind in ("seg", "met")]

    acc = memo.gathered if memo is not None and listing is not None else None
    if listing is None:
        found = [(f, st.st_size) for f, st in sp.scan(spool)]
        new = mine(found)
    else:
        found, gone = listing.update()
        if acc is not None and any(rel.startswith(f"{run_id}/") for rel in gone):
            acc = None
        new = mine(found if acc is not None else listing.entries())
    # Footers read by a few threads (Arrow releases the GIL): the driver's serial start; 7,296
    # footers took 1.57 s one after another and 0.97 s on 4 threads (36,352 at 500M rows).
    # Those that could not be read before are read again.
    todo = [f for f, _ in new if f.kind == "seg" and f.rel not in known]
    todo += [] if acc is None else [f for f in acc.unread if f.rel not in known]
    with ThreadPoolExecutor(4) as pool:
        for f, md in zip(todo, pool.map(_footer, todo), strict=True):
            if md is not None:  # an unreadable footer is read again next time
                known[f.rel] = md
    if acc is not None and any(f.rel in known for f in acc.unread):
        # A file whose footer could not be read now can: another file than the one listed
        # (its size too), so all again, from a listing that looks at it anew.
        listing.forget(f.rel for f in acc.unread)
        found, _ = listing.update()
        acc = None
        new = mine(listing.entries())
    if acc is None or acc.late(new):
        acc, new = _Gathered(), (new if acc is None else mine(listing.entries()))
    if memo is not None and listing is not None:
        memo.gathered = acc
    for f, size in new:
        acc.take(f, known.get(f.rel), size)
    strays = [(_order(f.rel), str(f.path), f.reason) for f, _ in found
              if isinstance(f, sp.Stray) and f.rel.startswith(f"{run_id}/")]
    return acc, strays


def _order(rel: str) -> tuple:
    """Where a path falls in a listing (tally.audit.hook.spool.scan: each directory's names by
    length, then name)."""
    return tuple((len(part), part) for part in rel.split("/"))


class _Gathered:
    """What `spool_inputs` gathers from a run's files one by one, in listing order. What
    depends on the order (an attempt's facts from its first file, the fingerprint, the content
    bases in file order, what is left out) keeps each file's place, so that files taken later
    but listed earlier (another host's, of a new attempt) give what one pass in listing order
    gives; a host's files (the duplicate rule) are taken in its order: `late` says when the
    new files cannot be taken on top."""

    def __init__(self) -> None:
        # (host directory, kind) -> the place of its newest name taken
        self.newest: dict[tuple, tuple] = {}
        self.segs: dict[tuple, list[InputFile]] = {}  # host directory -> its files kept
        self.mets: dict[tuple, list[sp.SpoolFile]] = {}
        self.attempts: dict[int, dict[str, Any]] = {}
        self.first_of: dict[int, tuple] = {}  # attempt -> place of the file its facts are from
        self.fingerprint: tuple[tuple, str] | None = None  # (place, fingerprint)
        self.bases: dict[str, tuple] = {}  # content basis -> the place it was first said
        self.replayed = 0  # replayed files among those kept
        self.printed = 0  # the kept files' fingerprint parts summed (provenance.input_print)
        # (attempt, host) -> the (first, last step, path, furthest last step so far) of its files
        self.kept: dict[tuple[int, int], list[tuple[int, int, str, int]]] = {}
        self.duplicates: list[tuple[tuple, str, str]] = []  # (place, path, why)
        self.unread: list[sp.SpoolFile] = []  # files whose footer could not be read, yet

    def late(self, new: list) -> bool:
        """Whether a file of `new` (listed since the files taken) comes before the files of
        its host directory and kind taken already (a file published late, below them): then
        they cannot be taken on top."""
        for f, _ in new:
            place = _order(f.rel)
            top = self.newest.get((place[:3], f.kind))
            if top is not None and place[3] < top:
                return True
        return False

    def take(self, f: sp.SpoolFile, footer: Footer | None, size: int) -> None:
        """One file, its footer as `_footer` keeps it (None: not read)."""
        md = _said(footer)
        if footer is None and f.kind == "seg":
            self.unread.append(f)
        place = _order(f.rel)
        where = place[:3]
        self.newest[where, f.kind] = max(self.newest.get((where, f.kind), place[3]), place[3])
        if f.kind == "met":
            self.mets.setdefault(where, []).append(f)
            return
        first = last = None
        rows = 0
        try:
            rows = int(md["tally.rows"])
            resumed = md.get("tally.resumed_from_step", "")
            first, last = int(md["tally.first_step"]), int(md["tally.last_step"])
            facts = {"resumed_from_step": int(resumed) if resumed else None,
                     "host_count": int(md["tally.host_count"])}
            info = self.attempts.get(f.attempt)
            if info is None:
                info = self.attempts[f.attempt] = {**facts, "last_step": -1, "first_step": first}
                self.first_of[f.attempt] = place
            elif place < self.first_of[f.attempt]:  # the attempt's first file, listed
                info.update(facts)
                self.first_of[f.attempt] = place
            info["last_step"] = max(info["last_step"], last)
            info["first_step"] = min(info["first_step"], first)
            info["rows"] = info.get("rows", 0) + rows
            said = md.get("tally.manifest_fingerprint")
            if said and (self.fingerprint is None or place < self.fingerprint[0]):
                self.fingerprint = (place, said)
            basis = md.get(f"{sp.META_PREFIX}content_basis")
            if basis and (basis not in self.bases or place < self.bases[basis]):
                self.bases[basis] = place
            replayed = sp.is_replayed(md, sp.META_PREFIX)
        except Exception:  # the worker re-checks the file and reports why it was skipped
            replayed = False
        path = str(f.path)  # one string for the kept range and the input file
        if first is not None:
            ranges = self.kept.setdefault((f.attempt, f.host), [])
            repeat = _repeats(f, first, last, ranges)
            if repeat is not None:
                self.duplicates.append((place, path, repeat))
                return
            ranges.append((first, last, path, max(last, ranges[-1][3] if ranges else last)))
        # Replayed files counted among those read (a duplicate left out counts once, in its
        # twin).
        self.replayed += replayed
        kept = InputFile(path, f, rows, size)
        self.printed += input_print(kept)
        self.segs.setdefault(where, []).append(kept)

    def files(self) -> list[InputFile]:
        return [f for where in sorted(self.segs) for f in self.segs[where]]

    def metric_files(self) -> list[sp.SpoolFile]:
        return [f for where in sorted(self.mets) for f in self.mets[where]]

    def attempts_now(self) -> dict[int, dict[str, Any]]:
        """The attempts' facts, a copy (a caller compares them with the last call's), in
        listing order."""
        return {a: dict(self.attempts[a]) for a in sorted(
            self.attempts, key=lambda a: self.first_of[a])}


@dataclass
class SpoolMemo:
    """What `spool_inputs` gathered, kept for its next call over the same spool, run and
    `Listing` (the live reconcile's rounds): then only the files the listing found new are
    looked at. At the seed run's ~1.8M segment files a call was ~23 s, ~12 us a file, whatever
    was new; then ~2.3 us a file (13,440 files), a pass over every file listed; now what the
    listing found changed."""

    gathered: _Gathered | None = None


MILESTONE_LOSSES = ("heldout_loss", "train_loss")


def metric_facts(files: list[sp.SpoolFile], cutoffs: dict[int, int | None]) -> dict[str, Any]:
    """From metric files (effective steps only): NaN or infinite losses (count, first step),
    the step each (attempt, host) said it finished at (tally.audit.hook.spool.FINISHED), and the
    held-out and train losses summed per step (`milestones`). Vectorised per file: a Python
    loop over each file's rows cost more than reading it."""
    bad, first, finished, sums = 0, None, {}, []
    for f in files:
        try:
            table, _ = sp.read_checked(f)
        except sp.BadFile:
            continue  # the run's summary says nothing of a file it cannot read
        name = table["name"].combine_chunks()
        steps, values = table["step"].to_numpy(), table["value"].to_numpy()
        kept = effective(steps, np.full(len(steps), f.attempt), cutoffs)
        loss = (pc.ends_with(name, "loss").to_numpy(zero_copy_only=False)
                | pc.starts_with(name, "ppl/").to_numpy(zero_copy_only=False))
        nf = loss & ~np.isfinite(values) & kept
        if nf.any():
            bad += int(nf.sum())
            first = min(int(steps[nf].min()), first if first is not None else 2**63)
        done = pc.equal(name, sp.FINISHED).to_numpy(zero_copy_only=False) & kept
        if done.any():
            key = (f.attempt, f.host)
            finished[key] = max(int(steps[done].max()), finished.get(key, -1))
        for n in MILESTONE_LOSSES:
            pick = pc.equal(name, n).to_numpy(zero_copy_only=False) & kept
            if pick.any():
                sums.append((n, steps[pick].astype(np.int64), values[pick].astype(np.float64),
                             np.ones(int(pick.sum()), np.int64)))
    return {"non_finite": (bad, first), "finished": finished, "loss_sums": _summed(sums)}


def _summed(parts: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]
            ) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """(name, steps, sums, counts) pieces -> one a name, summed per step, steps ascending."""
    out = []
    for n in MILESTONE_LOSSES:
        mine = [p for p in parts if p[0] == n]
        if not mine:
            continue
        steps = np.concatenate([p[1] for p in mine])
        u, inv = np.unique(steps, return_inverse=True)
        out.append((n, u, np.bincount(inv, np.concatenate([p[2] for p in mine]), len(u)),
                    np.bincount(inv, np.concatenate([p[3] for p in mine]), len(u))
                    .astype(np.int64)))
    return out


def milestones(sums: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]
               ) -> list[dict[str, Any]]:
    """Losses summed per step (`metric_facts`' pieces, any number a name) -> each step with a
    held-out loss, its mean over hosts and the mean train loss logged at that step (None when
    none was)."""
    got = {n: (u, s / c) for n, u, s, c in _summed(sums)}
    if "heldout_loss" not in got:
        return []
    steps, heldout = got["heldout_loss"]
    train = dict(zip(*(a.tolist() for a in got["train_loss"]), strict=True)) \
        if "train_loss" in got else {}
    return [{"step": s, "heldout_loss": h, "train_loss": train.get(s)}
            for s, h in zip(steps.tolist(), heldout.tolist(), strict=True)]


def _repeats(f: sp.SpoolFile, first: int, last: int,
             ranges: list[tuple[int, int, str, int]]) -> str | None:
    """Why `f` repeats a (step, row) of a file kept before it (None: it does not), the rule
    ingest applies (tally.audit.hook.spool.first_repeat). Step ranges are compared first; rows are
    read only where two ranges overlap."""
    # Ranges carry the furthest step any range up to them reaches: walking back from the
    # newest stops where none earlier can reach `first` (a host's files come in step order, so
    # that is at once; comparing every pair cost files^2 a host, ~0.5 s a listing at 36k files).
    near = []
    for lo, hi, path, reach in reversed(ranges):
        if reach < first:
            break
        if lo <= last and hi >= first:
            near.append((lo, hi, path))
    mine = None
    for _, _, path in reversed(near):  # the earliest overlapping file first, as kept
        try:
            if mine is None:
                mine = _step_rows(f.path)
            both = sp.first_repeat(*mine, *_step_rows(path))
        except Exception:
            return None  # unreadable: the worker says why
        if both is not None:
            return (f"duplicate: row {both[1]} of step {both[0]} of host {f.host}, attempt "
                    f"{f.attempt} is already in {path} (a copy of a file, or a writer "
                    "restarted within its attempt); counted once, from that file")
    return None


def run_finished(attempts: dict[int, dict[str, Any]], finished: dict[tuple[int, int], int],
                 at_step: int | None = None) -> tuple[bool, int | None]:
    """(finished, at step): every host of the run's last attempt said it finished, by
    `at_step` when the audit is as of a step (a run that finished at step 20 had not finished
    as of step 6: its report said "the run finished in epoch 0" there)."""
    if not attempts:
        return False, None
    last = max(attempts)
    steps = [finished.get((last, h)) for h in range(attempts[last]["host_count"])]
    if any(s is None for s in steps) or (at_step is not None and max(steps) > at_step):
        return False, None
    return True, max(steps)


def _step_rows(path: str | Path) -> tuple[Any, Any]:
    t = pq.read_table(path, columns=["step", "row"])
    return t["step"].to_numpy(), t["row"].to_numpy()


def ledger_inputs(ledger_path: Path, run_id: str, workdir: Path,
                  folder: str = "export") -> Inputs:
    """The run's rows exported from the ledger as Parquet files under `workdir / folder`."""
    with Ledger(ledger_path, read_only=True) as ledger:
        run = ledger.query("SELECT run, manifest_fingerprint FROM runs WHERE run_id = ?",
                           [run_id])
        if not run:
            raise TallyError(f"run {run_id!r} is not in ledger {ledger_path}")
        basis = ledger.run_content_basis(run[0]["run"])
        rows = ledger.query("""
            SELECT a.attempt, a.resumed_from_step, a.host_count, min(h.step) AS first_step,
                   max(h.step) AS last_step, coalesce(sum(h.segments), 0) AS rows
            FROM attempts a LEFT JOIN agg_steps h USING (run, attempt)
            WHERE a.run = ? GROUP BY ALL""", [run[0]["run"]])
        attempts = {r["attempt"]: {"resumed_from_step": r["resumed_from_step"],
                                   "host_count": r["host_count"],
                                   "first_step": r["first_step"],
                                   "last_step": r["last_step"] if r["last_step"] is not None
                                   else -1, "rows": int(r["rows"])} for r in rows}
        out = workdir / folder
        target = str(out).replace("'", "''")  # a path is no SQL parameter in COPY ... TO
        ledger.con.execute(f"""
            COPY (SELECT attempt, {sql_select(SEGMENT_COLUMNS_ALL)}
                  FROM consumption WHERE run = {int(run[0]['run'])})
            TO '{target}' (FORMAT parquet, PER_THREAD_OUTPUT true, FILE_SIZE_BYTES '64MB')""")
        # Files of the run the ingester set aside, with its reason (paths under the spool).
        cur = ledger.cursor()
        try:
            quarantined = quarantined_of(cur, run_id)
            non_finite = non_finite_losses(cur, int(run[0]["run"]))
            finished = finished_hosts(cur, int(run[0]["run"]))
            losses = cur.execute(f"""
                SELECT m.name, m.step, sum(m.value) AS s, count(*) AS c FROM metrics m
                JOIN attempts a USING (run, attempt) WHERE m.run = ? AND {effective_sql("m", "a")}
                  AND m.name IN ('heldout_loss', 'train_loss') GROUP BY ALL""",
                                 [int(run[0]["run"])]).fetchnumpy()
            marked = replayed_of(cur, int(run[0]["run"]))
            host_ids = [h for (h,) in cur.execute(
                "SELECT DISTINCT host FROM agg_steps WHERE run = ? ORDER BY host",
                [int(run[0]["run"])]).fetchall()]
        finally:
            cur.close()
    files = [InputFile(str(p), rows=pq.read_metadata(p).num_rows)
             for p in sorted(out.glob("*.parquet"))]
    names = np.asarray(losses["name"], object)
    sums = [(n, np.asarray(losses["step"], np.int64)[names == n],
             np.asarray(losses["s"], np.float64)[names == n],
             np.asarray(losses["c"], np.int64)[names == n]) for n in MILESTONE_LOSSES]
    return Inputs(files, attempts, run[0]["manifest_fingerprint"], quarantined, non_finite,
                  finished, milestones(sums), replayed_files=marked["replayed_files"],
                  segment_files=marked["segment_files"], host_ids=host_ids,
                  content_bases=[basis] if basis else [])


def loss_window(span: int) -> int:
    """Steps per window of the loss by exposure rank for a run spanning `span` steps: the
    smallest power of two that cuts the span into at most LOSS_WINDOWS windows."""
    return 1 << max(0, (-(-max(span, 1) // LOSS_WINDOWS) - 1).bit_length())


def check_span(what: str, first: int, last: int, memory_gb: float, job: str) -> None:
    """Refuse a span of steps whose per-step series would not fit in `memory_gb`."""
    span = last - first + 1
    need = span * STEP_BYTES[job]
    if need > memory_gb * 2**30:
        raise TallyError(
            f"{what} steps {first:,}..{last:,} ({span:,} steps): the {job}'s per-step "
            f"series would need about {need / 2**30:,.1f} GiB, more than --memory-gb "
            f"{memory_gb:g} allows; raise --memory-gb, or cut the span with --at-step")


def in_flight(parallel: int | None) -> int:
    """Buckets in memory at once when the runner works on `parallel` elements at once (None:
    its cluster decides)."""
    return max(BUCKETS_IN_FLIGHT, (parallel or 0) + 1)


def bucket_records_for(records: int, rows: int, hosts: int, memory_gb: float,
                       buckets_in_flight: int = BUCKETS_IN_FLIGHT) -> int:
    """Records per bucket: the most that keep `buckets_in_flight` buckets of `rows` consumption
    rows spread over `records` records within `memory_gb`, and each bucket under BUCKET_ROWS.
    A job over two runs (tally.audit.posthoc.diff) passes both runs' rows: a bucket holds both."""
    per_record = rows / max(records, 1) * BYTES_PER_ROW + BYTES_PER_RECORD + hosts
    out = min(int(memory_gb * 2**30 / buckets_in_flight / per_record),
              int(BUCKET_ROWS * records / max(rows, 1)))
    return min(max(out, 10_000), 4_000_000)


@dataclass(frozen=True)
class PlanOptions:
    """What a job asks of its plan beyond its inputs."""

    at_step: int | None = None  # the audit as of this step (None: every step consumed)
    # Records per key bucket (None: the most that keep `in_flight` buckets within `memory_gb`).
    bucket_records: int | None = None
    memory_gb: float = 3.0  # the memory the buckets in flight, and the per-step series, may take
    in_flight: int = BUCKETS_IN_FLIGHT  # buckets in memory at once (`in_flight(...)`)
    job: str = "reconcile"  # reconcile | diff: the bytes of its per-step series (STEP_BYTES)


def make_plan(run_id: str, manifest: str | Path, inputs: Inputs,
              options: PlanOptions = PlanOptions()) -> Plan:
    """The plan of `run_id`'s job over `inputs` against `manifest`. `options.bucket_records`
    sets the key range each bucket covers, and `options.memory_gb` bounds the span of steps the
    job keeps per-step series over (check_span). The hosts with segment rows are
    `inputs.host_ids` (default: those of its files, a spool's; a ledger's export says none)."""
    from tally.pipeline.manifest_file import manifest_info, uniform_row_groups

    files, attempts, at_step = inputs.files, inputs.attempts, options.at_step
    host_ids, memory_gb = inputs.host_ids, options.memory_gb
    info = manifest_info(manifest)
    records, train = int(info["records"]), int(info["train_records"])
    hosts = max([a["host_count"] for a in attempts.values()] + [1])
    if host_ids is None:
        host_ids = [f.spool_file.host for f in files if f.spool_file is not None]
    ids = np.unique(np.asarray(host_ids, np.int64))
    rows = sum(a.get("rows", 0) for a in attempts.values())
    bucket_records = options.bucket_records
    if bucket_records is None:
        bucket_records = bucket_records_for(records, rows, max(len(ids), 1), memory_gb,
                                            options.in_flight)
    bucket_records = min(bucket_records, 2**31)  # bucket files keep key offsets in uint32
    buckets = max(1, -(-records // bucket_records))
    bucket_size = -(-records // buckets)  # equal buckets
    group = uniform_row_groups(pq.read_metadata(manifest))
    if group and bucket_records >= group:  # whole row groups instead: none decoded twice
        bucket_size = bucket_records - bucket_records % group
        buckets = max(1, -(-records // bucket_size))
    plan = Plan(run_id=run_id, files=files, attempts=attempts, manifest=str(manifest),
                records=records, train_records=train, fingerprint=info["manifest_fingerprint"],
                run_fingerprint=inputs.fingerprint, at_step=at_step, hosts=hosts,
                bucket_size=bucket_size, buckets=buckets, rows=rows, left_out=inputs.left_out,
                non_finite_losses=inputs.non_finite_losses)
    plan.finished, plan.finished_step = run_finished(attempts, inputs.finished, at_step)
    plan.milestones = inputs.milestones
    plan.metric_files = inputs.metric_files
    plan.files_print = inputs.files_print
    plan.replayed_files = inputs.replayed_files
    plan.segment_files = len(files) if inputs.segment_files is None else inputs.segment_files
    plan.host_ids = ids
    plan.content_basis = info.get("content_basis", "")
    plan.run_content_bases = list(inputs.content_bases)
    last = max([a["last_step"] for a in attempts.values()] + [0])
    if at_step is not None:
        last = min(last, at_step)
    firsts = [a["first_step"] for a in attempts.values() if a.get("first_step") is not None]
    plan.first_step = min(firsts, default=0)
    span = last - plan.first_step + 1
    if span > MAX_RUN_STEPS:
        raise TallyError(f"run {run_id!r} spans steps {plan.first_step}..{last}, "
                         f"{span:,} steps: a run may span at most {MAX_RUN_STEPS:,}")
    check_span(f"run {run_id!r} spans", plan.first_step, last, memory_gb, options.job)
    plan.loss_window = loss_window(span)
    plan.cutoffs = rolled_back_from({a: v["resumed_from_step"] for a, v in attempts.items()})
    for a, cut in plan.cutoffs.items():
        last = attempts[a]["last_step"]
        if at_step is not None:
            last = min(last, at_step)
        if cut is not None and last >= cut:
            plan.replay_ranges.append((cut, last))
    return plan
