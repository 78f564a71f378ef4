"""The live reconcile: a run's report kept current round by round, each round folding in only
what the spool gained since the last (`tally reconcile --spool S --follow SECONDS`; the live
service runs one per run for its findings, api/findings.py).

A round costs what its new rows touch, not what the run consumed. Every per-record statistic
of the reconcile (tally.audit.reconcile.bucket_stats.compute: exposures, ranks within an
epoch, first-seen steps, host sets, hash checks, the loss by exposure rank) depends on one
record's rows only. So for the records R that a round's new rows touch, the round computes
their contribution twice with the job's own code, over R's rows before the round (fetched from
a store of every row read so far by key, tally.audit.reconcile.row_store) and over R's rows
after it, and replaces the first by the second in the running totals: records not in R
contribute what they did. Summed fields are replaced by subtraction; the evidence lists (the
lowest example rows, the most repeated records) by taking R's entries out and R's new ones in,
which is exact while rows are only added; the never-seen records come from a bit a train record
(seen or not); the highest exposure rank per step only grows while rows are only added.

Per-file partials (per step, per host, what each host consumed step by step) are made once per
file as the job's read stage makes them; replay comparisons are made again for the rolled-back
steps a round's files touch; metric facts once per metric file.

A new attempt that rolls rows back is folded out the same way: the records of the rows it
rolls back (read from the files that hold them) have their contribution under the old cutoffs
replaced by theirs under the new; the per-file partials of the blocks of steps it reaches are
made again, and the replay comparisons. What is not folded in but recomputed from the stored
rows (a full pass, the job's own merge over key ranges): a rollback whose removed rows took
entries out of an evidence list that only the other records could refill, a run whose first
step moves earlier (the loss windows start there), and a file read before that the spool's
listing now leaves out (a duplicate of a file listed before it). Loss windows are powers of two
(tally.audit.buckets.plan.loss_window), so that a longer run merges pairs of windows.

So the report is the one `tally reconcile --spool` writes over the same files (the same
findings, verdict and numbers; tests/test_follow.py compares them after each of many rounds,
with resumes and files published late), except: no per-record table (records/), and the
loss sums, added and subtracted in another order, agree to floating-point rounding.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from tally.audit.buckets.partials import (
    EVIDENCE,
    EXAMPLES,
    MaxSpans,
    Partial,
    Spans,
    merge_all,
    total,
)
from tally.audit.buckets.plan import (
    Footer,
    Plan,
    PlanOptions,
    SpoolMemo,
    make_plan,
    spool_inputs,
)
from tally.audit.buckets.stages import effective_rows, file_partial, replay_rows
from tally.audit.core.errors import TallyError
from tally.audit.core.exposure import effective
from tally.audit.core.paths import atomic_write
from tally.audit.hook.spool import BadFile, Listing
from tally.audit.reconcile import bucket_stats
from tally.audit.reconcile import report as rp
from tally.audit.reconcile.job import CompareReplay, metric_partial, with_metric_facts
from tally.audit.reconcile.row_store import COLUMNS, Rows, RowStore, concat
from tally.pipeline.manifest_file import ROW_GROUP_RECORDS, check_key_order, manifest_info

# New rows folded in at a time, and records a full pass computes at a time: the rows of a
# fold's records (before and after) and their manifest columns stay within a few hundred MB.
FOLD_ROWS = 2_000_000
FOLD_KEYS = 500_000  # records a rollback folds out at a time (their rows before and after)
PASS_RECORDS = 2_000_000
FILE_BLOCK = 4096  # steps a block of per-file partials covers (by the file's first step)
# The evidence lists: their order, and how many entries the report shows. The follower keeps
# DEEP of each, so that a rollback taking entries out of one still leaves the report's.
DEEP = 256
# The checkpoint: its file in OUT/.follow/, and at most how old it gets while rounds go on,
# unless writing it takes more than CHECKPOINT_SHARE of that time: its pickle grows with the
# run's files (~230 bytes a file: ~0.8 GB at the seed run's ~3.6M), and rewriting it every
# minute would be most of the follower's work there.
CHECKPOINT = "checkpoint.pickle"
CHECKPOINT_S = 60.0
CHECKPOINT_SHARE = 0.05
# Of the checkpoint: one of another format is not read (4: edges fused, footers by path in
# the spool; 5: each domain's exposure levels, overall and by epoch).
_FORMAT = 5
# The follower's state a checkpoint keeps as it is (besides the store, the manifest cache and
# the seen bits).
_SAVED = ("_footers", "plan", "rounds", "full_passes", "files", "file_parts", "blocks",
          "metric_done", "metrics", "replay", "acc", "complete")
_PER_HOST = ("host_segments", "host_exposures", "host_tokens", "host_unique",
             "host_overlap_with_others", "epoch_repeats_by_host", "epoch_duplicated_by_host")


class _Manifest:
    """The manifest's columns a record statistic needs, by record key, memory-mapped from a
    cache built once (`<work>/manifest.npy`, 20 bytes a record): content hash, length, and the
    domain's and source's codes into names kept in memory."""

    DTYPE = np.dtype([("hash", "<u8"), ("n_tokens", "<i4"), ("domain", "<i4"),
                      ("source", "<i4")])

    def __init__(self, path: str, work: Path) -> None:
        info = manifest_info(path)
        self.records, self.train = int(info["records"]), int(info["train_records"])
        names: dict[str, dict[str, int]] = {"domain": {}, "source": {}}
        table = np.lib.format.open_memmap(work / "manifest.npy", "w+", self.DTYPE,
                                          (self.records,))
        done = 0
        f = pq.ParquetFile(path, read_dictionary=["domain", "source"])
        for batch in f.iter_batches(columns=["record_key", "content_hash", "n_tokens",
                                             "split", "domain", "source"],
                                    batch_size=ROW_GROUP_RECORDS):
            keys = check_key_order(path, batch.column(0), batch.column(3), done, self.train)
            part = table[done:done + len(keys)]
            part["hash"] = batch.column(1).to_numpy()
            part["n_tokens"] = batch.column(2).to_numpy()
            for col, at in (("domain", 4), ("source", 5)):
                enc = batch.column(at)
                lut = np.array([names[col].setdefault(v, len(names[col]))
                                for v in enc.dictionary.to_pylist()] or [0], np.int32)
                part[col] = lut[enc.indices.fill_null(0).to_numpy()]
            done += len(keys)
        table.flush()  # msync: on disk before any checkpoint names it
        self.table = np.load(work / "manifest.npy", mmap_mode="r")
        self.names = {k: list(v) for k, v in names.items()}

    def saved(self) -> dict[str, Any]:
        return {"records": self.records, "train": self.train, "names": self.names}

    @classmethod
    def reopen(cls, work: Path, saved: dict[str, Any]) -> _Manifest:
        """The cache a checkpoint's `saved()` describes, mapped again (ValueError: not it)."""
        man = cls.__new__(cls)
        man.records, man.train, man.names = saved["records"], saved["train"], saved["names"]
        man.table = np.load(work / "manifest.npy", mmap_mode="r")
        if man.table.dtype != cls.DTYPE or man.table.shape != (man.records,):
            raise ValueError("the manifest cache is not the manifest's")
        return man

    def columns(self, keys: np.ndarray) -> dict[str, Any]:
        """The manifest columns of `keys` (sorted, in the manifest) as
        tally.audit.buckets.stages.manifest_bucket gives a bucket's."""
        rows = self.table[keys]
        return {"record_key": keys, "content_hash": rows["hash"],
                "n_tokens": rows["n_tokens"],
                "split": (keys >= self.train).astype(np.int32),
                "split_names": ["train", "heldout"],
                "domain": rows["domain"], "domain_names": self.names["domain"],
                "source": rows["source"], "source_names": self.names["source"]}


def _negated(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _negated(x) for k, x in v.items()}
    if isinstance(v, Spans):
        return Spans([(p, -c) for p, c in v.pieces])
    return -v


def _trimmed(a: np.ndarray) -> np.ndarray:
    """`a` without its trailing all-zero entries (along its first axis): the job's arrays
    end at their last count, and a total that fell to zero there must too."""
    if not a.size:
        return a[:0]
    nz = np.flatnonzero(a.reshape(len(a), -1).any(axis=1))
    return a[: nz[-1] + 1] if nz.size else a[:0]


def _in(keys: np.ndarray, entries: list[dict]) -> list[bool]:
    """Whether each entry's record key is one of `keys` (sorted)."""
    if not entries:
        return []
    k = np.array([e["record_key"] for e in entries], np.int64)
    at = np.minimum(np.searchsorted(keys, k), max(len(keys) - 1, 0))
    return (keys[at] == k).tolist() if len(keys) else [False] * len(entries)


def _rehost(p: Partial, pos: np.ndarray, n: int) -> None:
    """`p`'s per-host arrays, indexed by the run's old hosts, moved to positions `pos` of `n`
    hosts (a host that appeared in between counts zero until now)."""
    for name in _PER_HOST:
        a = getattr(p, name)
        if len(a):
            out = np.zeros(n, a.dtype)
            out[pos] = a
            setattr(p, name, out)
    if p.overlap.size:
        out = np.zeros((n, n), p.overlap.dtype)
        out[np.ix_(pos, pos)] = p.overlap
        p.overlap = out


class Follower:
    """One run's live reconcile (the module's doc). `round()` brings the report in `out` up to
    date with the spool and returns it (None when the spool has nothing new); `out/follow.json`
    says what the last round did (its number, when it began, seconds, full passes so far, rows
    stored)."""

    def __init__(self, spool: Path, manifest: str | Path, run_id: str, out: Path,
                 memory_gb: float = 3.0, api_url: str | None = None) -> None:
        """Resumed from the checkpoint in `out/.follow/` when it is this run's over the same
        spool and manifest (`resumed_from`: its round; `set_aside`: why one found was not
        used), else started afresh there."""
        self.spool, self.run_id = Path(spool).absolute(), run_id
        self.manifest = str(Path(manifest).absolute())
        self.out, self.memory_gb, self.api_url = Path(out).absolute(), memory_gb, api_url
        self.work = self.out / ".follow"
        self._footers: dict[str, Footer] = {}
        # Not checkpointed: the first round after a start lists and gathers anew.
        self._listing, self._memo = Listing(self.spool), SpoolMemo()
        self.plan: Plan | None = None
        self.rounds = self.full_passes = 0
        info, st = manifest_info(self.manifest), os.stat(self.manifest)
        # The manifest cache is made from the file: the same file, unchanged, or none of it.
        self._identity = {"format": _FORMAT, "spool": str(self.spool), "run_id": run_id,
                          "manifest": self.manifest,
                          "fingerprint": info["manifest_fingerprint"],
                          "records": int(info["records"]),
                          "manifest_file": (st.st_size, st.st_mtime_ns)}
        self.resumed_from: int | None = None
        self.set_aside = self._resume()
        if self.resumed_from is None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work.mkdir(parents=True)
            self.man = _Manifest(self.manifest, self.work)
            self._reset()
        self._saved_at, self._unsaved = time.monotonic(), False
        self.last_save_s: float | None = None
        # Resumed: the checkpoint's paths are strings of their own, until `_share_keys`.
        self._keys_apart = self.resumed_from is not None

    def _reset(self) -> None:
        self.store = RowStore(self.work / "rows")
        self.files: dict[str, tuple[int, int, int]] = {}  # path -> attempt, first, last step
        # (attempt, block of FILE_BLOCK steps by a file's first step) -> its files' partials,
        # merged, and their paths: a rollback makes again only the blocks it reaches.
        self.file_parts: dict[tuple[int, int], Partial] = {}
        self.blocks: dict[tuple[int, int], list[str]] = {}
        self.metric_done: set[str] = set()
        self.metrics = Partial()
        self.replay: dict[int, list[Partial]] = {}  # step -> its comparisons
        self.acc = Partial()  # the key buckets' partials, merged
        # Whether each evidence list of `acc` holds every entry there is (else the first ones).
        self.complete = dict.fromkeys(_LISTS, True)
        self.seen = np.zeros(self.man.train, bool)  # train records with an exposure

    # ---- the checkpoint ------------------------------------------------------------------

    def _resume(self) -> str | None:
        """The state of the checkpoint in `work`, when it is this run's over this spool and
        manifest (sets `resumed_from`); else why it was set aside (None: there was none)."""
        path = self.work / CHECKPOINT
        if not path.exists():
            return None
        try:
            with open(path, "rb") as f:
                saved = pickle.load(f)
            if not isinstance(saved, dict) or saved.get("identity") != self._identity:
                return "it is another run's, spool's or manifest's (or of another version)"
            man = _Manifest.reopen(self.work, saved["manifest"])
            store = RowStore.reopen(self.work / "rows", saved["store"])
            seen = np.unpackbits(saved["seen"], count=man.train).astype(bool)
        except Exception as exc:  # derived data: whatever is wrong with it, a full pass mends
            return f"unreadable ({type(exc).__name__}: {exc})"
        self.man, self.store, self.seen = man, store, seen
        for name in _SAVED:
            setattr(self, name, saved[name])
        self.resumed_from = self.rounds
        return None

    def checkpoint(self) -> None:
        """The state down on disk as the next start resumes from it, when a round changed it
        since the last checkpoint."""
        if not self._unsaved:
            return
        t0 = time.monotonic()
        state = {"identity": self._identity, "manifest": self.man.saved(),
                 "store": self.store.save(), "seen": np.packbits(self.seen),
                 **{name: getattr(self, name) for name in _SAVED}}
        if self.plan is not None:  # its lists of files are not read again (a start lists
            # the spool anew): 228 bytes a file
            state["plan"] = dataclasses.replace(self.plan, files=[], metric_files=[])
        with atomic_write(self.work / CHECKPOINT, self.work / f"{CHECKPOINT}.tmp") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
        self.store.committed()  # the runs it no longer names go only now
        self._saved_at, self._unsaved = time.monotonic(), False
        self.last_save_s = round(self._saved_at - t0, 3)

    # ---- a round -----------------------------------------------------------------------

    def round(self) -> dict | None:
        t0, began = time.monotonic(), time.time()
        gathered = self._memo.gathered
        inputs = spool_inputs(self.spool, self.run_id, self._footers, self._listing,
                              self._memo)
        plan = make_plan(self.run_id, self.manifest, inputs,
                         PlanOptions(memory_gb=self.memory_gb))
        if self._keys_apart or self._memo.gathered is not gathered:  # new path strings
            self._share_keys(plan)
        new = [f for f in plan.files if f.path not in self.files]
        new_metrics = [f for f in plan.metric_files if str(f.path) not in self.metric_done]
        old = self.plan
        if old is not None and not new and not new_metrics and \
                plan.left_out == old.left_out and plan.attempts == old.attempts:
            self.checkpoint()  # nothing new: a quiet moment
            return None
        passes = self.full_passes
        try:
            self._update(plan, old, new, new_metrics)
            self.plan = plan
            self.rounds += 1
            report = self._report(plan)
        except BaseException:
            # A round that failed half way left the state half made: it is never checkpointed,
            # and the next round makes a full pass.
            self.plan, self._unsaved = None, False
            raise
        self._unsaved = True
        every = max(CHECKPOINT_S, (self.last_save_s or 0.0) / CHECKPOINT_SHARE)
        if self.full_passes != passes or time.monotonic() - self._saved_at >= every:
            self.checkpoint()
        status = {"round": self.rounds, "began_at": began,
                  "seconds": round(time.monotonic() - t0, 3),
                  "full_passes": self.full_passes, "rows": self.store.rows,
                  "files": len(self.files), "as_of_step": report["consumption"]["last_step"],
                  "verdict": report["verdict"], "resumed_from_round": self.resumed_from,
                  "checkpoint_s": self.last_save_s}
        self._status(status)
        return report

    def _share_keys(self, plan: Plan) -> None:
        """After a resume (or files gathered anew), the paths its files and footers are kept
        by made the same strings as the plan's and the listing's (a copy each was ~225 of
        ~1,250 bytes a file of a resumed follower, tracemalloc)."""
        paths = {f.path: f.path for f in plan.files}
        self.files = {paths.get(p, p): v for p, v in self.files.items()}
        self.blocks = {b: [paths.get(p, p) for p in ps] for b, ps in self.blocks.items()}
        rels = {f.rel: f.rel for f, _ in self._listing.entries()}
        self._footers = {rels.get(r, r): v for r, v in self._footers.items()}
        self._keys_apart = False

    def _update(self, plan: Plan, old: Plan | None, new: list, new_metrics: list) -> None:
        """The state brought up to `plan`: folded in, folded out, or a full pass."""
        paths = {f.path for f in plan.files}
        if old is None or plan.first_step != old.first_step or plan.records != old.records \
                or any(p not in paths for p in self.files):
            # A file read before and now left out (a duplicate of a new file listed before
            # it) is undone with the rest.
            self._full(plan)
        else:
            if not np.array_equal(plan.host_ids, old.host_ids):
                pos = np.searchsorted(plan.host_ids, old.host_ids)
                for p in (self.acc, *self.file_parts.values()):
                    _rehost(p, pos, len(plan.host_ids))
            if plan.loss_window != old.loss_window:
                self._rebin(old.loss_window, plan.loss_window)
            if plan.cutoffs != old.cutoffs and not self._roll_back(old, plan):
                self._full(plan)  # the evidence lists lost entries only a full pass finds
            else:
                self._fold_files(plan, new)
                if plan.cutoffs != old.cutoffs:  # metric facts count effective steps only
                    self.metrics = metric_partial(plan, plan.metric_files)
                elif new_metrics:
                    self.metrics = self.metrics.merge(metric_partial(plan, new_metrics))
                self.metric_done = {str(f.path) for f in plan.metric_files}

    def waiting(self, why: str) -> None:
        """Said in follow.json when a round could not be made (no segment file yet, or a
        spool the job refuses): the last report stands meanwhile."""
        self._status({"round": self.rounds, "began_at": time.time(), "waiting": why})

    def _status(self, status: dict) -> None:
        tmp = self.out / ".follow.json.tmp"
        tmp.write_text(json.dumps(status))
        os.replace(tmp, self.out / "follow.json")  # what a round did, for `tally serve`

    # ---- files --------------------------------------------------------------------------

    def _read(self, plan: Plan, f) -> tuple[Rows | None, list[tuple[int, tuple]]]:
        """One new file: its partial kept, its effective rows as the store keeps them (None:
        unreadable), its replay rows."""
        attempt = f.spool_file.attempt
        block = (attempt, f.spool_file.first_step // FILE_BLOCK)
        self.blocks.setdefault(block, []).append(f.path)
        try:
            cols, rolled = effective_rows(f, plan)
        except BadFile as exc:
            self._add_part(block, Partial(skipped=1, skipped_files=[(f.path, str(exc))]))
            self.files[f.path] = (attempt, 0, -1)
            return None, []
        steps = cols["step"]
        every = np.concatenate([steps, rolled["step"]])  # rolled-back steps are compared too
        self.files[f.path] = (attempt, int(every.min()) if len(every) else 0,
                              int(every.max()) if len(every) else -1)
        if len(steps):
            self._add_part(block, file_partial(plan, cols))
        rows = {"key": cols["record_key"], "step": steps,
                "host": cols["host"].astype(np.uint16), "start": cols["offset"] == 0,
                **{k: cols[k].astype(COLUMNS[k], copy=False)
                   for k in ("n_tokens", "content_hash", "epoch", "loss", "attempt")}}
        return rows, list(replay_rows(plan, cols, rolled))

    def _add_part(self, block: tuple[int, int], p: Partial) -> None:
        self.file_parts[block] = self.file_parts.get(block, Partial()).merge(p)

    def _batches(self, plan: Plan, files: list, steps: set[int], *, always: bool = False
                 ) -> Iterator[Rows]:
        """The effective rows of `files` as the store keeps them, FOLD_ROWS at a time (the
        last batch: when a readable file is left in it, or `always`); the steps their replay
        rows hold go into `steps`."""
        pending: list[Rows] = []
        held = 0  # rows in pending (summed again a file, it was quadratic in the files: 67 of
        for f in files:  # 147 CPU s of a full pass over 13,056 files of 10 rows)
            rows, replay = self._read(plan, f)
            steps.update(s for s, _ in replay)
            if rows is not None:
                pending.append(rows)
                held += len(rows["key"])
            if held >= FOLD_ROWS:
                yield concat(pending)
                pending, held = [], 0
        if pending or always:
            yield concat(pending)

    def _fold_files(self, plan: Plan, files: list) -> None:
        replay_steps: set[int] = set()
        for rows in self._batches(plan, files, replay_steps):
            self._fold(plan, rows)
        if replay_steps:
            self._compare(plan, replay_steps)

    # ---- a new attempt's rollback ---------------------------------------------------------

    def _roll_back(self, old: Plan, plan: Plan) -> bool:
        """The rows the new cutoffs roll back (of files read before), folded out: their
        records' contribution under the old cutoffs replaced by theirs under the new; the
        blocks of per-file partials they reach made again, and every replay comparison. False
        when an evidence list lost entries that only a full pass can replace."""
        changed = {a: cut for a, cut in plan.cutoffs.items()
                   if cut is not None and cut != old.cutoffs.get(a)}
        hit = [p for p, (a, _, last) in self.files.items() if a in changed and last >= changed[a]]
        if not hit:
            return True  # a clean resume: nothing was consumed past its checkpoint
        by_path = {f.path: f for f in plan.files}
        keys = []
        for path in hit:
            try:
                cols, _ = effective_rows(by_path[path], old)
            except BadFile:
                continue
            keys.append(cols["record_key"][cols["step"] >= changed[self.files[path][0]]])
        cut = min(changed.values())
        removed = np.unique(np.concatenate(keys)) if keys else np.zeros(0, np.int64)
        for part in (removed[removed < self.man.records], removed[removed >= self.man.records]):
            for i in range(0, len(part), FOLD_KEYS):  # a long rollback, a few records at a time
                keys = part[i:i + FOLD_KEYS]
                before = self.store.fetch(keys)
                if not self._delta(plan, keys, before, before, old.cutoffs, cut):
                    return False
        for block in {(self.files[p][0], by_path[p].spool_file.first_step // FILE_BLOCK)
                      for p in hit}:
            self.file_parts.pop(block, None)
            for path in self.blocks.pop(block):
                self._read(plan, by_path[path])  # its partial again, under the new cutoffs
        self.replay = {}
        steps = {s for lo, hi in plan.replay_ranges for s in range(lo, hi + 1)}
        if steps:
            self._compare(plan, steps)
        self.acc.never_seen_examples = self._never_seen()
        return True

    # ---- the per-record statistics ------------------------------------------------------

    def _rows(self, rows: Rows, pos: np.ndarray | None,
              cutoffs: dict[int, int | None]) -> dict[str, np.ndarray]:
        """Stored rows as a bucket's columns for `compute`: those effective under `cutoffs`,
        each key as `pos`, its record's position in the records computed (None: whole keys,
        the overflow)."""
        kept = effective(rows["step"], rows["attempt"], cutoffs)
        c = {k: v[kept] for k, v in rows.items() if k != "attempt"}
        if pos is not None:
            c["key"] = pos[kept]
        return c

    def _compute(self, plan: Plan, man: dict | None, c: dict) -> tuple[Partial, Any]:
        return bucket_stats.compute(man, c, plan.host_ids, plan.loss_window, plan.first_step,
                                    keep=DEEP, evidence=DEEP)

    def _fold(self, plan: Plan, new: Rows) -> None:
        """Fold `new` rows (effective, not yet stored) into the totals."""
        known = new["key"] < self.man.records
        for part in (known, ~known):
            if part.any():
                rows = {k: v[part] for k, v in new.items()}
                keys, at = np.unique(rows["key"], return_inverse=True)
                before, was = self.store.fetch(keys)
                self._delta(plan, keys, (before, was),
                            (concat([before, rows]), np.concatenate([was, at])),
                            plan.cutoffs, None)
        self.store.add(new)
        self.acc.never_seen_examples = self._never_seen()

    def _delta(self, plan: Plan, keys: np.ndarray, before: tuple[Rows, np.ndarray],
               after: tuple[Rows, np.ndarray], was: dict[int, int | None],
               cut: int | None) -> bool:
        """The contribution of `keys`' records (all in the manifest, or all beyond it) over
        `before` (effective under the cutoffs `was`) replaced by theirs over `after` (under the
        plan's); each with its rows' positions in `keys`. `cut`: rows were removed, at this
        step and later only (a rollback), rather than added. False when an evidence list
        cannot be made exact without a full pass."""
        whole = keys[0] >= self.man.records
        man = None if whole else self.man.columns(keys)
        old, _ = self._compute(plan, man, self._rows(before[0], None if whole else before[1],
                                                     was))
        now, records = self._compute(plan, man, self._rows(after[0], None if whole else after[1],
                                                           plan.cutoffs))
        if not self._replace(old, now, keys, cut):
            return False
        if records is not None:
            train = keys < self.man.train
            self.seen[keys[train]] = records.column("exposures").to_numpy()[train] > 0
        return True

    def _replace(self, old: Partial, now: Partial, keys: np.ndarray, cut: int | None) -> bool:
        """The totals with `keys`' records' contribution `old` replaced by `now` (`cut`: see
        `_delta`). Summed fields by subtraction. An evidence list (the lowest example rows,
        the most repeated records), kept DEEP long here, takes out the records' entries and
        merges their new ones, keeping only the entries no record outside both lists can
        outrank; False when fewer than the report shows are left (a rollback took out
        entries that only the other records' rows could replace). The highest exposure rank
        per step only grows while rows are added; a rollback removes rows at its cut and
        later, where every effective row left is one of `keys`' records, and changes no rank
        before it."""
        acc = self.acc
        for name, (rank, size) in _LISTS.items():
            a, mine = getattr(acc, name), getattr(now, name)
            kept = [e for e, t in zip(a, _in(keys, a), strict=True) if not t]
            cand = sorted(kept + mine, key=rank)
            # Entries ranking after `limit` may be outranked by ones no list holds: a record
            # left out of this list (it was full), or a row of these records beyond their own
            # DEEP (theirs was full).
            limit = None if self.complete[name] else rank(a[-1])
            if len(mine) >= DEEP:
                limit = rank(mine[-1]) if limit is None else min(limit, rank(mine[-1]))
            if limit is None:
                out, self.complete[name] = cand[:DEEP], len(cand) <= DEEP
            else:
                out, self.complete[name] = [e for e in cand if rank(e) <= limit][:DEEP], False
                if len(out) < size:
                    return False
            setattr(acc, name, out)
        for f in dataclasses.fields(Partial):
            name, merge = f.name, f.metadata["merge"]
            a, o, n = getattr(acc, name), getattr(old, name), getattr(now, name)
            if isinstance(n, MaxSpans):
                if cut is not None:
                    lo = a.first()
                    a = MaxSpans([(lo, a.dense(lo, cut - 1))] if lo is not None else [])
                out = a + n
            elif merge is total and not isinstance(n, list):
                out = total(a, total(n, _negated(o)))
            else:
                continue
            setattr(acc, name, out)
        acc.exposure_counts = _trimmed(acc.exposure_counts)
        acc.records_by_epoch = _trimmed(acc.records_by_epoch)
        for name in ("domain_levels", "domain_epoch_levels"):
            setattr(acc, name, {d: _trimmed(v) for d, v in getattr(acc, name).items()})
        return True

    def _never_seen(self) -> list[int]:
        out: list[int] = []
        for lo in range(0, len(self.seen), 1 << 20):
            got = np.flatnonzero(~self.seen[lo:lo + (1 << 20)])[:EVIDENCE - len(out)]
            out += (got + lo).tolist()
            if len(out) >= EVIDENCE:
                break
        return out

    def _rebin(self, was: int, now: int) -> None:
        """Loss sums by window of `was` steps merged into windows of `now` (a multiple)."""
        a = self.acc.loss_by_rank
        if not len(a):
            return
        k = now // was
        pad = -len(a) % k
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]))]) if pad else a
        self.acc.loss_by_rank = _trimmed(a.reshape(-1, k, *a.shape[1:]).sum(axis=1))

    # ---- a full pass: a change that is not folded in --------------------------------------

    def _full(self, plan: Plan) -> None:
        """Everything again from the spool: the stored rows are read once more (a new attempt
        rolls rows back, or the run's first step moved)."""
        self.full_passes += 1
        (self.work / CHECKPOINT).unlink(missing_ok=True)  # it names runs the reset removes
        self._reset()
        steps: set[int] = set()

        # One key range of PASS_RECORDS records at a time, and the keys beyond the manifest.
        bounds = np.r_[np.arange(0, self.man.records, PASS_RECORDS), self.man.records]
        parts = [p for i, rows in self.store.load(
            self._batches(plan, plan.files, steps, always=True), bounds)
                 if (p := self._range(plan, int(bounds[i]), rows)) is not None]
        self.acc = merge_all(parts)
        for name, (rank, _) in _LISTS.items():  # kept DEEP long, not as the report's merge cuts
            lists = [getattr(p, name) for p in parts]
            every = sorted((e for x in lists for e in x), key=rank)
            setattr(self.acc, name, every[:DEEP])
            self.complete[name] = len(every) <= DEEP and all(len(x) < DEEP for x in lists)
        if plan.metric_files:
            self.metrics = metric_partial(plan, plan.metric_files)
        self.metric_done = {str(f.path) for f in plan.metric_files}
        if steps:
            self._compare(plan, steps)

    def _range(self, plan: Plan, lo: int, rows: Rows) -> Partial | None:
        """The partial of the records lo .. lo + PASS_RECORDS - 1 over `rows` (all of theirs),
        or of the keys beyond the manifest (lo = records; None: none)."""
        if lo >= self.man.records:
            if not len(rows["key"]):
                return None
            return self._compute(plan, None, self._rows(rows, None, plan.cutoffs))[0]
        hi = min(lo + PASS_RECORDS, self.man.records)
        keys = np.arange(lo, hi, dtype=np.int64)
        p, records = self._compute(plan, self.man.columns(keys),
                                   self._rows(rows, rows["key"] - lo, plan.cutoffs))
        t = min(hi, self.man.train)
        if t > lo:
            self.seen[lo:t] = records.column("exposures").to_numpy()[:t - lo] > 0
        return p

    # ---- replay comparisons --------------------------------------------------------------

    def _compare(self, plan: Plan, steps: set[int]) -> None:
        """The replay comparison of each of `steps` (rolled-back steps that files of this
        round hold), made again from every file holding the step."""
        host_counts = {a: int(info["host_count"]) for a, info in plan.attempts.items()}
        by_step: dict[int, list[tuple]] = {s: [] for s in steps}
        lo, hi = min(steps), max(steps)
        for f in plan.files:
            _, first, last = self.files.get(f.path, (0, 0, -1))
            if last < lo or first > hi:
                continue
            try:
                cols, rolled = effective_rows(f, plan)
            except BadFile:
                continue
            for s, part in replay_rows(plan, cols, rolled):
                if s in by_step:
                    by_step[s].append(part)
        compare = CompareReplay(host_counts)
        for s, parts in by_step.items():
            self.replay[s] = [p for _, p in compare.process((s, parts))]

    # ---- the report ----------------------------------------------------------------------

    def _report(self, plan: Plan) -> dict:
        merged = merge_all([*self.file_parts.values(), self.acc, self.metrics,
                            *(p for ps in self.replay.values() for p in ps)])
        with_metric_facts(plan, merged)
        joined = merged.unknown_segments + merged.hash_checked + merged.hash_unverifiable
        if merged.segments != joined:
            raise TallyError(f"the live reconcile lost rows: {merged.segments:,} effective "
                             f"rows read, {joined:,} joined with the manifest")
        report, tables = rp.build(plan, merged, ("spool", self.spool))
        rp.write(report, tables, self.out, self.api_url)
        return report


def _row_rank(e: dict) -> tuple:
    return e["record_key"], e["step"], e["host"]


def _repeat_rank(e: dict) -> tuple:
    return -e["epoch_repeats"], -e["exposures"], e["record_key"]


_LISTS = {**{name: (_row_rank, EXAMPLES) for name in
             ("unknown_examples", "hash_mismatch_examples", "heldout_examples")},
          "most_repeated": (_repeat_rank, EVIDENCE)}
