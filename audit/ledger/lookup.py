"""Record lookup index: which segment files hold a record key, or a content hash.

`GET /v1/runs/{run}/records/{key}` (and `?content_hash=`) answered by a scan of `consumption`
costs p50 70 ms at 20M rows on this 2-core box and grows with the ledger (seconds at 5B rows).
DuckDB's ART index answers in 2-13 ms, but it must fit in memory and made a 1M-row insert cost
5.5 s instead of 0.4 s (measured at 20M rows): too much for an ingester that must keep up. So
the ledger keeps its own index beside it (`<ledger>.lookup/`): sorted runs of (value, file id)
pairs, one kind for record keys and one for content hashes, built from `consumption` after each
ingested batch and merged as they accumulate (a log-structured merge). A lookup binary-searches
every run (an in-memory fence of every 4096th value, then a few pages of the run, memory-
mapped), then reads only those files' rows: `file_id IN (...)` prunes DuckDB's row groups by
their min/max, and files were inserted in file-id order. Files the index does not cover yet
(file id beyond its watermark) are scanned as before: the index only ever speeds a lookup up,
and a missing, stale or damaged index costs speed, never a wrong answer.

Crash safety: runs are derived data. Each is written to a temporary name, fsynced and renamed;
on load a run is kept only if its header names this ledger (its id) and matches the ledger's
`segments` (the files and rows of its file-id range), and the watermark is the end of the
contiguous runs from the start. Rows ingested after it are indexed again from `consumption`.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import xxhash

log = logging.getLogger("tally.lookup")

KINDS = {"key": ("record_key", np.dtype("<i8")), "hash": ("content_hash", np.dtype("<u8"))}
FENCE = 4096  # values per fence entry: a lookup reads at most 8 pages of a run
RUN_ROWS = 2**25  # runs stop merging at this size: a merge holds ~2 x 400 MB at most
# Runs of fewer rows stay in memory, merged there, until a merge reaches this size (or the
# ledger closes: `flush`); only then is one written. Merging from each batch's run (~0.4M rows
# at 128 hosts) up to RUN_ROWS rewrote each pair ~8 times on disk at 100M rows; the first ~3 of
# those rewrites now happen in memory (at most ~100 MB of pairs a kind). A crash loses them,
# and the next process indexes those files again from the ledger.
MEMORY_ROWS = 2**22
CHUNK_ROWS = 2**23  # rows indexed per catch_up call at most: a backlog drains between batches
MERGE_RATIO = 4  # a run merges into the one before it once it is at least 1/4 of its size
# 2: `rows` counts the segment rows indexed, `pairs` the distinct (value, file) pairs kept (a
# record's segments within one file, a document cut across rows of one step, are one pair)
_MAGIC = b"TLYLKP2\0"
_HEADER = np.dtype([("magic", "S8"), ("lo", "<i8"), ("hi", "<i8"), ("rows", "<i8"),
                    ("files", "<i8"), ("owner", "<i8"), ("pairs", "<i8"),
                    ("pad", "<i8")])  # 64 bytes
_NAME = re.compile(r"^(key|hash)-(\d{12})-(\d{12})\.run$")


@dataclass(frozen=True)
class Run:
    """Sorted (value, file id) pairs of the segment files with ids in (lo, hi]."""

    kind: str
    lo: int
    hi: int
    files: int
    rows: int  # the files' segment rows (the pairs are fewer where one file repeats a value)
    values: np.ndarray  # sorted; memory-mapped (or in memory: `on_disk` false)
    file_ids: np.ndarray  # int32, beside each value
    fence: np.ndarray  # values[::FENCE], in memory
    on_disk: bool = True

    @property
    def pairs(self) -> int:
        return len(self.values)

    def find(self, value: int) -> np.ndarray:
        """File ids of this run's pairs with `value`."""
        v = self.values.dtype.type(value)
        a = max(int(np.searchsorted(self.fence, v, "left")) - 1, 0) * FENCE
        b = min(int(np.searchsorted(self.fence, v, "right")) * FENCE, self.pairs)
        block = self.values[a:b]
        i, j = a + int(np.searchsorted(block, v, "left")), a + int(np.searchsorted(block, v,
                                                                                   "right"))
        return np.asarray(self.file_ids[i:j])


@dataclass(frozen=True)
class Coverage:
    """What the index holds at one moment: every run of each kind, tiling file ids (0, upto]."""

    upto: int
    runs: dict[str, tuple[Run, ...]]


class LookupIndex:
    """The lookup index of one ledger. One writer (the ingesting thread, `catch_up`); readers
    take `coverage` once per lookup (an immutable snapshot)."""

    def __init__(self, directory: Path, owner: int = 0) -> None:
        self.dir = Path(directory)
        self.owner = owner  # the ledger's id as a number, in every run's header
        self.coverage = Coverage(0, {k: () for k in KINDS})
        self._write = threading.Lock()

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def open(cls, ledger_path: Path, cur: duckdb.DuckDBPyConnection) -> LookupIndex:
        """The index beside `ledger_path`, keeping the runs that agree with the ledger."""
        index = cls(Path(f"{ledger_path}.lookup"), _owner(cur))
        found: dict[str, list[Run]] = {k: [] for k in KINDS}
        if index.dir.is_dir():
            for path in sorted(index.dir.iterdir()):
                if path.name.startswith("."):  # a temporary left by a killed writer
                    path.unlink(missing_ok=True)
                    continue
                run = _read_run(path, index.owner)
                if run is None:
                    # The same file and row counts are no proof: another ledger's index at
                    # this path (a copy, a restore) would agree with them and answer wrong.
                    log.warning("lookup index: %s is damaged, of another ledger or of an "
                                "earlier version; it is rebuilt", path.name)
                    path.unlink(missing_ok=True)
                    continue
                found[run.kind].append(run)
        tiles = {k: tuple(_tile(runs)) for k, runs in found.items()}
        kept, upto = _common(tiles, min(t[-1].hi if t else 0 for t in tiles.values()))
        kept, upto = _common(kept, _agreeing(cur, kept))
        index.coverage = Coverage(upto, kept)
        keep = {id(r) for t in index.coverage.runs.values() for r in t}
        for runs in found.values():  # runs merged away, ranges the ledger disowns
            for r in runs:
                if id(r) not in keep:
                    _path(index.dir, r.kind, r.lo, r.hi).unlink(missing_ok=True)
        return index

    # ---- reading ---------------------------------------------------------------------------
    def files_for(self, kind: str, value: int) -> tuple[list[int], int]:
        """(file ids holding `value`, the watermark): files beyond the watermark are not
        indexed yet and must be scanned."""
        cov = self.coverage
        found = [r.find(value) for r in cov.runs[kind]]
        ids = np.unique(np.concatenate(found)) if found else np.zeros(0, np.int32)
        return ids.tolist(), cov.upto

    # ---- writing (the ingesting thread) ----------------------------------------------------
    def catch_up(self, cur: duckdb.DuckDBPyConnection, budget_rows: int = CHUNK_ROWS) -> int:
        """Index committed segment files beyond the watermark, about `budget_rows` rows at most
        (at least one file); returns the rows indexed."""
        with self._write:
            done = 0
            while done < budget_rows:
                cov = self.coverage
                files = cur.execute("""SELECT file_id, n_rows FROM segments WHERE kind = 'seg'
                    AND file_id > ? ORDER BY file_id""", [cov.upto]).fetchall()
                top = cur.execute("SELECT coalesce(max(file_id), 0) FROM segments").fetchall()
                top = int(top[0][0])
                if not files:
                    if top > cov.upto:  # only metric files beyond: nothing to index in them
                        self.coverage = Coverage(top, cov.runs)
                    return done
                ids = np.array([f for f, _ in files], np.int64)
                rows = np.cumsum([n for _, n in files])
                last = max(int(np.searchsorted(rows, budget_rows - done, "right")), 1)
                hi = int(ids[last - 1]) if last < len(ids) else top
                want = int(rows[last - 1])
                got = cur.execute("""SELECT record_key, content_hash, file_id FROM consumption
                    WHERE file_id > ? AND file_id <= ?""", [cov.upto, hi]).fetchnumpy()
                if len(got["file_id"]) != want:
                    raise RuntimeError(f"lookup index: files {cov.upto + 1}..{hi} hold "
                                       f"{len(got['file_id'])} rows, their segments say {want}")
                fid = np.asarray(got["file_id"], np.int32)
                runs = dict(cov.runs)
                for kind, (col, dtype) in KINDS.items():
                    values, ids = _sorted_pairs(np.asarray(got[col]).astype(dtype, copy=False),
                                                fid)
                    new = _new_run(self.dir, kind, cov.upto, hi, last, values, ids, self.owner,
                                   want, on_disk=want >= MEMORY_ROWS)
                    runs[kind] = _merged(self.dir, (*cov.runs[kind], new), self.owner)
                self.coverage = Coverage(hi, runs)
                done += want
            return done

    def flush(self) -> None:
        """Write the runs held in memory, as one run a kind (the ledger's closing: the next
        process need not index those files again)."""
        with self._write:
            cov = self.coverage
            runs = dict(cov.runs)
            for kind, t in cov.runs.items():
                disk = [r for r in t if r.on_disk]
                mem = t[len(disk):]
                if not mem:
                    continue
                values = np.concatenate([r.values for r in mem])
                order = np.argsort(values, kind="stable")  # sorted runs: one timsort pass
                runs[kind] = (*disk, _write_run(
                    self.dir, kind, mem[0].lo, mem[-1].hi, sum(r.files for r in mem),
                    values[order], np.concatenate([r.file_ids for r in mem])[order], self.owner,
                    rows=sum(r.rows for r in mem)))
            self.coverage = Coverage(cov.upto, runs)

    def size_bytes(self) -> int:
        return sum(r.pairs * 12 for t in self.coverage.runs.values() for r in t)


def for_ledger(ledger) -> LookupIndex:
    """The lookup index of a writable ledger, opened once per process (audit.ledger.ingest
    keeps it up to date; audit.ledger.queries.record reads it)."""
    index = getattr(ledger, "_lookup", None)
    if index is None:
        cur = ledger.cursor()
        try:
            index = LookupIndex.open(ledger.path, cur)
        finally:
            cur.close()
        ledger._lookup = index
    return index


# ---- runs on disk ------------------------------------------------------------------------------

def _path(directory: Path, kind: str, lo: int, hi: int) -> Path:
    return directory / f"{kind}-{lo:012d}-{hi:012d}.run"


def _owner(cur: duckdb.DuckDBPyConnection) -> int:
    """The ledger's id as the number run headers carry (0 for a ledger without one)."""
    row = cur.execute("SELECT value FROM meta WHERE key = 'ledger_id'").fetchall()
    return xxhash.xxh3_64_intdigest(str(row[0][0]).encode()) >> 1 if row else 0


def _sorted_pairs(values: np.ndarray, file_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(value, file id) pairs sorted by value, each distinct pair once. Values and file ids
    packed in one int64 where they fit (record keys: a plain sort, no argsort and gathers);
    else by an argsort of the values (content hashes; numpy's default sort, 6 ms for 430k
    values on this box against 33 ms for a stable one), keeping repeats."""
    if not len(values):
        return values, file_ids
    lo = int(file_ids.min())
    width = (int(file_ids.max()) - lo).bit_length()
    if values.dtype.kind == "i" and int(values.min()) >= 0 and \
            int(values.max()).bit_length() + width <= 63:
        code = np.sort(values.astype(np.int64) << width | (file_ids - lo))
        code = code[np.r_[True, code[1:] != code[:-1]]]
        return (code >> width).astype(values.dtype), (code & ((1 << width) - 1)).astype(
            np.int32) + lo
    order = np.argsort(values)
    return values[order], file_ids[order]


def _new_run(directory: Path, kind: str, lo: int, hi: int, files: int, values: np.ndarray,
             file_ids: np.ndarray, owner: int, rows: int, *, on_disk: bool) -> Run:
    if on_disk:
        return _write_run(directory, kind, lo, hi, files, values, file_ids, owner, rows)
    return Run(kind, lo, hi, files, rows, values, file_ids, np.array(values[::FENCE]), False)


def _write_run(directory: Path, kind: str, lo: int, hi: int, files: int, values: np.ndarray,
               file_ids: np.ndarray, owner: int = 0, rows: int | None = None) -> Run:
    """`rows`: the segment rows the pairs index (len(values) unless pairs were merged)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = _path(directory, kind, lo, hi)
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    header = np.zeros(1, _HEADER)
    header[0] = (_MAGIC, lo, hi, len(values) if rows is None else rows, files, owner,
                 len(values), 0)
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        # The arrays' own buffers: a tobytes() copy of each cost as much as the write.
        f.write(np.ascontiguousarray(values, KINDS[kind][1]).data)
        f.write(np.ascontiguousarray(file_ids, np.int32).data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    run = _read_run(path, owner)
    assert run is not None
    return run


def _read_run(path: Path, owner: int = 0) -> Run | None:
    """The run in `path`, or None when its name, header, owner or size disagree."""
    m = _NAME.match(path.name)
    if m is None:
        return None
    kind, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
    try:
        size = path.stat().st_size
        if size < _HEADER.itemsize:
            return None
        header = np.fromfile(path, _HEADER, count=1)[0]
        n = int(header["pairs"])
        if (bytes(header["magic"]) != _MAGIC.rstrip(b"\0") or int(header["lo"]) != lo
                or int(header["hi"]) != hi or n < 0 or size != _HEADER.itemsize + 12 * n
                or int(header["owner"]) != owner or int(header["rows"]) < n):
            return None
        dtype = KINDS[kind][1]
        if n == 0:
            values, file_ids = np.zeros(0, dtype), np.zeros(0, np.int32)
        else:
            values = np.memmap(path, dtype, "r", offset=_HEADER.itemsize, shape=(n,))
            file_ids = np.memmap(path, np.int32, "r", offset=_HEADER.itemsize + 8 * n,
                                 shape=(n,))
        return Run(kind, lo, hi, int(header["files"]), int(header["rows"]), values, file_ids,
                   np.array(values[::FENCE]))
    except (OSError, ValueError):
        return None


def _tile(runs: list[Run]) -> list[Run]:
    """The runs that tile (0, hi] from the start, widest first where they overlap (a merge
    killed before it removed its inputs leaves both)."""
    by_lo: dict[int, Run] = {}
    for r in runs:
        if r.lo not in by_lo or r.hi > by_lo[r.lo].hi:
            by_lo[r.lo] = r
    out, at = [], 0
    while at in by_lo:
        out.append(by_lo[at])
        at = by_lo[at].hi
    return out


def _common(tiles: dict[str, tuple[Run, ...]], limit: int
            ) -> tuple[dict[str, tuple[Run, ...]], int]:
    """Each kind's runs within (0, limit], cut back to the end that every kind reaches with whole
    runs. A writer killed between the kinds can leave one kind's newest run merged across the
    other's end: a watermark beyond a kind's last whole run would hide the files between from
    both that kind's runs and the scan of the files beyond the watermark."""
    while True:
        kept = {k: tuple(r for r in t if r.hi <= limit) for k, t in tiles.items()}
        end = min(t[-1].hi if t else 0 for t in kept.values())
        if end == limit:
            return kept, limit
        limit = end


def _agreeing(cur: duckdb.DuckDBPyConnection, runs: dict[str, tuple[Run, ...]]) -> int:
    """The end of the longest prefix of runs whose file and row counts match the ledger's."""
    ends = sorted({r.hi for t in runs.values() for r in t})
    if not ends:
        return 0
    ranges = sorted({(r.lo, r.hi) for t in runs.values() for r in t})
    counts = dict(((lo, hi), (f, n)) for lo, hi, f, n in cur.execute("""
        SELECT r.lo, r.hi, count(s.file_id), coalesce(sum(s.n_rows), 0)
        FROM (SELECT unnest($1::BIGINT[]) AS lo, unnest($2::BIGINT[]) AS hi) r
        LEFT JOIN segments s ON s.kind = 'seg' AND s.file_id > r.lo AND s.file_id <= r.hi
        GROUP BY ALL""", [[lo for lo, _ in ranges], [hi for _, hi in ranges]]).fetchall())
    upto = 0
    for end in ends:
        ok = all(counts.get((r.lo, r.hi)) == (r.files, r.rows)
                 for t in runs.values() for r in t if r.hi == end)
        if not ok:
            break
        upto = end
    return upto


def _merged(directory: Path, runs: tuple[Run, ...], owner: int = 0) -> tuple[Run, ...]:
    """Merge the newest runs while the newest is at least 1 / MERGE_RATIO of the one before
    (and the result stays under RUN_ROWS): O(log rows) runs, each pair rewritten O(log) times."""
    runs = list(runs)
    while len(runs) >= 2:
        a, b = runs[-2], runs[-1]
        # By rows, not pairs: both kinds' runs then tile the file ids alike, so that losing
        # one kind's newest run costs the other kind's coverage only that far back.
        if b.rows * MERGE_RATIO < a.rows or a.rows + b.rows > RUN_ROWS:
            break
        values = np.concatenate([a.values, b.values])
        # Two sorted runs: the stable sort (a timsort) finds them and merges them in one pass.
        order = np.argsort(values, kind="stable")
        # On disk once either was (its file goes: the merged one must cover it) or at size.
        merged = _new_run(directory, a.kind, a.lo, b.hi, a.files + b.files, values[order],
                          np.concatenate([a.file_ids, b.file_ids])[order], owner,
                          a.rows + b.rows, on_disk=a.on_disk or b.on_disk
                          or a.rows + b.rows >= MEMORY_ROWS)
        for old in (a, b):
            if old.on_disk:
                _path(directory, old.kind, old.lo, old.hi).unlink(missing_ok=True)
        runs[-2:] = [merged]
    return tuple(runs)
