"""A run's consumption rows kept by record key, for the live reconcile
(tally.audit.reconcile.follow): every row it has read, in sorted runs (a log-structured merge),
so that a round can fetch all the rows of the records its new rows touch without reading the
run again.

Runs are sorted by record key; a new round's rows make a run of their own, and runs merge
FAN_IN at a time once the newest FAN_IN are of one size tier (tiers a factor of FAN_IN apart):
a row is sorted again once a tier, and a fetch searches at most FAN_IN - 1 runs a tier. Runs
beyond MEMORY_ROWS rows are written to disk as one `.npy` a column and memory-mapped (their
pages live in the page cache, not in the process' anonymous memory).

The store is derived data, private to one process: it is made empty when the process starts
(its folder wiped) and filled from the spool again. A record's rows are in no particular order
within it (the reconcile's per-record statistics do not depend on the order of rows).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

# What a per-record statistic needs of a row (tally.audit.reconcile.bucket_stats.compute: the
# bucket file's columns, keys whole) and its attempt (whether a rollback removed it).
COLUMNS = {"key": np.int64, "step": np.int64, "host": np.uint16, "start": np.bool_,
           "n_tokens": np.int32, "content_hash": np.uint64, "epoch": np.int32,
           "loss": np.float32, "attempt": np.int32}
ROW_BYTES = sum(np.dtype(t).itemsize for t in COLUMNS.values())  # 39
FAN_IN = 4
MEMORY_ROWS = 2**20  # runs of fewer rows stay in memory (~40 MB at most a run)
# Runs stop merging at this size: a merge holds the keys and their order (16 bytes a row) and
# one column at a time (two copies of at most 8 bytes a row), ~1.1 GB at most; a fetch then
# searches ~15 such runs at 500M rows.
RUN_ROWS = 2**25

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
            lo = np.searchsorted(k, keys, "left")
            hi = np.searchsorted(k, keys, "right")
            n = hi - lo
            some = n > 0
            if not some.any():
                continue
            lo, n = lo[some], n[some]
            at = np.arange(int(n.sum()), dtype=np.int64) + np.repeat(lo - (np.cumsum(n) - n), n)
            parts.append({c: np.asarray(run[c][at]) for c in COLUMNS})
            where.append(np.repeat(np.flatnonzero(some), n))
        return concat(parts), (np.concatenate(where) if where else np.zeros(0, np.int64))

    def key_range(self, lo: int, hi: int | None) -> Rows:
        """Every row with lo <= key < hi (None: no upper bound)."""
        parts = []
        for run in self.runs:
            k = run["key"]
            a = int(np.searchsorted(k, lo, "left"))
            b = len(k) if hi is None else int(np.searchsorted(k, hi, "left"))
            if b > a:
                parts.append({c: np.asarray(run[c][a:b]) for c in COLUMNS})
        return concat(parts)

    def _run(self, parts: list[Rows]) -> Rows:
        """`parts` as one run sorted by key: in memory when small, else written column by
        column (the keys' order first; then each column gathered into its file)."""
        keys = np.concatenate([np.asarray(p["key"]) for p in parts])
        order = np.argsort(keys, kind="stable")  # runs already sorted: timsort merges them
        del keys
        if len(order) < MEMORY_ROWS:
            return {c: np.concatenate([np.asarray(p[c]) for p in parts])[order]
                    for c in COLUMNS}
        self._made += 1
        where = self.folder / f"run-{self._made:08d}"
        where.mkdir()
        out = {}
        for c, t in COLUMNS.items():
            col = np.lib.format.open_memmap(where / f"{c}.npy", "w+", t, (len(order),))
            np.take(np.concatenate([np.asarray(p[c]) for p in parts]), order, out=col)
            col.flush()
            del col
            out[c] = np.load(where / f"{c}.npy", mmap_mode="r")
        out["_folder"] = where  # type: ignore[assignment]
        return out

    @staticmethod
    def _drop(runs: list[Rows]) -> None:
        for r in runs:
            where = r.get("_folder")
            if where is not None:
                shutil.rmtree(where, ignore_errors=True)  # type: ignore[arg-type]
