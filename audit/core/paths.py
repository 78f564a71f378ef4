"""Paths a command is given to write under, checked before its work starts."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
