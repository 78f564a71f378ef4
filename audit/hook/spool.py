"""The spool: append-only Parquet files that hosts publish and one ingester reads.

`<spool>/<run_id>/attempt=<a>/host=<h>/seg-<first_step:012d>-<seq:06d>.parquet` holds consumed
segments; `met-...` files beside them hold metrics (train loss, eval loss). Files appear only
by rename from a dot-prefixed temporary name, so a listing never sees a partial file.
This module is the one definition of names, layout and metadata keys; the columns come from
tally.audit.core.schema.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import sys
import time
import uuid
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from tally.audit.core.schema import (
    MAX_DECODED_BYTES,
    MAX_EPOCH,
    MAX_FILE_ROWS,
    MAX_HOSTS,
    MAX_METRIC_NAME,
    MAX_RECORD_KEY,
    MAX_STEP,
    METRIC_SCHEMA,
    RUN_ID_PATTERN,
    SEGMENT_LOSS,
    SEGMENT_SCHEMA,
    SEGMENT_SCHEMA_WITH_LOSS,
)
from tally.audit.hook.segments import MINIMUM

FORMAT_VERSION = "1"
WRITER_VERSION = "tally-writer/1"
# `tally replay` (tally.pipeline.replay) writes a run's spool from its loader's contract instead of
# from the run: its files say `tally.replayed = "1"` and a writer_version under REPLAY_WRITER.
# The ledger keeps each attempt's writer_version (no mark of its own), so the rule of which
# files, attempts and runs are replayed lives here, once, in both forms: `is_replayed` (a
# file's metadata), `replayed_sql` (a ledger attempt) and `replayed_run` (a whole run).
REPLAY_WRITER = "tally-replay/"
REPLAY_WRITER_VERSION = f"{REPLAY_WRITER}1"

# The schemas a file of each kind may have (the segment loss column is optional).
SCHEMAS = {"seg": (SEGMENT_SCHEMA, SEGMENT_SCHEMA_WITH_LOSS), "met": (METRIC_SCHEMA,)}

# File metadata keys (all values are strings in Parquet's key-value metadata).
META_KEYS = (
    "format_version",
    "run_id",
    "attempt",
    "host",
    "host_count",
    "resumed_from_step",  # "" for a fresh attempt
    "writer_version",
    "manifest_fingerprint",  # "" when the run did not say
    "kind",
    "rows",
    "first_step",
    "last_step",
)
# Optional keys: files written before they existed lack them.
OPTIONAL_META_KEYS = (
    "records_per_epoch",  # train records N the loader cycles through; "" when the run did not say
    "checkpoint_dir",  # where the run saves its checkpoints (the service may read only there)
    "replayed",  # "1": written by `tally replay` from the loader's contract, not by the run
    # A random id of one host's spool of one attempt, the same in all its files: made by the
    # writer that finds the host's directory without published files, kept by one that
    # continues it (tally.audit.hook.writer). The ledger refuses files of another spool id for an
    # attempt and host it holds: a run id reused after its spool was removed.
    "spool_id",
    # What the loop's content hashes are taken over (tally.pipeline.text.ContentBasis, JSON): said
    # by
    # a loop that tokenizes text on the fly or hashes bytes; "" when the run did not say
    # (unknown: never a finding). Reconcile compares it with the manifest's.
    "content_basis",
)
META_PREFIX = "tally."
# A metric row a writer publishes when its host's share of the attempt ended at the run's last
# step (LedgerWriter.finish): the run is finished when every host of its last attempt said so.
# Spools written before it existed stay valid: their runs read as not finished.
FINISHED = "tally/finished"

_RUN_ID = re.compile(RUN_ID_PATTERN)
# Steps take 12 digits or more (int64 steps: up to 19), sequence numbers 6 or more.
_FILE = re.compile(r"^(seg|met)-(\d{12,19})-(\d{6,19})\.parquet$")
ATTEMPT_DIR = re.compile(r"^attempt=(\d+)$")
_HOST_DIR = re.compile(r"^host=(\d+)$")


def is_replayed(meta: Mapping[str, str], prefix: str = "") -> bool:
    """A spool file written by `tally replay`, from its metadata (`prefix`: META_PREFIX for the
    file's raw key-value metadata): marked `replayed = "1"`, or by a replay's writer_version.
    A ledger keeps only the writer_version (per attempt, `replayed_sql`): a file marked only
    by `replayed` and written by another writer reads as replayed from its spool alone."""
    return (meta.get(f"{prefix}replayed") == "1"
            or (meta.get(f"{prefix}writer_version") or "").startswith(REPLAY_WRITER))


def replayed_sql(attempts: str = "a") -> str:
    """The ledger's form of the rule: the attempt (table alias `attempts`) was written by
    `tally replay` (its writer_version, which ingest keeps from the attempt's files)."""
    return f"starts_with({attempts}.writer_version, '{REPLAY_WRITER}')"


def replayed_run(replayed_files: int, segment_files: int) -> bool:
    """A run's consumption is replayed when `tally replay` wrote every one of its segment files
    (and it has one); a run with some of them is reported as mixed, by its count."""
    return 0 < replayed_files == segment_files


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise ValueError(
            f"run id {run_id!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return run_id


def host_dir(spool: Path, run_id: str, attempt: int, host: int) -> Path:
    return Path(spool) / check_run_id(run_id) / f"attempt={attempt}" / f"host={host}"


def file_name(kind: str, first_step: int, seq: int) -> str:
    return f"{kind}-{first_step:012d}-{seq:06d}.parquet"


def temp_name(final_name: str) -> str:
    """Dot-prefixed so that no listing of published files can see it, and one of its own for
    each call: two writers of one host writing the same name (a misconfigured host id, a run
    relaunched while it runs) once shared one temporary file, and the file the first renamed
    into place took the second's bytes as well: published, and unreadable."""
    return f".{final_name}.{uuid.uuid4().hex[:12]}.tmp"


@dataclass(frozen=True, slots=True)
class SpoolFile:
    """A published spool file, identified by its path relative to the spool root. Slotted, and
    its `path` made when asked from its directory's, which its directory's files share: the
    live reconcile holds one for each of a run's files (the seed run's ~3.6M), and a `Path` of
    its own was 340 of its ~700 bytes."""

    folder: Path  # its directory
    rel: str
    run_id: str
    attempt: int
    host: int
    kind: str
    first_step: int
    seq: int

    @property
    def path(self) -> Path:
        return self.folder / self.rel[self.rel.rfind("/") + 1:]


@dataclass(frozen=True)
class Stray:
    """A file in the spool tree that is not a published spool file."""

    path: Path
    rel: str
    reason: str


def scan(spool: Path, skip_host_dir: Callable[[str, int], bool] | None = None,
         known: Mapping[str, Container[str]] | None = None,
         ) -> Iterator[tuple[SpoolFile | Stray, os.stat_result]]:
    """Every published file and every stray entry under `spool`, in a stable order, each with
    its stat (of the file itself; of the link, for a link that leads nowhere).

    Only regular files (or links to them) are spool files: a FIFO, socket or device named like
    one would hang or break a reader, so it is a Stray, and so is a dangling link or a link
    loop. A directory that cannot be listed is a Stray too; the other directories are still
    listed. Hidden files (temporaries of writers still running, or of killed ones) are skipped,
    and so is every `<run>/attempt=<a>/host=<h>` directory for which `skip_host_dir(rel,
    mtime_ns)` says so (given its path relative to the spool and its modification time), and
    every name that `known` holds for its directory (directory path relative to the spool ->
    names in it ingested already: the live service lists its spool every round, and a stat
    and a parse of each old file was half its ingesting thread's time at 128 hosts). A known
    name costs a set lookup, not a stat: a listing 0.8 us a name, os.listdir's own 0.5 of it
    (512,000 files, bench/listing_rate.py).
    """
    spool = Path(spool)
    if not spool.is_dir():
        return
    yield from _walk(spool, spool, (), skip_host_dir, known or {})


# A listing made round after round skips the host directories that settled (`Settling`).
SETTLE_S = 2.0  # longer than the coarsest file-system timestamp tick
FULL_LISTING_S = 60.0  # every directory listed at least this often, settled or not


class Settling:
    """Which host directories a listing made round after round may skip: a directory is
    settled once nothing in it is still to do and it was stat-ed with the same mtime at least
    SETTLE_S before a listing of it, and stays so until its mtime moves (publishing a file by
    rename moves it). One listing is not enough: a file renamed in just after it, within the
    same timestamp tick (a few ms on Linux's ext4 and xfs, up to 2 s on some file systems),
    leaves the mtime as it was; a listing after the tick has ended sees the file, and any
    rename after that moves the mtime. Every FULL_LISTING_S every directory is listed anyway,
    for file systems whose directory mtimes do not move (some FUSE mounts of object stores) or
    come back (copies that keep mtimes)."""

    def __init__(self) -> None:
        # Host directory -> (mtime_ns, settled, monotonic time of the stat that first saw it).
        self._dirs: dict[str, tuple[int, bool, float]] = {}
        self._stats: dict[str, tuple[int, float]] = {}  # this listing: (mtime_ns, stat time)
        self._full_at = float("-inf")
        self.full = True

    def begin(self) -> None:
        """A listing begins: a full one at least every FULL_LISTING_S."""
        self._stats = {}
        self.full = time.monotonic() - self._full_at >= FULL_LISTING_S
        if self.full:
            self._full_at = time.monotonic()

    def skip(self, rel_dir: str, mtime_ns: int) -> bool:
        """`scan`'s skip_host_dir: whether this directory, with this mtime, is settled."""
        self._stats[rel_dir] = (mtime_ns, time.monotonic())  # before the directory is read
        state = self._dirs.get(rel_dir)
        return not self.full and state is not None and state[:2] == (mtime_ns, True)

    def end(self, busy: Container[str]) -> None:
        """The listing ended: each directory it stat-ed settles, or not; `busy`, those with
        something in them still to do (a file not ingested, an entry to look at again)."""
        for rel_dir, (mtime, at) in self._stats.items():
            old = self._dirs.get(rel_dir)
            if old is None or old[0] != mtime:
                self._dirs[rel_dir] = (mtime, False, at)
            elif not old[1] or rel_dir in busy:
                self._dirs[rel_dir] = (mtime, rel_dir not in busy and at - old[2] >= SETTLE_S,
                                       old[2])

    def forget(self, rel_dir: str) -> None:
        """This directory listed again by the next listing, settled or not."""
        self._dirs.pop(rel_dir, None)


class Listing:
    """A spool listed round after round (the live reconcile lists its run's every round):
    each directory's names are read every time, so a removed file goes, but a published file
    listed before is not stat-ed nor parsed again (a published file never changes; another put
    at its path is ingest's to find, and `forget` looks at one anew): ~2 against ~15-20 us a
    file (13,312 files, bench/RESULTS.md).
    Stray entries are looked at every time. A host directory that settled (`Settling`: its
    mtime unmoved) is not even listed: its files are those of the last listing; nor is one
    whose names are those of the last listing looked at name by name. What it keeps of a file
    is its entry and size. `update` gives what changed, `entries` the files listed."""

    def __init__(self, spool: Path) -> None:
        self.spool = Path(spool)
        self._files: dict[str, dict[str, tuple[SpoolFile, int]]] = {}
        self._settling = Settling()

    def update(self) -> tuple[list[tuple[SpoolFile | Stray, int]], list[str]]:
        """The spool listed as `scan` lists it, giving only what changed since the last
        listing: (the files new to it and every stray, in listing order, with their sizes;
        the paths of the files gone). A round's work goes by what changed, not by the files
        listed (the seed run's ~3.6M): a directory whose names are those of the last listing
        is one set comparison."""
        listed: dict[str, dict[str, tuple[SpoolFile, int]]] = {}
        found: list[tuple[SpoolFile | Stray, int]] = []
        if self.spool.is_dir():
            busy = set()
            self._settling.begin()
            for item, st in _walk(self.spool, self.spool, (), self._settling.skip, {},
                                  (self._files, listed)):
                if isinstance(item, Stray):
                    busy.add(item.rel.rpartition("/")[0])
                found.append((item, st if isinstance(st, int) else st.st_size))
            self._settling.end(busy)
        gone = [f"{folder}/{name}" for folder, names in self._files.items()
                if listed.get(folder) is not names
                for name in names.keys() - listed.get(folder, {}).keys()]
        self._files = listed
        return found, gone

    def entries(self) -> Iterator[tuple[SpoolFile, int]]:
        """The published files of the last listing, in listing order, with their sizes."""
        for files in self._files.values():
            yield from files.values()

    def forget(self, rels: Iterable[str]) -> None:
        """These files looked at anew by the next `update` (another file was found in
        place)."""
        for rel in rels:
            folder, _, name = rel.rpartition("/")
            self._files.get(folder, {}).pop(name, None)
            self._settling.forget(folder)


def _walk(spool: Path, here: Path, parts: tuple[str, ...],
          skip: Callable[[str, int], bool] | None, known: Mapping[str, Container[str]],
          cache: tuple[dict, dict] | None = None,
          ) -> Iterator[tuple[SpoolFile | Stray, os.stat_result]]:
    """`cache`: (the published files of the last walk, this walk's), by directory and name,
    with their sizes (`Listing`: a file the last walk found is not given again, a new one is
    given with its size, not its stat; a host directory whose names are those of the last
    walk keeps its entries as they were)."""
    try:
        names = os.listdir(here)
    except OSError as exc:
        rel = here.relative_to(spool).as_posix()
        st = _lstat(here)
        if st is not None:
            yield Stray(here, rel, f"directory cannot be listed: {exc.strerror}"), st
        return
    prefix = "".join(f"{p}/" for p in parts)
    old = known.get(prefix[:-1], ())
    names = [n for n in names if n[:1] != "." and n not in old]
    where = _location(parts) if len(parts) == 3 else None
    before, now = ({}, None) if cache is None else (cache[0].get(prefix[:-1], {}), {})
    if now is not None and where is not None:
        if before and len(before) == len(names) and before.keys() == set(names):
            cache[1][prefix[:-1]] = before  # the same published files (in listing order)
            return
        cache[1][prefix[:-1]] = now
    names.sort()
    names.sort(key=len)  # in step order: a longer number is a larger one
    for name in names:
        hit = before.get(name)
        if hit is not None:
            now[name] = hit
            continue
        rel = prefix + name
        path = here / name
        try:
            lst = os.lstat(path)
        except OSError:
            continue  # gone since the listing
        if stat.S_ISDIR(lst.st_mode):
            if len(parts) == 2 and skip is not None and skip(rel, lst.st_mtime_ns):
                if cache is None:
                    continue
                kept = cache[0].get(rel)
                if kept is not None:  # settled: its files are those the last walk found
                    cache[1][rel] = kept
                    continue
            yield from _walk(spool, path, (*parts, name), skip, known, cache)
            continue
        item, st = _file(path, rel, where, name, lst, here)
        if now is not None and isinstance(item, SpoolFile):
            now[name] = (item, st.st_size)
        yield item, st


def entry(spool: Path, rel: str) -> tuple[SpoolFile | Stray, os.stat_result] | None:
    """One listed entry by its path relative to the spool, as `scan` gives it (None: gone, or
    a directory)."""
    path = Path(spool) / rel
    try:
        lst = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISDIR(lst.st_mode):
        return None
    *parts, name = rel.split("/")
    return _file(path, rel, _location(tuple(parts)) if len(parts) == 3 else None, name, lst,
                 path.parent)


def _file(path: Path, rel: str, where: tuple[str, int, int] | None, name: str,
          lst: os.stat_result, folder: Path) -> tuple[SpoolFile | Stray, os.stat_result]:
    """A listed entry that is not a directory, given its lstat: a spool file with its stat, or
    a stray (`_classify`, `_regular`). `folder`: `path`'s directory (the same object for all
    its files)."""
    item = _classify(path, rel, where, name, folder)
    st, why = _regular(path, lst)
    return (Stray(path, rel, why), st) if why is not None else (item, st)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return path.lstat()
    except OSError:
        return None


def _regular(path: Path, lst: os.stat_result) -> tuple[os.stat_result, str | None]:
    """(stat, None) for a regular file or a link to one; else (lstat, why it is not one)."""
    if stat.S_ISLNK(lst.st_mode):
        try:
            st = path.stat()
        except OSError as exc:
            why = ("a symlink loop" if exc.errno == errno.ELOOP else
                   "a dangling symlink" if exc.errno == errno.ENOENT else
                   f"a symlink that cannot be followed ({exc.strerror})")
            return lst, f"not a regular file: {why}"
        lst_target = st
    else:
        lst_target = lst
    if not stat.S_ISREG(lst_target.st_mode):
        return lst, f"not a regular file: {_kind_of(lst_target.st_mode)}"
    return lst_target, None


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a file"


def _location(parts: tuple[str, ...]) -> tuple[str, int, int] | None:
    """(run id, attempt, host) of a `<run>/attempt=<a>/host=<h>` directory; None if its names
    are not those. Once a directory, not once a file."""
    run_id, attempt_dir, host_part = parts
    am, hm = ATTEMPT_DIR.match(attempt_dir), _HOST_DIR.match(host_part)
    if not (_RUN_ID.match(run_id) and am and hm):
        return None
    return sys.intern(run_id), int(am.group(1)), int(hm.group(1))


def _classify(path: Path, rel: str, where: tuple[str, int, int] | None,
              name: str, folder: Path) -> SpoolFile | Stray:
    """`where`: the directory's `_location`, None where the file is not three deep or the
    directory names are not a host directory's."""
    m = _FILE.match(name)
    if not m or rel.count("/") != 3:
        return Stray(path, rel, "not a spool file name or location "
                     "(<run>/attempt=<a>/host=<h>/seg-<step>-<seq>.parquet)")
    if where is None:
        return Stray(path, rel, "directory names are not <run>/attempt=<a>/host=<h>")
    run_id, attempt, host = where
    return SpoolFile(folder=folder, rel=rel, run_id=run_id, attempt=attempt, host=host,
                     kind=sys.intern(m.group(1)), first_step=int(m.group(2)),
                     seq=int(m.group(3)))


def published(name: str) -> bool:
    """Whether a file name is that of a published spool file."""
    return _FILE.match(name) is not None


def next_seq(directory: Path) -> int:
    """The sequence number after every published file in `directory`."""
    seqs = [int(m.group(3)) for n in os.listdir(directory) if (m := _FILE.match(n))]
    return max(seqs, default=-1) + 1


# ---- checking a published file (ingest and reconcile) ---------------------------------

class BadFile(Exception):
    """A spool file that cannot be ingested; the message says why."""


def _meta(md: dict[bytes, bytes] | None) -> dict[str, str]:
    md = md or {}
    out = {}
    for k in META_KEYS + OPTIONAL_META_KEYS:
        raw = md.get((META_PREFIX + k).encode())
        if raw is None and k in META_KEYS:
            raise BadFile(f"metadata key {META_PREFIX + k} is missing (not written by Tally?)")
        out[k] = "" if raw is None else raw.decode()
    return out


def _int(meta: dict[str, str], key: str) -> int:
    try:
        return int(meta[key])
    except ValueError:
        raise BadFile(f"metadata {key}={meta[key]!r} is not an integer") from None


def read_checked(f: SpoolFile) -> tuple[pa.Table, dict]:
    """The file's table and parsed metadata, or BadFile saying what is wrong.

    The file is opened without blocking and must be a regular file when opened (a FIFO put
    there since the listing would otherwise hang the reader); its footer is checked against the
    contract and its bounds (tally.audit.core.schema) before any data page is decoded."""
    with _open_regular(f.path) as fh:
        # A file of the usual size read whole before pyarrow parses it: its reads through a
        # Python file object were ~170 of ~480 us of a 4 KB file's (a backfill of the seed's
        # small files pays that by the file); a larger one is read from the file, as pyarrow
        # asks, so that its footer is checked before more is read.
        size = os.fstat(fh.fileno()).st_size
        source = pa.BufferReader(fh.read(size)) if size <= WHOLE_READ_BYTES else fh
        try:
            pf = pq.ParquetFile(source)
        except Exception as exc:
            raise BadFile(f"unreadable Parquet footer (truncated or not Parquet): {exc}") from None
        expected = SCHEMAS[f.kind]
        schema = pf.schema_arrow  # made anew at each ask (~18 us)
        found = schema.remove_metadata()
        if not any(found.equals(e) for e in expected):
            raise BadFile(f"schema mismatch: expected {_fmt(expected[-1])}, found "
                          f"{_fmt(found)}")
        meta = _meta(schema.metadata)
        footer = _footer_hash(fh)
        if meta["format_version"] != FORMAT_VERSION:
            raise BadFile(f"spool format version {meta['format_version']}, expected "
                          f"{FORMAT_VERSION}")
        info = _info(meta, f)
        if pf.metadata.num_rows != info["rows"]:
            raise BadFile(f"footer holds {pf.metadata.num_rows} rows, writer wrote "
                          f"{info['rows']}")
        decoded = sum(pf.metadata.row_group(g).total_byte_size
                      for g in range(pf.metadata.num_row_groups))
        if decoded > MAX_DECODED_BYTES:
            raise BadFile(f"columns of {decoded:,} bytes uncompressed, more than the "
                          f"{MAX_DECODED_BYTES:,} a spool file may hold")
        try:
            table = pf.read(use_threads=False)  # small files: threads cost more than they give
        except Exception as exc:
            raise BadFile(f"corrupt data pages: {exc}") from None
    if table.num_rows != info["rows"] or table.num_rows == 0:
        raise BadFile(f"read {table.num_rows} rows, writer wrote {info['rows']}")
    _check_values(table, f.kind, info)
    info["footer_hash"] = footer
    if f.kind == "seg" and SEGMENT_LOSS.name not in table.column_names:
        # Every reader sees the same columns: a file without losses holds null ones.
        table = table.append_column(SEGMENT_LOSS.name,
                                    pa.nulls(table.num_rows, SEGMENT_LOSS.arrow))
    return table, info


WHOLE_READ_BYTES = 1 << 22  # a spool file up to this size is read whole (`read_checked`)


def _footer_hash(fh: Any) -> int:
    """xxh3_64 of the file's Parquet footer (its metadata, the writer's spool id among them,
    and every column chunk's statistics and sizes): what tells a file from another at one path
    (tally.audit.ledger.ingest). 0.015 ms for a 500k-row file, against 0.6-1.7 ms to hash the
    whole file (7.3 MB, from the page cache) and 0.56-0.70 s to ingest it."""
    fh.seek(-8, os.SEEK_END)
    size = int.from_bytes(fh.read(4), "little")
    fh.seek(-8 - size, os.SEEK_END)
    return xxhash.xxh3_64_intdigest(fh.read(size))


@contextlib.contextmanager
def _open_regular(path: Path) -> Iterator[Any]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise BadFile(f"cannot open: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadFile(f"not a regular file: {_kind_of(st.st_mode)}")
        os.set_blocking(fd, True)
        fh = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with fh:
        yield fh


def _info(meta: dict[str, str], f: SpoolFile) -> dict[str, Any]:
    """The parsed metadata, checked against the path and the contract's bounds."""
    info = {
        "run_id": meta["run_id"],
        "attempt": _int(meta, "attempt"),
        "host": _int(meta, "host"),
        "host_count": _int(meta, "host_count"),
        "resumed_from_step": _int(meta, "resumed_from_step") if meta["resumed_from_step"] else None,
        "writer_version": meta["writer_version"],
        "fingerprint": meta["manifest_fingerprint"],
        "rows": _int(meta, "rows"),
        "first_step": _int(meta, "first_step"),
        "last_step": _int(meta, "last_step"),
        "records_per_epoch": (_int(meta, "records_per_epoch") if meta["records_per_epoch"]
                              else None),
        "checkpoint_dir": meta["checkpoint_dir"] or None,
        "replayed": is_replayed(meta),
        "spool_id": meta["spool_id"] or None,
        "content_basis": meta["content_basis"] or None,
    }
    for key, from_path in (("run_id", f.run_id), ("attempt", f.attempt), ("host", f.host)):
        if info[key] != from_path:
            raise BadFile(f"metadata {key}={info[key]!r} but the path says {from_path!r}")
    if meta["kind"] != f.kind or info["first_step"] != f.first_step:
        raise BadFile("metadata kind/first_step disagree with the file name")
    check_topology(info["host"], info["host_count"], BadFile)
    if (info["attempt"] > 0) != (info["resumed_from_step"] is not None):
        raise BadFile("attempt > 0 must say resumed_from_step, attempt 0 must not")
    if not 0 <= (info["resumed_from_step"] or 0) < MAX_STEP:
        raise BadFile(f"metadata resumed_from_step={info['resumed_from_step']} is outside "
                      f"0..{MAX_STEP - 1}")
    n = info["records_per_epoch"]
    if n is not None and not 1 <= n <= MAX_RECORD_KEY:
        raise BadFile(f"metadata records_per_epoch={n} is outside 1..{MAX_RECORD_KEY:,}")
    if not 1 <= info["rows"] <= MAX_FILE_ROWS:
        raise BadFile(f"metadata rows={info['rows']} is outside 1..{MAX_FILE_ROWS:,} (the "
                      "most one spool file may hold)")
    return info


def check_topology(host: int, host_count: int, error: type[Exception] = ValueError) -> None:
    """`host` and `host_count` within the contract's bounds (raises `error` otherwise)."""
    if not 1 <= host_count <= MAX_HOSTS:
        raise error(f"host_count {host_count} is outside 1..{MAX_HOSTS:,}")
    if not 0 <= host < host_count:
        raise error(f"host {host} is outside 0..{host_count - 1} (host_count {host_count})")


def first_repeat(a_steps: np.ndarray, a_rows: np.ndarray, b_steps: np.ndarray,
                 b_rows: np.ndarray) -> tuple[int, int] | None:
    """The first (step, row) found in both of two files of one host and attempt, or None.

    The rule every reader applies (ingest and reconcile): a host's batch row at a step is
    consumed once, so a file repeating a (step, row) of another file is a copy, or the work
    of a writer restarted within its attempt, and counts nothing. A step split across files
    (a timer flush between the micro-batches of a step) repeats no row: the writer numbers a
    step's rows on across its parts.
    """
    lo = max(int(a_steps.min()), int(b_steps.min()))
    hi = min(int(a_steps.max()), int(b_steps.max()))
    if lo > hi:
        return None
    a_in, b_in = (a_steps >= lo) & (a_steps <= hi), (b_steps >= lo) & (b_steps <= hi)
    width = int(max(a_rows.max(initial=0), b_rows.max(initial=0))) + 1
    if (hi - lo + 1) * width >= 2**62:  # too wide to pack: compare as pairs
        both = set(zip(a_steps[a_in].tolist(), a_rows[a_in].tolist(), strict=True)) & set(
            zip(b_steps[b_in].tolist(), b_rows[b_in].tolist(), strict=True))
        return min(both) if both else None
    def code(s: np.ndarray, r: np.ndarray) -> np.ndarray:
        return (s.astype(np.int64) - lo) * width + r.astype(np.int64)

    both = np.intersect1d(code(a_steps[a_in], a_rows[a_in]), code(b_steps[b_in], b_rows[b_in]))
    if not len(both):
        return None
    first = int(both[0])
    return lo + first // width, first % width


def _fmt(schema: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name} {f.type}" for f in schema) + ")"


def _bounds(column: pa.ChunkedArray) -> tuple[int, int]:
    """The smallest and largest value of an integer column without nulls and not empty, by
    numpy chunk by chunk (no copy): a pyarrow compute call costs ~20 us whatever the rows, and
    seven of them were most of a small file's checks (0.16 of ~1.2 ms a 10-row file's read)."""
    parts = [c.to_numpy() for c in column.chunks if len(c)]
    return min(int(a.min()) for a in parts), max(int(a.max()) for a in parts)


def _check_values(table: pa.Table, kind: str, info: dict) -> None:
    for name in table.column_names:
        if table[name].null_count and name != SEGMENT_LOSS.name:
            raise BadFile(f"column {name} has nulls")
    low, high = _bounds(table["step"])
    if (low, high) != (info["first_step"], info["last_step"]):
        raise BadFile(f"steps {low}..{high} disagree with metadata "
                      f"{info['first_step']}..{info['last_step']}")
    if not 0 <= low <= high < MAX_STEP:
        raise BadFile(f"steps {low}..{high} are outside 0..{MAX_STEP - 1}")
    if _bounds(table["host"]) != (info["host"], info["host"]):
        raise BadFile(f"rows for a host other than {info['host']}")
    if kind == "met":
        longest = pc.max(pc.utf8_length(table["name"])).as_py()
        if longest > MAX_METRIC_NAME:
            raise BadFile(f"a metric name of {longest} characters (at most {MAX_METRIC_NAME})")
        return
    bounds = {name: _bounds(table[name]) for name in MINIMUM}
    for name, least in MINIMUM.items():
        if bounds[name][0] < least:
            raise BadFile(f"column {name} has values below {least}")
    n = info["records_per_epoch"]
    top = bounds["record_key"][1]
    if n is not None and top >= n:
        raise BadFile(f"record_key {top:,} is outside the run's universe: the writer said "
                      f"records_per_epoch={n:,}, so keys lie in 0..{n - 1:,}")
    if top >= MAX_RECORD_KEY:
        raise BadFile(f"record_key {top:,} is beyond {MAX_RECORD_KEY - 1:,}, the largest key "
                      "Tally accepts")
    low, high = _bounds(table["epoch"])
    if not -1 <= low <= high < MAX_EPOCH:
        raise BadFile(f"epochs {low}..{high} are outside -1..{MAX_EPOCH - 1}")
