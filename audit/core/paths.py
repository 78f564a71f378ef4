"""Paths a command is given to write under, checked before its work starts, and the one way
Tally publishes a file (spool files, state snapshots, lookup-index runs)."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


def unwritable_dir(path: str | os.PathLike, *, probe: bool = True) -> str | None:
    """Why `path` cannot be, or be made, a directory this process writes in; None when it can.

    Checked before the work starts (a report's `-o`, a training's spool or checkpoints), so
    that a path under a file (`/etc/passwd/x`), an existing file, or a place where nothing can
    be created (`/proc/x`, a read-only mount) is one line, rather than a traceback from deep
    inside once the work has begun, or from every training host. With `probe`, the nearest
    directory that exists is tried with a directory made and removed at once: permissions
    alone do not tell (root may write anywhere, yet nothing can be created under /proc).
    Without it (parsing a command line, which may be checked on another machine than the one
    it runs on) only what the path names is checked."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        return f"{p} exists and is not a directory"
    near = p
    while not near.exists() and near != near.parent:
        near = near.parent
    if not near.is_dir():
        return f"{near} is not a directory"
    if not probe:
        return None
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tally-probe-", dir=near))
    except OSError as exc:
        return f"cannot create anything in {near}: {exc.strerror or exc}"
    return None


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(final: Path, tmp: Path, *, fsync: bool = True, overwrite: bool = True,
                 on: Callable[[str], None] | None = None, page_cache: bool = True
                 ) -> Iterator[BinaryIO]:
    """Publish `final` whole or not at all: the body writes the open file `tmp`; then fsync,
    rename to `final`, fsync of the directory. A reader (or a kill) sees the old file or the new
    one, never a part; a failed body leaves no `tmp`. `overwrite=False` refuses an existing
    `final` (FileExistsError: a spool file is never replaced; `_publish_new`). `on(step)` is
    told "synced" and "renamed" as they happen (the crash tests pause there to kill the process).
    `page_cache=False`: the body's writes go past the page cache where the file system allows
    it (`Uncached`), for a large file read back only rarely (a state snapshot)."""
    try:
        with (open(tmp, "wb") if page_cache else Uncached(tmp)) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if on is not None:
            on("synced")
        if overwrite:
            os.rename(tmp, final)
        else:
            _publish_new(tmp, final)
        if on is not None:
            on("renamed")
        if fsync:
            fsync_dir(final.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# Where a file system has no hard links (some FUSE and object-store mounts), a new file is
# published by rename after a check; the check and the rename are then two steps.
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV}
TWO_WRITERS = ("two writers for one host? (a host index belongs to one process: a rank within "
               "a node is not one, and of tensor- or pipeline-parallel ranks one process of "
               "each data-parallel replica writes)")


def _publish_new(tmp: Path, final: Path) -> None:
    """Give `tmp` the name `final` unless `final` exists, in one step: a hard link fails where
    the name is taken, where a rename would replace it. Two writers publishing the same name at
    once (two processes that both believe they are host 0, or a run relaunched while it still
    runs) once both passed an exists() check and the later rename replaced the earlier file:
    its rows were lost without a word."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise FileExistsError(f"{final} already exists; {TWO_WRITERS}") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"{tmp.name} was removed while it was written (a writer for "
                                f"the same host started meanwhile); {TWO_WRITERS}"
                                ) from None
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        if final.exists():
            raise FileExistsError(f"{final} already exists; {TWO_WRITERS}") from None
        os.rename(tmp, final)
        return
    os.unlink(tmp)


DIRECT_BLOCK = 4096  # O_DIRECT's unit: file offsets, lengths and buffer addresses (a logical
# block is 512 or 4096 bytes; 4096 suits both)
DIRECT_BUFFER = 8 << 20
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}  # direct I/O not for this file


class Uncached:
    """A new file written past the page cache (O_DIRECT), write-only, sequential: what is
    written is copied into a page-aligned buffer of DIRECT_BUFFER bytes and written from there
    in whole blocks; `flush` writes the last block padded and cuts the file to its length.

    Why: a file written through the page cache takes a cache page for every 4 KiB, which here
    cost more than the write itself: 800 MB of snapshot (100M records) took 5.5 s, 4.9 s of it
    system time, against 0.8 s past the cache (this 2-core VM, bench/RESULTS.md), and the
    pages it takes evict those the service reads (the ledger's, the lookup index's). Where the
    file system refuses O_DIRECT (older tmpfs and overlayfs, some network file systems: EINVAL
    or EOPNOTSUPP at the open or at the first write), the same writes go through the cache."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = 0  # bytes written so far (the file's length once flushed)
        self.fill = 0  # bytes waiting in the buffer
        self.drained = False  # whether any reached the file
        self.done = False  # the last, padded block written: no more writes
        self.buf: mmap.mmap | None = None
        direct = getattr(os, "O_DIRECT", 0)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self.fd = os.open(path, flags | direct, 0o666) if direct else -1
        except OSError:  # refused with the flag (EINVAL, EOPNOTSUPP): a real fault (a
            self.fd = -1  # missing directory, no permission) is raised by the open below
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o666)
        else:
            self.buf = mmap.mmap(-1, DIRECT_BUFFER)  # anonymous: page-aligned

    def __enter__(self) -> Uncached:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def fileno(self) -> int:
        return self.fd

    def write(self, data) -> int:
        if self.done:
            raise ValueError(f"{self.path}: written after its last block")
        view = memoryview(data).cast("B")
        n = len(view)
        while len(view) and self.buf is not None:
            take = min(len(view), DIRECT_BUFFER - self.fill)
            self.buf[self.fill: self.fill + take] = view[:take]
            self.fill += take
            view = view[take:]
            if self.fill == DIRECT_BUFFER:
                self._drain(DIRECT_BUFFER)
        if len(view):  # through the cache: direct I/O refused
            _write_all(self.fd, view)
        self.size += n
        return n

    def flush(self) -> None:
        """Write what the buffer holds, the last block padded, and cut the file to size."""
        if self.buf is None or not self.fill:
            return
        padded = min(-(-self.fill // DIRECT_BLOCK) * DIRECT_BLOCK, len(self.buf))
        self.buf[self.fill: padded] = bytes(padded - self.fill)
        self._drain(padded)
        if self.buf is not None:
            os.ftruncate(self.fd, self.size)
            self.done = True

    def close(self) -> None:
        if self.buf is not None:
            self.buf.close()
            self.buf = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _drain(self, n: int) -> None:
        """Write the buffer's first `n` bytes (whole blocks) at the file's end."""
        assert self.buf is not None
        try:
            _write_all(self.fd, memoryview(self.buf)[:n])
            refused = False
        except OSError as exc:
            if exc.errno not in _REFUSED or self.drained:
                raise
            refused = True  # the file system takes the flag but not the I/O
        if refused:  # (out of the handler: its traceback held views of the buffer)
            # Nothing is in the file yet: open it again through the cache.
            os.close(self.fd)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            _write_all(self.fd, memoryview(self.buf[:self.fill]))
            self.buf.close()
            self.buf = None
        self.fill = 0
        self.drained = True


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view):]
