"""The ledger writer a training loop calls once per consumed step.

The training thread only enqueues references to the step's arrays; a background thread hashes
segments, buffers rows and publishes spool files (temporary name, fsync, rename, fsync of the
directory) every `flush_every` steps, every `flush_seconds`, on `flush()` (call it before saving
a checkpoint, so the ledger is never behind a checkpoint) and on `close()`.

Guarantees:
- The queue is bounded: when it is full, the training thread waits (back-pressure); rows are
  never dropped.
- A failure in the background (bad batch, disk full) is raised by the next call on the training
  thread, never swallowed. Rows that could not be published stay buffered and are retried by the
  next publish, so a caller that frees the disk and calls `flush()` again loses nothing.
- A step is published once: the rows of a step sit in exactly one file.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tally.audit.core.errors import TallyError
from tally.audit.core.paths import atomic_write
from tally.audit.core.schema import (
    MAX_RECORD_KEY,
    MAX_STEP,
    METRIC_SCHEMA,
    SEGMENT_SCHEMA,
    SEGMENT_SCHEMA_WITH_LOSS,
    arrow_table,
)
from tally.audit.hook import spool as sp
from tally.audit.hook.segments import FIELDS, Segments, segments_from_batch

if TYPE_CHECKING:  # the hook imports only core at run time (docs/DESIGN.md, roles)
    from tally.pipeline.text import ContentBasis


class WriterError(TallyError):
    """The writer cannot go on: a bad argument, a reused run, or a background failure (the
    cause chained)."""


class WriterArgumentError(WriterError, ValueError):
    """A value the writer refuses when constructed."""


def _published(directory: Path) -> tuple[int | None, str | None]:
    """The last step of the segment files already published in `directory` (None: none), and
    the spool id of its newest published file (None: none, or one written before spool ids)."""
    names = sorted((n for n in os.listdir(directory) if sp.published(n)),
                   key=lambda n: (n.startswith("seg-"), len(n), n))
    if not names:
        return None, None
    meta = pq.read_metadata(directory / names[-1]).metadata or {}
    spool_id = meta.get(f"{sp.META_PREFIX}spool_id".encode())
    spool_id = spool_id.decode() if spool_id else None
    if not names[-1].startswith("seg-"):
        return None, spool_id
    return int(meta.get(f"{sp.META_PREFIX}last_step".encode(), b"-1")), spool_id


def _basis_json(basis: ContentBasis | str | None) -> str:
    """The basis as its JSON (a ContentBasis, or its JSON already); "" for none."""
    if basis is None or basis == "":
        return ""
    if isinstance(basis, str):
        return basis
    to_json = getattr(basis, "to_json", None)
    if to_json is None:
        raise WriterArgumentError(f"content_basis {basis!r}: expected a "
                                  "tally.pipeline.text.ContentBasis (TextHasher(...).basis) or its "
                                  "JSON")
    return to_json()


class LedgerWriter:
    def __init__(
        self,
        spool: str | os.PathLike,
        run_id: str,
        *,
        host: int = 0,
        host_count: int = 1,
        attempt: int = 0,
        resumed_from_step: int | None = None,
        records_per_epoch: int | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        manifest_fingerprint: str | None = None,
        content_basis: ContentBasis | str | None = None,
        flush_every: int = 100,
        flush_seconds: float = 30.0,
        queue_size: int = 8,
        fsync: bool = True,
    ) -> None:
        sp.check_topology(host, host_count, WriterArgumentError)
        if attempt < 0 or (attempt > 0) != (resumed_from_step is not None):
            raise WriterArgumentError("attempt 0 is a fresh start; attempt > 0 needs "
                                      "resumed_from_step")
        if resumed_from_step is not None and not 0 <= resumed_from_step < MAX_STEP:
            raise WriterArgumentError(f"resumed_from_step {resumed_from_step} is outside "
                                      f"0..{MAX_STEP - 1}")
        if records_per_epoch is not None and not 1 <= records_per_epoch <= MAX_RECORD_KEY:
            raise WriterArgumentError(f"records_per_epoch {records_per_epoch} is outside "
                                      f"1..{MAX_RECORD_KEY:,}")
        if flush_every < 1:
            raise WriterArgumentError("flush_every must be >= 1")
        try:
            self.run_id = sp.check_run_id(run_id)
        except ValueError as exc:
            raise WriterArgumentError(str(exc)) from None
        self.host, self.host_count, self.attempt = host, host_count, attempt
        self.records_per_epoch = records_per_epoch
        self.flush_every, self.flush_seconds, self._fsync = flush_every, flush_seconds, fsync
        self.dir = sp.host_dir(Path(spool), run_id, attempt, host)
        self.dir.mkdir(parents=True, exist_ok=True)
        # Steps this host already published in this attempt: writing one of them again (a
        # reused run id, a host restarted without resuming) is refused at the first such step;
        # a new writer continuing with later steps is fine, and keeps the spool's id. Without
        # a published file here, a new id: the ledger refuses files of another spool id for an
        # attempt and host it holds (a run id reused after its spool was removed).
        self._published_up_to, spool_id = _published(self.dir)
        self.spool_id = spool_id or uuid.uuid4().hex
        self._last_step: int | None = None  # the newest step handed over (training thread)
        self._row_step, self._next_row = -1, 0  # row numbering within a step (writer thread)
        # Temporaries of a killed writer of this host, in this attempt or an earlier one.
        for b in range(attempt + 1):
            for stale in sp.host_dir(Path(spool), run_id, b, host).glob(".*.tmp"):
                stale.unlink(missing_ok=True)
        self._seq = sp.next_seq(self.dir)
        self._meta = {
            "format_version": sp.FORMAT_VERSION,
            "run_id": run_id,
            "attempt": str(attempt),
            "host": str(host),
            "host_count": str(host_count),
            "resumed_from_step": "" if resumed_from_step is None else str(resumed_from_step),
            "writer_version": sp.WRITER_VERSION,
            "manifest_fingerprint": manifest_fingerprint or "",
            "records_per_epoch": "" if records_per_epoch is None else str(records_per_epoch),
            "checkpoint_dir": "" if checkpoint_dir is None else os.path.abspath(checkpoint_dir),
            "spool_id": self.spool_id,
            # What this loop's content hashes are taken over (tally.pipeline.text.ContentBasis: a
            # loop that tokenizes text on the fly passes TextHasher(...).basis); "" unknown.
            "content_basis": _basis_json(content_basis),
        }
        # Background state: touched only by the writer thread, except _error (handed over).
        self._steps: list[int] = []
        self._segs: list[Segments] = []
        self._metrics: list[tuple[int, str, float]] = []
        self._oldest = 0.0
        self._error: BaseException | None = None
        self._closed = False
        self.durable_step: int | None = None  # last step of the newest published segment file
        self.files_published = 0
        self.blocked_seconds = 0.0  # training-thread time spent in this writer's calls
        self.background_seconds = 0.0  # writer-thread time spent hashing and publishing
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name=f"tally-writer-h{host}", daemon=True)
        self._thread.start()
        ref = weakref.ref(self)
        self._atexit = lambda: (w := ref()) is not None and w._close_quietly()
        atexit.register(self._atexit)

    # ---- training-thread API -------------------------------------------------------------
    def write_batch(self, step: int, batch: Mapping[str, np.ndarray], *,
                    loss: Any = None, **layout: str) -> None:
        """Record the batch consumed at `step` (Grain layout, see `tally.audit.hook.segments`).

        `loss` (optional): the step's training loss on this batch, per token ([B, L] or
        [B, L - 1]) or per row ([B]); each segment then carries its mean (the `loss` column),
        which is how reports tell whether repeated records flattered the training loss. It
        may be a device array still being computed: the writer's thread waits for it, the
        training thread does not.

        Only references are queued: the loop must not mutate the arrays afterwards (Grain and
        jax.device_get hand out fresh arrays each step).
        """
        self._put(("batch", self._new_step(step), batch, layout, loss))

    def write_segments(self, step: int, segments: Segments | Callable[[], Segments]) -> None:
        """Record the segments consumed at `step`: precomputed (hashes already known), or a
        function that computes them, called on the writer's thread (so that reading records
        back and hashing them costs the training thread nothing; `tally.pipeline.grain_attach`)."""
        self._put(("segments", self._new_step(step), segments))

    def _new_step(self, step: int) -> int:
        step = int(step)
        if not 0 <= step < MAX_STEP:
            raise WriterArgumentError(f"step {step} is outside 0..{MAX_STEP - 1}")
        done = self._published_up_to
        if done is not None and step <= done:
            what = (f"run {self.run_id} already has a spool: host {self.host} published steps "
                    f"up to {done} of attempt {self.attempt}")
            raise WriterError(f"{what}; step {step} again would count twice: resume it (a new "
                              "attempt, from a checkpoint) or choose another run id")
        if self._last_step is not None and step < self._last_step:
            raise WriterError(f"step {step} comes after step {self._last_step}: steps handed "
                              "to a writer never go back (a restart is a new attempt)")
        self._last_step = step
        return step

    def log_metric(self, step: int, name: str, value: float) -> None:
        self._put(("metrics", [(int(step), str(name), float(value))]))

    def log_metrics(self, rows: list[tuple[int, str, float]]) -> None:
        """Several (step, name, value) at once: one hand-over instead of one per value."""
        self._put(("metrics", [(int(s), str(n), float(v)) for s, n, v in rows]))

    def flush(self) -> None:
        """Block until everything handed over so far is published; raise if that failed."""
        done = threading.Event()
        self._put(("flush", done))
        self._wait(done)
        self._raise_pending()

    def finish(self) -> None:
        """Close, saying that this host's share of the run ended here: the last step handed
        over was the run's last (reports can then tell a finished run from one still going,
        and what its last epoch left out)."""
        if not self._closed and self._last_step is not None:
            self.log_metric(self._last_step, sp.FINISHED, 1.0)
        self.close()

    def close(self) -> None:
        if self._closed:
            self._raise_pending()
            return
        done = threading.Event()
        self._put(("close", done))
        self._wait(done)
        self._closed = True
        self._thread.join()
        atexit.unregister(self._atexit)
        self._raise_pending()

    def __enter__(self) -> LedgerWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
        else:
            self._close_quietly()

    # ---- internals ------------------------------------------------------------------------
    def _put(self, item: tuple) -> None:
        if self._closed:
            raise WriterError("ledger writer is closed")
        self._raise_pending()
        t0 = time.perf_counter()
        self._queue.put(item)  # blocks when full: back-pressure, never a dropped row
        self.blocked_seconds += time.perf_counter() - t0

    def _wait(self, done: threading.Event) -> None:
        while not done.wait(1.0):
            if not self._thread.is_alive():
                raise WriterError("ledger writer thread died")

    def _raise_pending(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise WriterError(f"ledger writer for {self.dir} failed: {err}") from err

    def _close_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _run(self) -> None:
        while True:
            timeout = None
            if self._steps or self._metrics:
                timeout = max(0.0, self._oldest + self.flush_seconds - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:  # flush_seconds elapsed with rows buffered
                try:
                    self._publish()
                except Exception as exc:
                    self._fail(exc)
                    self._oldest = time.monotonic()  # retry after another flush_seconds
                continue
            t0 = time.perf_counter()
            try:
                self._handle(item)
            except Exception as exc:
                self._fail(exc)
            finally:
                self.background_seconds += time.perf_counter() - t0
                if item[0] in ("flush", "close"):
                    item[-1].set()
            if item[0] == "close":
                return

    def _fail(self, exc: BaseException) -> None:
        # Handed to the training thread by its next call, never swallowed; the first cause wins.
        if self._error is None:
            self._error = exc

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "batch":
            _, step, batch, layout, loss = item
            segs = segments_from_batch(batch, records_per_epoch=self.records_per_epoch,
                                       loss=None if loss is None else np.asarray(loss),
                                       **layout)
            self._add(step, segs)
        elif kind == "segments":
            segs = item[2]
            self._add(item[1], segs if isinstance(segs, Segments) else segs())
        elif kind == "metrics":
            self._touch()
            self._metrics.extend(item[1])
        else:  # flush or close
            self._publish()

    def _touch(self) -> None:
        if not (self._steps or self._metrics):
            self._oldest = time.monotonic()

    def _add(self, step: int, segs: Segments) -> None:
        # A step handed over in several parts (micro-batches) numbers its rows on from the
        # parts before it: a host's (step, row) names one batch row, whichever file holds it,
        # so the ledger can tell a step split across files from a copy of a file.
        if step == self._row_step:
            segs = dataclasses.replace(segs, row=segs.row + self._next_row)
        else:
            self._row_step, self._next_row = step, 0
        if len(segs):
            self._next_row = max(self._next_row, int(segs.row.max()) + 1)
        self._touch()
        self._steps.append(step)
        self._segs.append(segs)
        if len(set(self._steps)) >= self.flush_every:
            self._publish()

    def _publish(self) -> None:
        if self._steps:
            self._write(*self._segment_table(self._steps, self._segs))
            self._steps, self._segs = [], []
        if self._metrics:
            self._write(*self._metric_table())
            self._metrics = []

    def _segment_table(self, steps_of: list[int], segs: list[Segments]
                       ) -> tuple[str, pa.Table, int, int]:
        lens = [len(s) for s in segs]
        steps = np.repeat(np.asarray(steps_of, dtype=np.int64), lens)
        cols = {
            "step": steps,
            "host": np.full(len(steps), self.host, dtype=np.int32),
            **{f: np.concatenate([getattr(s, f) for s in segs]) for f in FIELDS},
        }
        schema = SEGMENT_SCHEMA
        if any(s.loss is not None for s in segs):  # NaN where a part of the step had none
            cols["loss"] = np.concatenate([np.full(len(s), np.nan, np.float32)
                                           if s.loss is None else s.loss for s in segs])
            schema = SEGMENT_SCHEMA_WITH_LOSS
        return "seg", arrow_table(schema, cols), min(steps_of), max(steps_of)

    def _metric_table(self) -> tuple[str, pa.Table, int, int]:
        steps, names, values = zip(*self._metrics, strict=True)
        table = arrow_table(METRIC_SCHEMA, {"step": steps, "host": [self.host] * len(steps),
                                            "name": names, "value": values})
        return "met", table, min(steps), max(steps)

    def _write(self, kind: str, table: pa.Table, first: int, last: int) -> None:
        meta = {**self._meta, "kind": kind, "rows": str(table.num_rows),
                "first_step": str(first), "last_step": str(last)}
        publish(self.dir, kind, table, meta, first, self._seq, fsync=self._fsync)
        self._seq += 1
        self.files_published += 1
        if kind == "seg":
            self.durable_step = last


def publish(directory: Path, kind: str, table: pa.Table, meta: Mapping[str, str], first: int,
            seq: int, *, fsync: bool = True) -> Path:
    """Publish one spool file by the contract: a temporary name, fsync, rename to its final
    name (never over another file), fsync of the directory. `meta` is the file's metadata
    without the `tally.` prefix. Returns the published path."""
    table = table.replace_schema_metadata({sp.META_PREFIX + k: v for k, v in meta.items()})
    final = directory / sp.file_name(kind, first, seq)
    tmp = directory / sp.temp_name(final.name)
    with atomic_write(final, tmp, fsync=fsync, overwrite=False) as f:
        # LZ4: reading a 100k-row file back (ingest, reconcile) takes 3.9 ms against zstd's
        # 6.3 ms, for files 11% larger (content hashes do not compress).
        pq.write_table(table, f, compression="lz4")
    return final
