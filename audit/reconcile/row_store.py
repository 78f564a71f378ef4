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

The store is derived data, private to one process: it is made empty when the process starts
(its folder wiped) and filled from the spool again. A record's rows are in no particular order
within it (the reconcile's per-record statistics do not depend on the order of rows).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

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
        self.folder = folder
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        self.runs: list[Rows] = []
        self._made = 0

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
            del col  # unmapped, not flushed: the mapping below reads the same page cache, and
            # the store is wiped at the next start (msync made every run wait for the disk)
            out[c] = np.load(where / f"{c}.npy", mmap_mode="r")
        out["_folder"] = where  # type: ignore[assignment]
        return out

    @staticmethod
    def _drop(runs: list[Rows]) -> None:
        for r in runs:
            where = r.get("_folder")
            if where is not None:
                shutil.rmtree(where, ignore_errors=True)  # type: ignore[arg-type]


def _append(folder: Path, i: int, rows: Rows) -> None:
    """`rows` added at the end of range `i`'s spilled files, one a column."""
    for c in COLUMNS:
        with open(folder / f"{i:06d}.{c}", "ab") as f:
            f.write(np.ascontiguousarray(rows[c], COLUMNS[c]).data)
