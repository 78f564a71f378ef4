"""Snapshots of the per-record live state, so that a restart does not rebuild it.

The ingesting process keeps one row per record key of each run in memory
(tally.audit.ledger.state); rebuilding it replays every segment file of the ledger through the
ingest's path (66 s at 100M rows from 128 hosts on the 2-core box, 825 s at 500M). A snapshot
is that state written next to the ledger, `<ledger>.state/run-<run>.state`, one file per run:

    b"TLYSNAP1" | uint64 header length | header (JSON) | zeros up to a 4 KiB boundary | rows
    | maps (an .npz: the state's sparse maps, pending steps and watermark, RunState.extra)

The header says what the rows cover and how to check them: the ledger's id (`meta`), the run,
the row layout (`dtype.descr`, so that a new layout reads as another format, never as wrong
numbers), the number of rows and `top`, the segment files applied (the highest file id, their
count and a digest of their ids and paths), the restart lineage (each attempt's
`rolled_back_from_step`), the size of the maps, the xxh3_128 of rows and maps and the
header's own xxh3_64.

Written crash-safely: a temporary name, the header (its checksum taken first), then the rows
streamed from the live array in 64 MiB slices (no copy of the state) past the page cache
(tally.audit.core.paths.Uncached), fsync, rename, fsync of the directory. A kill at
any moment leaves the previous snapshot or none, and a leftover temporary is ignored and
removed by the next write.

Read by `open_snapshot`: every check above, the checksum over the file, then the rows are
mapped copy-on-write (np.memmap mode "c"): the pages read for the checksum are the page cache
that backs the mapping, so a restore holds no second copy of the state, and rows the ingester
changes afterwards become private pages that never reach the file. What catch-up does with a
snapshot that is behind the ledger is tally.audit.ledger.aggregates' business.
"""

from __future__ import annotations

import io
import json
import logging
import mmap
import os
import struct
import time
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import xxhash

from tally.audit.core.paths import atomic_write, fsync_dir

log = logging.getLogger("tally.state")

MAGIC = b"TLYSNAP1"
# 2: the compact rows and, after them, the sparse maps and the watermark; 3: the rows' host
# layout among them (four one-byte host slots; a format-2 file read as two slots would be wrong);
# 4: the rows' PENDING flag (a format-3 file's pending records lack it: read as settled)
FORMAT = 4
ALIGN = 4096  # rows start on a page boundary: the mapping is aligned for every field
SLICE = 64 << 20  # bytes hashed and written at a time
MAX_HEADER = 1 << 20

# When a snapshot pays (Snapshots.due), each overridable by the environment:
# - a run with none (its state was just rebuilt, which costs far more than the write): now;
# - else when this many consumption rows arrived since the last one: catching them up at the
#   next start costs about 1 s a million rows on the loaded 2-core box (bench/restart.py:
#   2.0M rows in 2.0 s), so a restart stays within seconds;
SNAPSHOT_ROWS = 5_000_000
# - and no sooner than this after the last write, nor sooner than WRITE_SHARE times that
#   write's duration: writing holds ingest (never readers) for its duration, so snapshots take
#   at most ~1/WRITE_SHARE of the ingester's time however large the state grows.
SNAPSHOT_SECONDS = 60.0
WRITE_SHARE = 10


class Invalid(Exception):
    """A snapshot that cannot be used; the message says why (logged once, then rebuilt)."""


@dataclass(frozen=True)
class Applied:
    """What a run's per-record state covers: the segment files applied and the lineage."""

    max_file_id: int  # the highest file id among the run's segment files (0: none)
    seg_files: int  # how many segment files of the run
    files_digest: str  # xxh3_64 of their ids and paths, in file id order
    lineage: dict[int, int | None]  # attempt -> rolled_back_from_step

    @classmethod
    def now(cls, cur: duckdb.DuckDBPyConnection, run: int, upto: int | None = None) -> Applied:
        """The run's files in the ledger (those with file id <= `upto` when given)."""
        bound = "" if upto is None else "AND file_id <= ?"
        got = cur.execute(f"""SELECT file_id, path FROM segments
            WHERE run = ? AND kind = 'seg' {bound} ORDER BY file_id""",
                          [run] + ([] if upto is None else [upto])).fetchnumpy()
        ids = np.asarray(got["file_id"], np.int64)
        h = xxhash.xxh3_64()
        h.update(ids.tobytes())
        h.update("\0".join(got["path"].tolist()).encode())
        lineage = dict(cur.execute("SELECT attempt, rolled_back_from_step FROM attempts "
                                   "WHERE run = ?", [run]).fetchall())
        return cls(int(ids[-1]) if len(ids) else 0, len(ids), h.hexdigest(), lineage)


def lowered_cuts(before: dict[int, int | None], now: dict[int, int | None]
                 ) -> list[tuple[int, int, int | None]]:
    """(attempt, cut now, cut before) for each attempt of `before` whose cut went down since:
    its rows at steps cut..before left the lineage. New attempts only ever lower cuts (the
    lineage rule takes a minimum), so a cut that went up or an attempt that went away means
    another ledger: ValueError."""
    out = []
    for attempt, old in before.items():
        if attempt not in now:
            raise ValueError(f"attempt {attempt} is gone")
        cut = now[attempt]
        if cut is None and old is not None or cut is not None and old is not None and cut > old:
            raise ValueError(f"attempt {attempt}'s rollback moved from step {old} to {cut}")
        if cut is not None and (old is None or cut < old):
            out.append((attempt, cut, old))
    return out


def _descr(dtype: np.dtype) -> list:
    """The dtype as JSON holds it (tuples become lists)."""
    return json.loads(json.dumps(np.lib.format.dtype_to_descr(dtype)))


def _header_digest(fields: dict) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(fields, sort_keys=True).encode())


def _pause(step: str) -> None:
    """For the kill tests only (tests/test_snapshot.py): with TALLY_SNAPSHOT_TEST_PAUSE_S set,
    each step of a write is logged and followed by that many seconds, so that a kill can land
    at each of them."""
    s = os.environ.get("TALLY_SNAPSHOT_TEST_PAUSE_S")
    if s:
        log.info("snapshot write: %s", step)
        time.sleep(float(s))


def write_snapshot(directory: Path, run: int, run_id: str, ledger_id: str, data: np.ndarray,
                   top: int, applied: Applied, extra: dict[str, np.ndarray] | None = None
                   ) -> int:
    """Write `data` (the run's rows; not copied) as the run's snapshot; returns bytes
    written. The caller keeps `data` unchanged meanwhile (it holds the ingest lock)."""
    new = not directory.exists()
    directory.mkdir(exist_ok=True)
    if new:
        fsync_dir(directory.parent)
    for old in directory.glob(f".run-{run}.*.tmp"):  # a killed write's (one writer: DuckDB's
        old.unlink(missing_ok=True)                    # file lock is held by this process)
    final = directory / f"run-{run}.state"
    tmp = directory / f".run-{run}.{os.getpid()}.tmp"
    raw = np.ascontiguousarray(data).view(np.uint8)
    blob = io.BytesIO()
    np.savez(blob, **(extra or {}))
    tail = np.frombuffer(blob.getbuffer(), np.uint8)
    fields = {"format": FORMAT, "ledger_id": ledger_id, "run": run, "run_id": run_id,
              "dtype": _descr(data.dtype), "itemsize": data.dtype.itemsize, "rows": len(data),
              "top": int(top), "extra_bytes": len(tail), "max_file_id": applied.max_file_id,
              "seg_files": applied.seg_files, "files_digest": applied.files_digest,
              "lineage": {str(a): c for a, c in sorted(applied.lineage.items())},
              "checksum": "0" * 32, "written_at": time.time()}
    offset = -(-(16 + len(json.dumps(fields)) + 256) // ALIGN) * ALIGN
    fields["data_offset"] = offset
    pause = bool(os.environ.get("TALLY_SNAPSHOT_TEST_PAUSE_S"))
    step = max(1, len(raw) // 4) if pause else SLICE
    h = xxhash.xxh3_128()  # first, so that the file is written front to back in one pass
    for i in range(0, len(raw), SLICE):
        h.update(raw[i: i + SLICE])
    h.update(tail)
    fields["checksum"] = h.hexdigest()
    fields["header_digest"] = _header_digest(fields)
    header = json.dumps(fields).encode()
    head = MAGIC + struct.pack("<Q", len(header)) + header
    assert len(head) <= offset
    # Past the page cache: read only at a restart, and 0.8 GB at 100M records (Uncached).
    with atomic_write(final, tmp, on=_pause, page_cache=False) as f:
        f.write(head + bytes(offset - len(head)))
        _pause("begun")
        for i in range(0, len(raw), step):
            f.write(raw[i: i + step])
            _pause(f"rows to {min(i + step, len(raw))} of {len(raw)} bytes")
        f.write(tail)
    return offset + len(raw) + len(tail)


@dataclass
class Snapshot:
    """A run's snapshot, checked and mapped."""

    rows: np.ndarray  # mapped copy-on-write (a plain ndarray view of the mapping)
    top: int
    applied: Applied
    path: Path
    extra: dict[str, np.ndarray]  # what the state keeps beside its rows (RunState.extra)


def open_snapshot(path: Path, *, ledger_id: str, run: int, run_id: str, dtype: np.dtype,
                  cur: duckdb.DuckDBPyConnection) -> Snapshot:
    """The run's snapshot if it is whole, of this ledger and run, of this row layout, and
    covers files the ledger still holds under a lineage catch-up can follow; Invalid (with
    the reason) otherwise."""
    try:
        with open(path, "rb") as f:
            return _checked(f, path, ledger_id, run, run_id, dtype, cur)
    except FileNotFoundError:
        raise Invalid("no snapshot") from None
    except OSError as exc:
        raise Invalid(f"unreadable snapshot: {exc}") from None


def _checked(f, path: Path, ledger_id: str, run: int, run_id: str, dtype: np.dtype,
             cur: duckdb.DuckDBPyConnection) -> Snapshot:
    size = os.fstat(f.fileno()).st_size
    head = f.read(16)
    if len(head) < 16 or head[:8] != MAGIC:
        raise Invalid("not a snapshot (no magic number): truncated or overwritten")
    (n,) = struct.unpack("<Q", head[8:])
    try:
        if n > MAX_HEADER:
            raise ValueError("length")
        fields = json.loads(f.read(n))
        if fields.pop("header_digest", None) != _header_digest(fields):
            raise ValueError("digest")
        if fields.get("format") != FORMAT:
            raise Invalid(f"snapshot format {fields.get('format')}, this Tally reads {FORMAT}")
        rows, offset, top = int(fields["rows"]), int(fields["data_offset"]), int(fields["top"])
        extra_bytes = int(fields["extra_bytes"])
        applied = Applied(int(fields["max_file_id"]), int(fields["seg_files"]),
                          str(fields["files_digest"]),
                          {int(a): c for a, c in fields["lineage"].items()})
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise Invalid(f"corrupt snapshot header ({type(exc).__name__}: {exc})") from None
    if fields["ledger_id"] != ledger_id:
        raise Invalid(f"snapshot of another ledger (id {fields['ledger_id']}; this ledger's "
                      f"is {ledger_id})")
    if (fields["run"], fields["run_id"]) != (run, run_id):
        raise Invalid(f"snapshot of another run ({fields['run_id']!r})")
    if fields["dtype"] != _descr(dtype) or fields["itemsize"] != dtype.itemsize:
        raise Invalid("snapshot of another per-record layout")
    end = offset + rows * dtype.itemsize
    if size != end + extra_bytes:
        raise Invalid(f"truncated snapshot ({size:,} bytes; its header says "
                      f"{end + extra_bytes:,})")
    held = Applied.now(cur, run, applied.max_file_id)
    if (held.seg_files, held.files_digest) != (applied.seg_files, applied.files_digest):
        raise Invalid(f"the ledger does not hold the files the snapshot covers "
                      f"({applied.seg_files:,} up to file id {applied.max_file_id}; the ledger "
                      f"has {held.seg_files:,} there, or others)")
    try:
        lowered_cuts(applied.lineage, held.lineage)
    except ValueError as exc:
        raise Invalid(f"another restart lineage ({exc})") from None
    f.seek(end)
    tail = f.read(extra_bytes)
    mapped = np.memmap(f, dtype=dtype, mode="c", offset=offset, shape=(rows,)) if rows \
        else np.zeros(0, dtype)
    if _checksum(mapped, tail) != fields["checksum"]:
        raise Invalid("snapshot checksum mismatch (its rows changed after it was written)")
    try:
        with np.load(io.BytesIO(tail), allow_pickle=False) as z:
            extra = {k: z[k] for k in z.files}
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise Invalid(f"corrupt snapshot maps ({type(exc).__name__}: {exc})") from None
    return Snapshot(mapped.view(np.ndarray), top, applied, path, extra)


def _checksum(mapped: np.ndarray, tail: bytes) -> str:
    """xxh3_128 of the mapped rows, read through the mapping (sequential read-ahead): the
    pages stay in the page cache that backs the mapping, and no copy is made; then of the
    maps after them."""
    mm = getattr(mapped, "_mmap", None)
    if mm is not None and hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_SEQUENTIAL)
    raw = mapped.view(np.uint8)
    h = xxhash.xxh3_128()
    for i in range(0, len(raw), SLICE):
        h.update(raw[i: i + SLICE])
    if mm is not None and hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_NORMAL)  # afterwards keys come in any order
    h.update(tail)
    return h.hexdigest()


@dataclass
class Saved:
    """The last snapshot of a run this process wrote or restored."""

    applied: Applied
    at: float  # monotonic time of the write (or of the restore)
    seconds: float  # how long the write took (0 for a restore)


class Snapshots:
    """Where a ledger's snapshots live and when to write them (see SNAPSHOT_ROWS)."""

    def __init__(self, ledger_path: Path, ledger_id: str | None) -> None:
        self.directory = Path(f"{ledger_path}.state")
        self.ledger_id = ledger_id
        self.enabled = ledger_id is not None and str(ledger_path) != ":memory:"
        self.saved: dict[int, Saved] = {}
        self.rows = int(os.environ.get("TALLY_SNAPSHOT_ROWS", SNAPSHOT_ROWS))
        self.seconds = float(os.environ.get("TALLY_SNAPSHOT_SECONDS", SNAPSHOT_SECONDS))
        self._failed: set[str] = set()

    def path(self, run: int) -> Path:
        return self.directory / f"run-{run}.state"

    def open(self, cur: duckdb.DuckDBPyConnection, run: int, run_id: str, dtype: np.dtype
             ) -> Snapshot:
        if not self.enabled:
            raise Invalid("no ledger id (a read-only ledger)")
        return open_snapshot(self.path(run), ledger_id=self.ledger_id, run=run, run_id=run_id,
                             dtype=dtype, cur=cur)

    def due(self, cur: duckdb.DuckDBPyConnection, run: int, *, final: bool) -> Applied | None:
        """What a snapshot written now would cover, if one is due; None otherwise.

        Due when the run has none from this process (its state was rebuilt, or is new), when
        its lineage moved since, or when SNAPSHOT_ROWS rows arrived since; the last two wait
        for SNAPSHOT_SECONDS and WRITE_SHARE x the last write's duration, except on a clean
        end (`final`)."""
        if not self.enabled:
            return None
        saved = self.saved.get(run)
        if saved is None:
            applied = Applied.now(cur, run)
            return applied if applied.seg_files else None
        rows = cur.execute("""SELECT coalesce(sum(n_rows), 0) FROM segments
            WHERE run = ? AND kind = 'seg' AND file_id > ?""",
                           [run, saved.applied.max_file_id]).fetchall()[0][0]
        lineage = dict(cur.execute("SELECT attempt, rolled_back_from_step FROM attempts "
                                   "WHERE run = ?", [run]).fetchall())
        if rows < max(1, self.rows) and lineage == saved.applied.lineage:
            return None
        wait = max(self.seconds, WRITE_SHARE * saved.seconds)
        if not final and time.monotonic() - saved.at < wait:
            return None
        return Applied.now(cur, run)

    def write(self, run: int, run_id: str, data: np.ndarray, top: int, applied: Applied,
              extra: dict[str, np.ndarray] | None = None) -> None:
        """Write one run's snapshot; a failure (a full disk) is logged once and leaves the
        service running: a missing snapshot costs only a slower restart."""
        t0 = time.monotonic()
        try:
            size = write_snapshot(self.directory, run, run_id, self.ledger_id, data, top,
                                  applied, extra)
        except OSError as exc:
            why = f"{type(exc).__name__}: {exc}"
            if why not in self._failed:
                self._failed.add(why)
                log.warning("run %s: could not write its state snapshot (%s); a restart will "
                            "rebuild the state from the ledger", run_id, why)
            return
        seconds = time.monotonic() - t0
        self.saved[run] = Saved(applied, time.monotonic(), seconds)
        log.info("run %s: state snapshot written (%s records, %.1f MB) in %.2f s", run_id,
                 f"{len(data):,}", size / 1e6, seconds)

    def restored(self, run: int, applied: Applied) -> None:
        self.saved[run] = Saved(applied, time.monotonic(), 0.0)

    def forget(self, runs: Iterable[int]) -> None:
        for run in runs:
            self.saved.pop(run, None)
