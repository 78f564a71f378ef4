"""One host's replayed spool, for every PyTorch-side adapter's replay: the index batches a
loader's contract says the host read go in, segment files marked replayed come out.

Kept apart from tally.pipeline.replay (which imports Grain) so that replaying a torch or Streaming
loader needs neither Grain nor JAX."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from tally.audit.core.errors import TallyError
from tally.audit.core.schema import MAX_STEP, SEGMENT_SCHEMA
from tally.audit.hook import spool as sp
from tally.audit.hook.writer import publish

# What a replay's files say (tally.audit.hook.spool.is_replayed reads either).
WRITER_VERSION = sp.REPLAY_WRITER_VERSION
ROWS_PER_FILE = 1 << 20  # ~1M rows a file (whole steps): ~27 MB, read in ~40 ms


class ReplayError(TallyError):
    """Replay cannot go on (the message says what and where)."""


@dataclass
class HostReplay:
    """What one host's replay wrote."""

    host: int
    rows: int
    files: int
    first_step: int | None
    last_step: int | None
    seconds: float


# indices, epochs -> (record keys, n_tokens, content hashes) of those rows.
Resolve = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


class ReplayedHost:
    """Batches of one host of attempt 0 into `spool`, ROWS_PER_FILE rows a file."""

    def __init__(self, spool: str | Path, run_id: str, host: int, host_count: int, *,
                 records_per_epoch: int, resolve: Resolve, fingerprint: str = "",
                 content_basis: str = "", fsync: bool = True,
                 rows_per_file: int = ROWS_PER_FILE) -> None:
        self.host, self.resolve, self.fsync = host, resolve, fsync
        self.rows_per_file = rows_per_file
        self.directory = sp.host_dir(Path(spool), run_id, 0, host)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.meta = {"format_version": sp.FORMAT_VERSION, "run_id": run_id, "attempt": "0",
                     "host": str(host), "host_count": str(host_count), "resumed_from_step": "",
                     "writer_version": WRITER_VERSION, "manifest_fingerprint": fingerprint,
                     "records_per_epoch": str(records_per_epoch), "checkpoint_dir": "",
                     "replayed": "1", "content_basis": content_basis or ""}
        self.seq = sp.next_seq(self.directory)
        self.rows = self.files = 0
        self.first: int | None = None
        self.last: int | None = None
        self.t0 = time.perf_counter()
        self._pending: list[tuple[int, np.ndarray, int]] = []
        self._n = 0

    def add(self, step: int, indices: np.ndarray, epoch: int | np.ndarray) -> None:
        """The host read `indices` (the loader's) at `step`, in `epoch` (-1: unknown; or one
        epoch an index)."""
        self._pending.append((step, np.asarray(indices, np.int64), epoch))
        self._n += len(indices)
        if self._n >= self.rows_per_file:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending, self._n = self._pending, [], 0
        lens = [len(i) for _, i, _ in pending]
        step = np.repeat(np.array([s for s, _, _ in pending], np.int64), lens)
        idx = np.concatenate([i for _, i, _ in pending])
        epoch = np.concatenate([np.broadcast_to(np.asarray(e, np.int64), (len(i),))
                                for _, i, e in pending])
        row = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
        key, n_tokens, content = self.resolve(idx, epoch)
        lo, hi = int(step[0]), int(step[-1])
        if hi >= MAX_STEP:
            raise ReplayError(f"step {hi} is beyond the spool's {MAX_STEP - 1}")
        table = pa.Table.from_pydict({
            "step": step, "host": np.full(len(idx), self.host, np.int32), "row": row,
            "record_key": np.asarray(key, np.int64), "offset": np.zeros(len(idx), np.int32),
            "n_tokens": np.asarray(n_tokens).astype(np.int32), "content_hash": content,
            "epoch": epoch.astype(np.int32)}, schema=SEGMENT_SCHEMA)
        publish(self.directory, "seg", table,
                {**self.meta, "kind": "seg", "rows": str(len(idx)), "first_step": str(lo),
                 "last_step": str(hi)}, lo, self.seq, fsync=self.fsync)
        self.seq, self.files, self.rows = self.seq + 1, self.files + 1, self.rows + len(idx)
        self.first = lo if self.first is None else self.first
        self.last = hi

    def seconds(self) -> float:
        return time.perf_counter() - self.t0
