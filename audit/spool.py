"""The spool: append-only Parquet files that hosts publish and one ingester reads.

`<spool>/<run_id>/attempt=<a>/host=<h>/seg-<first_step:012d>-<seq:06d>.parquet` holds consumed
segments; `met-...` files beside them hold metrics (train loss, eval loss). Files appear only
by rename from a dot-prefixed temporary name, so a listing never sees a partial file.
This module is the one definition of names, schemas and metadata keys.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

FORMAT_VERSION = "1"
WRITER_VERSION = "tally-writer/1"

SEGMENT_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("host", pa.int32()),
        ("row", pa.int32()),
        ("record_key", pa.int64()),
        ("offset", pa.int32()),
        ("n_tokens", pa.int32()),
        ("content_hash", pa.uint64()),
        ("epoch", pa.int32()),
    ]
)
METRIC_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("host", pa.int32()),
        ("name", pa.string()),
        ("value", pa.float64()),
    ]
)
SCHEMAS = {"seg": SEGMENT_SCHEMA, "met": METRIC_SCHEMA}

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
)
META_PREFIX = "tally."

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FILE = re.compile(r"^(seg|met)-(\d{12})-(\d{6})\.parquet$")
_ATTEMPT_DIR = re.compile(r"^attempt=(\d+)$")
_HOST_DIR = re.compile(r"^host=(\d+)$")


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
    """Dot-prefixed so that no listing of published files can see it."""
    return f".{final_name}.tmp"


@dataclass(frozen=True)
class SpoolFile:
    """A published spool file, identified by its path relative to the spool root."""

    path: Path
    rel: str
    run_id: str
    attempt: int
    host: int
    kind: str
    first_step: int
    seq: int


@dataclass(frozen=True)
class Stray:
    """A file in the spool tree that is not a published spool file."""

    path: Path
    rel: str
    reason: str


def scan(spool: Path) -> Iterator[SpoolFile | Stray]:
    """Every published file and every stray file under `spool`, in a stable order.

    Hidden files (temporaries of writers still running, or of killed ones) are skipped.
    """
    spool = Path(spool)
    if not spool.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(spool):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        here = Path(dirpath)
        parts = here.relative_to(spool).parts
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            path = here / name
            rel = path.relative_to(spool).as_posix()
            m = _FILE.match(name)
            if not m or len(parts) != 3:
                yield Stray(path, rel, "not a spool file name or location "
                            "(<run>/attempt=<a>/host=<h>/seg-<step>-<seq>.parquet)")
                continue
            run_id, attempt_dir, host_part = parts
            am, hm = _ATTEMPT_DIR.match(attempt_dir), _HOST_DIR.match(host_part)
            if not (_RUN_ID.match(run_id) and am and hm):
                yield Stray(path, rel, "directory names are not <run>/attempt=<a>/host=<h>")
                continue
            yield SpoolFile(
                path=path,
                rel=rel,
                run_id=run_id,
                attempt=int(am.group(1)),
                host=int(hm.group(1)),
                kind=m.group(1),
                first_step=int(m.group(2)),
                seq=int(m.group(3)),
            )


def next_seq(directory: Path) -> int:
    """The sequence number after every published file in `directory`."""
    seqs = [int(m.group(3)) for n in os.listdir(directory) if (m := _FILE.match(n))]
    return max(seqs, default=-1) + 1
