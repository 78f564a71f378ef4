"""A run's consumption rows kept by record key, for the live reconcile
(tally.audit.reconcile.follow): every row it has read, in sorted runs (a log-structured merge),
so that a round can fetch all the rows of the records its new rows touch without reading the
run again.

Runs are sorted by record key; a new round's rows make a run of their own, and runs merge
FAN_IN at a time once the newest FAN_IN are of one size tier (tiers a factor of FAN_IN apart):
a row is sorted again once a tier, and a fetch searches at most FAN_IN - 1 runs a tier. A
whole spool read at once (the live reconcile's full pass) is loaded instead by key range:
each row goes to its range (in memory, or appended to the range's files on disk), and each
range is sorted once into a run of its own, the runs disjoint; a fetch searches a run only for
the keys within its first and last. Runs
beyond MEMORY_ROWS rows are written to disk as one `.npy` a column and memory-mapped (their
pages live in the page cache, not in the process' anonymous memory).

The store is derived data, private to one process. It is made empty (its folder wiped) and
filled from the spool, or reopened as a checkpoint of the live reconcile names it (`save`,
`reopen`): `save` writes the runs still in memory to disk and syncs every run not synced yet,
and a run that a merge replaces after a checkpoint is kept until the next checkpoint is down
(`committed`), so that the last checkpoint always names runs that exist whole. Runs are never
changed once made. A record's rows are in no particular order within the store (the
reconcile's per-record statistics do not depend on the order of rows).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from tally.audit.core.paths import fsync_dir

# What a per-record statistic needs of a row (tally.audit.reconcile.bucket_stats.compute: the
# bucket file's columns, keys whole) and its attempt (whether a rollback removed it).
COLUMNS = {"key": np.int64, "step": np.int64, "host": np.uint16, "start": np.bool_,
           "n_tokens": np.int32, "content_hash": np.uint64, "epoch": np.int32,
           "loss": np.float32, "attempt": np.int32}
ROW_BYTES = sum(np.dtype(t).itemsize for t in COLUMNS.values())  # 43
FAN_IN = 4
MEMORY_ROWS = 2**20  # runs of fewer rows stay in memory (~40 MB at most a run)
# Runs stop merging at this size: a merge holds the keys and their order (16 bytes a row) and
# one column at a time (two copies of at most 8 bytes a row), ~1.1 GB at most; a fetch then
# searches ~15 such runs at 500M rows.
RUN_ROWS = 2**25
# A bulk load (`load`) holds this many rows in memory, by key range, before it moves them to
# disk, one file a range and column (~330 MB of rows).
SPILL_ROWS = 2**23

Rows = dict[str, np.ndarray]


def empty() -> Rows:
    return {k: np.zeros(0, t) for k, t in COLUMNS.items()}


def concat(parts: list[Rows]) -> Rows:
    parts = [p for p in parts if len(p["key"])]
    if not parts:
        return empty()
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in COLUMNS}


def _tier(rows: int) -> int:
    tier = 0
    while rows >= FAN_IN:
        rows //= FAN_IN
        tier += 1
    return tier


class RowStore:
    def __init__(self, folder: Path) -> None:
        """An empty store in `folder` (wiped)."""
        self.folder = folder
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        self.runs: list[Rows] = []
        self._made = 0
        self._pinned: set[Path] = set()  # run folders the last checkpoint names
        self._doomed: list[Path] = []  # of those, merged away since: removed at the next
        self._synced: set[Path] = set()

    @classmethod
    def reopen(cls, folder: Path, saved: list[tuple[str, int]]) -> RowStore:
        """The store as `save` described it, its runs memory-mapped again; whatever else the
        folder holds (runs made after that checkpoint, a bulk load's spill) is removed.
        ValueError when a run named is missing or short."""
        store = cls.__new__(cls)
        store.folder, store.runs, store._doomed = folder, [], []
        names = {name for name, _ in saved}
        for entry in folder.iterdir():
            if entry.name in names:
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        for name, n in saved:
            where = folder / name
            try:
                run = {c: np.load(where / f"{c}.npy", mmap_mode="r") for c in COLUMNS}
            except (OSError, ValueError) as exc:
                raise ValueError(f"run {name}: {exc}") from exc
            if any(len(v) != n or v.dtype != COLUMNS[c] for c, v in run.items()):
                raise ValueError(f"run {name}: not the {n:,} rows the checkpoint names")
            run["_folder"] = where  # type: ignore[assignment]
            store.runs.append(run)
        store._made = max((int(name.rsplit("-", 1)[1]) for name in names), default=0)
        store._pinned = {folder / name for name in names}
        store._synced = set(store._pinned)
        return store

    def save(self) -> list[tuple[str, int]]:
        """The store as a checkpoint names it (each run's folder and rows): the runs still in
        memory written to disk, every run synced to it. Until `committed`, the runs it names
        stay on disk even when a merge replaces them."""
        for i, run in enumerate(self.runs):
            if "_folder" not in run:
                self.runs[i] = self._on_disk(len(run["key"]),
                                             lambda c, out, run=run: out.__setitem__(
                                                 slice(None), run[c]))
        for run in self.runs:
            where = run["_folder"]
            if where not in self._synced:  # type: ignore[operator]
                _sync(where)  # type: ignore[arg-type]
                self._synced.add(where)  # type: ignore[arg-type]
        fsync_dir(self.folder)
        return [(run["_folder"].name, len(run["key"])) for run in self.runs]  # type: ignore

    def committed(self) -> None:
        """The checkpoint naming the last `save`'s runs is down: the runs merged away since the
        one before go now."""
        for where in self._doomed:
            shutil.rmtree(where, ignore_errors=True)
        self._doomed = []
        self._pinned = {run["_folder"] for run in self.runs}  # type: ignore[misc]
        self._synced &= self._pinned

    @property
    def rows(self) -> int:
        return sum(len(r["key"]) for r in self.runs)

    def add(self, rows: Rows) -> None:
        """Keep `rows` (COLUMNS), in a run of their own, merged as the tiers fill."""
        if not len(rows["key"]):
            return
        self.runs.append(self._run([rows]))
        while len(self.runs) >= FAN_IN and \
                _tier(len(self.runs[-FAN_IN]["key"])) <= _tier(len(self.runs[-1]["key"])) and \
                sum(len(r["key"]) for r in self.runs[-FAN_IN:]) <= RUN_ROWS:
            merged = self._run(self.runs[-FAN_IN:])
            old = self.runs[-FAN_IN:]
            self.runs[-FAN_IN:] = [merged]
            self._drop(old)

    def fetch(self, keys: np.ndarray) -> tuple[Rows, np.ndarray]:
        """Every row whose key is one of `keys` (sorted, distinct), and each row's key as its
        position in `keys`."""
        parts, where = [], []
        for run in self.runs:
            k = run["key"]
            if not len(k):
                continue
            # Only the keys within the run's bounds: a bulk load's runs are disjoint ranges.
            a = int(np.searchsorted(keys, k[0], "left"))
            b = int(np.searchsorted(keys, k[-1], "right"))
            lo = np.searchsorted(k, keys[a:b], "left")
            hi = np.searchsorted(k, keys[a:b], "right")
            n = hi - lo
            some = n > 0
            if not some.any():
                continue
            lo, n = lo[some], n[some]
            at = np.arange(int(n.sum()), dtype=np.int64) + np.repeat(lo - (np.cumsum(n) - n), n)
            parts.append({c: np.asarray(run[c][at]) for c in COLUMNS})
            where.append(np.repeat(np.flatnonzero(some) + a, n))
        return concat(parts), (np.concatenate(where) if where else np.zeros(0, np.int64))

    def load(self, chunks: Iterable[Rows], bounds: np.ndarray) -> Iterator[tuple[int, Rows]]:
        """Every row of `chunks`, into an empty store, as one run for each key range
        [bounds[i], bounds[i + 1]) and a last one from bounds[-1] up; yields (i, the range's
        rows sorted by key) for every range in order, empty ones too, once all chunks are in
        (the caller computes over each while it is in memory). Each row is sorted once, where
        adding the chunks as runs sorted and wrote it again at each tier of merges: a full
        pass over 40M rows took 44.8 s this way, 51.2 s that way (bench/RESULTS.md)."""
        assert not self.runs, "a bulk load fills an empty store"
        ranges = len(bounds)
        held: list[list[Rows]] = [[] for _ in range(ranges)]
        in_memory = 0
        spilled = self.folder / "load"
        spilled.mkdir(exist_ok=True)
        for chunk in chunks:
            if not len(chunk["key"]):
                continue
            which = np.searchsorted(bounds, chunk["key"], "right") - 1
            which = np.maximum(which, 0)  # (keys below bounds[0] join the first range)
            # A stable sort of small integers is a radix sort in numpy.
            order = np.argsort(which.astype(np.uint16 if ranges <= 1 << 16 else np.int64),
                               kind="stable")
            ends = np.cumsum(np.bincount(which, minlength=ranges))
            by = {c: v[order] for c, v in chunk.items()}
            for i in np.flatnonzero(np.diff(np.r_[0, ends])):
                a, b = (int(ends[i - 1]) if i else 0), int(ends[i])
                held[i].append({c: v[a:b] for c, v in by.items()})
            in_memory += len(order)
            if in_memory >= SPILL_ROWS:
                for i, parts in enumerate(held):
                    if parts:
                        _append(spilled, i, concat(parts))
                held = [[] for _ in range(ranges)]
                in_memory = 0
        for i in range(ranges):
            parts, held[i] = held[i], []
            run = self._range_run(spilled, f"{i:06d}", parts)
            if run is None:
                yield i, empty()
                continue
            self.runs.append(run)
            yield i, {c: np.asarray(run[c]) for c in COLUMNS}
        shutil.rmtree(spilled, ignore_errors=True)

    def _range_run(self, spilled: Path, name: str, parts: list[Rows]) -> Rows | None:
        """One range of a bulk load as a run: its spilled rows (files `name.<column>`, removed)
        and those in memory (`parts`), sorted by key; None when it has none. Built a column
        at a time: one copy of a column beside the keys and their order."""
        key_file = spilled / f"{name}.key"
        n = (key_file.stat().st_size // 8 if key_file.exists() else 0) + \
            sum(len(p["key"]) for p in parts)
        if not n:
            return None

        def column(c: str) -> np.ndarray:
            out = np.empty(n, COLUMNS[c])
            at = 0
            path = spilled / f"{name}.{c}"
            if path.exists():
                with open(path, "rb") as f:
                    at = f.readinto(memoryview(out).cast("B")) // out.itemsize
                path.unlink()
            for p in parts:
                out[at: at + len(p[c])] = p[c]
                at += len(p[c])
            return out

        keys = column("key")
        order = np.argsort(keys)  # a record's rows in no particular order (above)
        if n < MEMORY_ROWS:
            return {c: (keys if c == "key" else column(c))[order] for c in COLUMNS}
        return self._on_disk(n, lambda c, out: np.take(keys if c == "key" else column(c),
                                                       order, out=out))

    def _run(self, parts: list[Rows]) -> Rows:
        """`parts` as one run sorted by key."""
        keys = np.concatenate([np.asarray(p["key"]) for p in parts])
        order = np.argsort(keys, kind="stable")  # runs already sorted: timsort merges them
        del keys
        if len(order) < MEMORY_ROWS:
            return {c: np.concatenate([np.asarray(p[c]) for p in parts])[order]
                    for c in COLUMNS}
        return self._on_disk(len(order), lambda c, out: np.take(
            np.concatenate([np.asarray(p[c]) for p in parts]), order, out=out))

    def _on_disk(self, n: int, fill) -> Rows:
        """A run of `n` rows written column by column (`fill(column, out)` writes one into its
        memory-mapped file), then mapped read-only."""
        self._made += 1
        where = self.folder / f"run-{self._made:08d}"
        where.mkdir()
        out = {}
        for c, t in COLUMNS.items():
            col = np.lib.format.open_memmap(where / f"{c}.npy", "w+", t, (n,))
            fill(c, col)
            del col  # unmapped, not flushed: the mapping below reads the same page cache;
            # a checkpoint syncs the runs it names (msync made every run wait for the disk)
            out[c] = np.load(where / f"{c}.npy", mmap_mode="r")
        out["_folder"] = where  # type: ignore[assignment]
        return out

    def _drop(self, runs: list[Rows]) -> None:
        for r in runs:
            where = r.get("_folder")
            if where in self._pinned:
                self._doomed.append(where)  # type: ignore[arg-type]
            elif where is not None:
                shutil.rmtree(where, ignore_errors=True)  # type: ignore[arg-type]


def _append(folder: Path, i: int, rows: Rows) -> None:
    """`rows` added at the end of range `i`'s spilled files, one a column."""
    for c in COLUMNS:
        with open(folder / f"{i:06d}.{c}", "ab") as f:
            f.write(np.ascontiguousarray(rows[c], COLUMNS[c]).data)


def _sync(folder: Path) -> None:
    """A run's files and their folder down on disk."""
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(folder)
