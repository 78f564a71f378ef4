"""Paths a command is given to write under, checked before its work starts, and the one way
Tally publishes a file (spool files, state snapshots, lookup-index runs)."""

from __future__ import annotations

import contextlib
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
                 on: Callable[[str], None] | None = None) -> Iterator[BinaryIO]:
    """Publish `final` whole or not at all: the body writes the open file `tmp`; then fsync,
    rename to `final`, fsync of the directory. A reader (or a kill) sees the old file or the new
    one, never a part; a failed body leaves no `tmp`. `overwrite=False` refuses an existing
    `final` (FileExistsError: a spool file is never replaced). `on(step)` is told "synced" and
    "renamed" as they happen (the crash tests pause there to kill the process)."""
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if on is not None:
            on("synced")
        if not overwrite and final.exists():
            raise FileExistsError(f"{final} already exists; two writers for one host?")
        os.rename(tmp, final)
        if on is not None:
            on("renamed")
        if fsync:
            fsync_dir(final.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
