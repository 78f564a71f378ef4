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
Each run carries a checksum of its header and codes, verified when it is mapped: bytes changed
inside a run whose header still agrees (zeros from a bad sector or a torn copy) would make
consumed records answer 404 "never consumed", so such a run is rebuilt from the ledger's rows
of its own files.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import xxhash

from tally.audit.core.paths import atomic_write

log = logging.getLogger("tally.lookup")

# Each kind's column, and the left shift that puts its values' bits at the top of 64 (keys are
# below tally.audit.core.schema.MAX_RECORD_KEY, 2^40; hashes fill 64 bits).
KINDS = {"key": ("record_key", 24), "hash": ("content_hash", 0)}
_KEY_LIMIT = 1 << 40
FENCE = 4096  # values per fence entry: a lookup reads at most 8 pages of a run
RUN_ROWS = 2**26  # runs stop merging at this size: a merge holds ~512 MB of codes at most
# Runs of fewer rows stay in memory, merged there, until a merge reaches this size (or the
# ledger closes: `flush`); only then is one written. Merging from each batch's run (~0.4M rows
# at 128 hosts) up to RUN_ROWS rewrote each pair ~8 times on disk at 100M rows; the first ~3 of
# those rewrites now happen in memory (at most ~100 MB of pairs a kind). A crash loses them,
# and the next process indexes those files again from the ledger.
MEMORY_ROWS = 2**22
CHUNK_ROWS = 2**23  # rows indexed per catch_up call at most: a backlog drains between batches
# Runs merge FAN_IN at a time, once the newest FAN_IN are of one size tier (tiers a factor of
# FAN_IN apart): a pair is sorted again once a tier, log4 of RUN_ROWS over a batch's rows (~4
# times from 1M-row batches), where merging two at a time sorted it log2 times (~6: the sorts
# were half the index's 56 s at 100M rows); a lookup searches at most FAN_IN - 1 runs a tier.
FAN_IN = 4
# 2: one uint64 a pair (`Run`), `rows` the segment rows indexed and `pairs` the distinct codes
# kept (a record's segments within one file, a document cut across rows of one step, are one);
# 3: `digest`, xxh3_64 of the header (digest 0) and the codes, checked when a run is mapped
_MAGIC = b"TLYLKP3\0"
_HEADER = np.dtype([("magic", "S8"), ("lo", "<i8"), ("hi", "<i8"), ("rows", "<i8"),
                    ("files", "<i8"), ("owner", "<i8"), ("pairs", "<i8"),
                    ("width", "<i8"), ("digest", "<u8")])  # 72 bytes
_NAME = re.compile(r"^(key|hash)-(\d{12})-(\d{12})\.run$")


@dataclass(frozen=True)
class Run:
    """The (value, file id) pairs of the segment files with ids in (lo, hi], as sorted uint64
    codes: the value's top bits (`top`) above `width` bits of the file id (minus lo + 1), so
    that one plain sort orders them, with no index arrays to gather, and a pair takes 8 bytes.
    A record key fits whole (40 bits) while a run spans at most 2^24 file ids; a content hash
    keeps its top 64 - width bits. A code names the files whose rows *may* hold the value: a
    lookup reads only those files' rows and filters them by the exact value (tally.audit.ledger.
    queries.record), so a shared prefix costs a few rows read, never a wrong answer."""

    kind: str
    lo: int
    hi: int
    files: int
    rows: int  # the files' segment rows (the pairs are fewer where one file repeats a value)
    width: int  # bits of file id in a code
    codes: np.ndarray  # uint64, sorted; memory-mapped (or in memory: `on_disk` false)
    fence: np.ndarray  # codes[::FENCE], in memory
    on_disk: bool = True
    intact: bool = True  # false: its checksum failed when mapped (rebuilt when kept)

    @property
    def pairs(self) -> int:
        return len(self.codes)

    def find(self, value: int) -> np.ndarray:
        """File ids of this run's pairs that may hold `value`."""
        first = np.uint64(top(self.kind, value, self.width))
        last = np.uint64(int(first) | ((1 << self.width) - 1))
        a = max(int(np.searchsorted(self.fence, first, "left")) - 1, 0) * FENCE
        b = min(int(np.searchsorted(self.fence, last, "right")) * FENCE, self.pairs)
        block = self.codes[a:b]
        i, j = (a + int(np.searchsorted(block, first, "left")),
                a + int(np.searchsorted(block, last, "right")))
        return file_ids(self, np.asarray(self.codes[i:j]))


def top(kind: str, values, width: int):
    """The bits of `values` (an int or an array) that codes of `width` file-id bits keep,
    in place: the rest of a code."""
    shift = KINDS[kind][1]
    if isinstance(values, np.ndarray):
        v = values.astype(np.uint64) << np.uint64(shift)
        return v >> np.uint64(width) << np.uint64(width)
    return ((int(values) << shift) & 0xFFFF_FFFF_FFFF_FFFF) >> width << width


def file_ids(run: Run, codes: np.ndarray) -> np.ndarray:
    return (codes & np.uint64((1 << run.width) - 1)).astype(np.int64) + run.lo + 1


def _width(lo: int, hi: int) -> int:
    return max(hi - lo - 1, 0).bit_length()


def _codes(kind: str, values: np.ndarray, fids: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Sorted distinct codes of (value, file id) pairs of files in (lo, hi]."""
    width = _width(lo, hi)
    code = top(kind, values, width) | (np.asarray(fids, np.int64) - lo - 1).astype(np.uint64)
    code.sort()  # numpy's default sort (SIMD): 2 ms for 430k, against 33 ms for a stable argsort
    return code[np.r_[True, code[1:] != code[:-1]]] if len(code) else code


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
        index._rebuild_damaged(cur)
        return index

    def _rebuild_damaged(self, cur: duckdb.DuckDBPyConnection) -> None:
        """Rebuild from the ledger each kept run whose checksum failed: its header agrees with
        the ledger (its range, files and rows), so only its own files are indexed again, and
        the runs after it stay. A rebuild that fails drops the run and those after it (their
        files are scanned, then indexed again by the next catch-up)."""
        cov = self.coverage
        runs = {k: list(t) for k, t in cov.runs.items()}
        upto = cov.upto
        for kind, t in runs.items():
            for i, r in enumerate(t):
                if r.intact:
                    continue
                try:
                    t[i] = _rebuild(cur, self.dir, r, self.owner)
                except Exception as exc:  # noqa: BLE001 (a disk full: lookups scan instead)
                    log.warning("lookup index: %s fails its checksum and could not be rebuilt "
                                "(%s: %s); its files are scanned until indexed again",
                                _path(self.dir, kind, r.lo, r.hi).name, type(exc).__name__, exc)
                    upto = min(upto, r.lo)
                    break
                log.warning("lookup index: %s fails its checksum (bytes changed on disk); "
                            "rebuilt from the ledger", _path(self.dir, kind, r.lo, r.hi).name)
        if upto < cov.upto:
            kept, upto = _common({k: tuple(t) for k, t in runs.items()}, upto)
            for kind, t in runs.items():
                for r in t[len(kept[kind]):]:
                    _path(self.dir, kind, r.lo, r.hi).unlink(missing_ok=True)
            self.coverage = Coverage(upto, kept)
        else:
            self.coverage = Coverage(upto, {k: tuple(t) for k, t in runs.items()})

    # ---- reading ---------------------------------------------------------------------------
    def files_for(self, kind: str, value: int) -> tuple[list[int], int]:
        """(file ids holding `value`, the watermark): files beyond the watermark are not
        indexed yet and must be scanned."""
        cov = self.coverage
        found = [r.find(value) for r in cov.runs[kind]]
        ids = np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)
        return ids.tolist(), cov.upto

    # ---- writing (the ingesting thread) ----------------------------------------------------
    def catch_up(self, cur: duckdb.DuckDBPyConnection, budget_rows: int = CHUNK_ROWS,
                 columns: Mapping[int, tuple] | None = None) -> int:
        """Index committed segment files beyond the watermark, about `budget_rows` rows at most
        (at least one file); returns the rows indexed. `columns`: file id -> (record keys,
        content hashes) of files the caller has just committed, as it inserted them: a chunk
        whose files are all there is indexed from them rather than read back from the
        ledger."""
        with self._write:
            done = 0
            while done < budget_rows:
                cov = self.coverage
                # The listing, the end and the rows from one snapshot: the ingester commits
                # beside this. The end was once a query of its own (max(file_id)): a batch
                # committed between it and the listing moved the watermark past files never
                # listed, which were then never indexed (their lookups missed rows).
                cur.execute("BEGIN TRANSACTION")
                ended = False
                try:
                    listed = cur.execute("""SELECT file_id, n_rows, kind = 'seg' FROM segments
                        WHERE file_id > ? ORDER BY file_id""", [cov.upto]).fetchall()
                    files = [(f, n) for f, n, seg in listed if seg]
                    if not files:
                        if listed:  # only metric files beyond: nothing to index in them
                            self.coverage = Coverage(int(listed[-1][0]), cov.runs)
                        return done
                    ids = np.array([f for f, _ in files], np.int64)
                    rows = np.cumsum([n for _, n in files])
                    last = max(int(np.searchsorted(rows, budget_rows - done, "right")), 1)
                    hi = int(ids[last - 1]) if last < len(ids) else int(listed[-1][0])
                    want = int(rows[last - 1])
                    got = _held(columns, ids[:last]) if columns else None
                    if got is None:
                        got = _pairs(cur, cov.upto, hi)
                except BaseException:
                    ended = True
                    cur.execute("ROLLBACK")  # a read: nothing to keep, whatever failed
                    raise
                finally:
                    if not ended:
                        cur.execute("COMMIT")
                if len(got["file_id"]) != want:
                    raise RuntimeError(f"lookup index: files {cov.upto + 1}..{hi} hold "
                                       f"{len(got['file_id'])} rows, their segments say {want}")
                fid = np.asarray(got["file_id"], np.int64)
                keys = np.asarray(got["record_key"])
                if len(keys) and not 0 <= int(keys.min()) <= int(keys.max()) < _KEY_LIMIT:
                    raise RuntimeError(f"lookup index: a record key beyond 0..{_KEY_LIMIT - 1}")
                runs = dict(cov.runs)
                for kind, (col, _) in KINDS.items():
                    codes = _codes(kind, np.asarray(got[col]), fid, cov.upto, hi)
                    new = _new_run(self.dir, kind, cov.upto, hi, last, codes, self.owner, want,
                                   on_disk=want >= MEMORY_ROWS)
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
                if all(r.on_disk for r in t):
                    continue
                # Runs held in memory need not all follow those on disk: a catch-up chunk of
                # MEMORY_ROWS or more goes to disk at once, after runs still in memory. Each
                # unbroken stretch of them becomes one run, so the runs still tile the files.
                out: list = []
                for on_disk, group in itertools.groupby(t, key=lambda r: r.on_disk):
                    group = list(group)
                    if on_disk:
                        out += group
                        continue
                    lo, hi = group[0].lo, group[-1].hi
                    out.append(_write_run(self.dir, kind, lo, hi, sum(r.files for r in group),
                                          _recoded(group, lo, hi), self.owner,
                                          sum(r.rows for r in group)))
                runs[kind] = tuple(out)
            self.coverage = Coverage(cov.upto, runs)

    def size_bytes(self) -> int:
        return sum(r.pairs * 8 for t in self.coverage.runs.values() for r in t)


def for_ledger(ledger) -> LookupIndex:
    """The lookup index of a writable ledger, opened once per process (tally.audit.ledger.ingest
    keeps it up to date; tally.audit.ledger.queries.record reads it)."""
    index = ledger._lookup
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


def _pairs(cur: duckdb.DuckDBPyConnection, lo: int, hi: int) -> dict[str, np.ndarray]:
    """The indexed columns of the segment rows of files (lo, hi]."""
    return cur.execute("""SELECT record_key, content_hash, file_id FROM consumption
        WHERE file_id > ? AND file_id <= ?""", [lo, hi]).fetchnumpy()


def _held(columns: Mapping[int, tuple], ids: np.ndarray) -> dict[str, np.ndarray] | None:
    """`_pairs` of the files `ids` from the columns their ingest held (None unless it holds
    every one of them): read back from the ledger, they cost ~0.65 CPU s for 20M rows on this
    2-core box, in DuckDB's threads beside the next batch's INSERT."""
    held = [columns.get(int(f)) for f in ids]
    if any(h is None for h in held):
        return None
    keys = pa.chunked_array([c for k, _ in held for c in k.chunks], pa.int64())
    hashes = pa.chunked_array([c for _, h in held for c in h.chunks], pa.uint64())
    return {"record_key": keys.to_numpy(), "content_hash": hashes.to_numpy(),
            "file_id": np.repeat(ids, [len(k) for k, _ in held])}


def _rebuild(cur: duckdb.DuckDBPyConnection, directory: Path, run: Run, owner: int) -> Run:
    """`run` (a damaged one) written again from the ledger's rows of its files."""
    got = _pairs(cur, run.lo, run.hi)
    if len(got["file_id"]) != run.rows:
        raise RuntimeError(f"files {run.lo + 1}..{run.hi} hold {len(got['file_id'])} rows, "
                           f"the run says {run.rows}")
    codes = _codes(run.kind, np.asarray(got[KINDS[run.kind][0]]),
                   np.asarray(got["file_id"], np.int64), run.lo, run.hi)
    return _write_run(directory, run.kind, run.lo, run.hi, run.files, codes, owner, run.rows)


def _digest(header: np.ndarray, codes: np.ndarray) -> int:
    """xxh3_64 of a run's header (its digest field as 0) and codes, taken once when the run is
    mapped: 15 ms for a run of 32M pairs (256 MB) from the page cache."""
    head = header.copy()
    head["digest"] = 0
    h = xxhash.xxh3_64(head.tobytes())
    if len(codes):
        h.update(memoryview(np.ascontiguousarray(codes, np.uint64)).cast("B"))
    return h.intdigest()


def _owner(cur: duckdb.DuckDBPyConnection) -> int:
    """The ledger's id as the number run headers carry (0 for a ledger without one)."""
    row = cur.execute("SELECT value FROM meta WHERE key = 'ledger_id'").fetchall()
    return xxhash.xxh3_64_intdigest(str(row[0][0]).encode()) >> 1 if row else 0


def _new_run(directory: Path, kind: str, lo: int, hi: int, files: int, codes: np.ndarray,
             owner: int, rows: int, *, on_disk: bool) -> Run:
    if on_disk:
        return _write_run(directory, kind, lo, hi, files, codes, owner, rows)
    return Run(kind, lo, hi, files, rows, _width(lo, hi), codes, np.array(codes[::FENCE]), False)


def _recoded(runs: list[Run] | tuple[Run, ...], lo: int, hi: int) -> np.ndarray:
    """The codes of consecutive runs as one run's over (lo, hi]: a wider file-id field, fewer
    bits of value."""
    width = _width(lo, hi)
    code = np.empty(sum(r.pairs for r in runs), np.uint64)  # filled in place: one copy at most
    at = 0
    for r in runs:
        part = code[at: at + r.pairs]
        if r.width == width and r.lo == lo:
            part[:] = r.codes
        else:
            np.right_shift(r.codes, np.uint64(width), out=part)  # its value bits that still fit
            part <<= np.uint64(width)
            part |= (file_ids(r, np.asarray(r.codes)) - lo - 1).astype(np.uint64)
        at += r.pairs
    # Runs one after another, each sorted or nearly (a widened field reorders only pairs that
    # now share their value bits): a stable sort (timsort) merges them. numpy's default sort
    # does not look for runs, and on this box's AMD EPYC (no SIMD sort) it took 2,356 ms for 4
    # runs of 4M codes, the stable one 198 ms.
    code.sort(kind="stable")
    # The runs hold other files: a repeat is two values sharing what the wider field kept.
    if len(code) > 1 and (code[1:] == code[:-1]).any():
        code = code[np.r_[True, code[1:] != code[:-1]]]
    return code


def _write_run(directory: Path, kind: str, lo: int, hi: int, files: int, codes: np.ndarray,
               owner: int = 0, rows: int | None = None) -> Run:
    """`rows`: the segment rows the codes index (len(codes) unless pairs repeated)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = _path(directory, kind, lo, hi)
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    header = np.zeros(1, _HEADER)
    header[0] = (_MAGIC, lo, hi, len(codes) if rows is None else rows, files, owner,
                 len(codes), _width(lo, hi), 0)
    header["digest"] = _digest(header, codes)
    # Past the page cache (O_DIRECT where the file system allows it): a run is read back whole
    # at most once (the merge into the next tier; the last tier only by lookups, a few pages
    # each), and its cache pages cost more than the write on this VM (~25 us a new page).
    codes = np.ascontiguousarray(codes, np.uint64)
    with atomic_write(path, tmp, page_cache=False) as f:
        f.write(header.tobytes())
        f.write(codes.data)  # the array's own buffer: a tobytes() copy cost as much as the write
    # Its digest was just taken from these codes, and its fence is theirs: the file is not
    # read back here (a fence of every 4096th code would read most of its pages from disk).
    run = _read_run(path, owner, verify=False, fence=np.array(codes[::FENCE]))
    assert run is not None
    return run


def _read_run(path: Path, owner: int = 0, *, verify: bool = True,
              fence: np.ndarray | None = None) -> Run | None:
    """The run in `path`, or None when its name, header, owner or size disagree; `intact`
    false when its checksum does not (`verify`). `fence`: its codes' every FENCE-th, when the
    caller has them (else read from the file)."""
    m = _NAME.match(path.name)
    if m is None:
        return None
    kind, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
    try:
        size = path.stat().st_size
        if size < _HEADER.itemsize:
            return None
        head = np.fromfile(path, _HEADER, count=1)
        header = head[0]
        n = int(header["pairs"])
        if (bytes(header["magic"]) != _MAGIC.rstrip(b"\0") or int(header["lo"]) != lo
                or int(header["hi"]) != hi or n < 0 or size != _HEADER.itemsize + 8 * n
                or int(header["owner"]) != owner or int(header["rows"]) < n
                or int(header["width"]) != _width(lo, hi)):
            return None
        codes = np.zeros(0, np.uint64) if n == 0 else \
            np.memmap(path, np.uint64, "r", offset=_HEADER.itemsize, shape=(n,))
        intact = not verify or _digest(head, codes) == int(header["digest"])
        return Run(kind, lo, hi, int(header["files"]), int(header["rows"]), _width(lo, hi),
                   codes, np.array(codes[::FENCE]) if fence is None else fence,
                   intact=intact)
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


def _tier(run: Run) -> int:
    return max(run.rows, 1).bit_length() // (FAN_IN.bit_length() - 1)


def _merged(directory: Path, runs: tuple[Run, ...], owner: int = 0) -> tuple[Run, ...]:
    """Merge the newest FAN_IN runs while none is of a lower tier than the oldest of them (a
    small run left behind by larger batches after it goes with them) and together they stay
    within RUN_ROWS. Tiers are by rows, not pairs: both kinds' runs then tile the file ids
    alike, so that losing one kind's newest run costs the other's coverage only that far
    back."""
    runs = list(runs)
    while len(runs) >= FAN_IN:
        tail = runs[-FAN_IN:]
        if _tier(tail[0]) > min(_tier(r) for r in tail[1:]) or \
                sum(r.rows for r in tail) > RUN_ROWS:
            break
        lo, hi, rows = tail[0].lo, tail[-1].hi, sum(r.rows for r in tail)
        # On disk once any was (its file goes: the merged one must cover it) or at size.
        merged = _new_run(directory, tail[0].kind, lo, hi, sum(r.files for r in tail),
                          _recoded(tail, lo, hi), owner, rows,
                          on_disk=any(r.on_disk for r in tail) or rows >= MEMORY_ROWS)
        for old in tail:
            if old.on_disk:
                _path(directory, old.kind, old.lo, old.hi).unlink(missing_ok=True)
        runs[-FAN_IN:] = [merged]
    return tuple(runs)
