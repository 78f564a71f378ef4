"""The spool: append-only Parquet files that hosts publish and one ingester reads.

`<spool>/<run_id>/attempt=<a>/host=<h>/seg-<first_step:012d>-<seq:06d>.parquet` holds consumed
segments; `met-...` files beside them hold metrics (train loss, eval loss). Files appear only
by rename from a dot-prefixed temporary name, so a listing never sees a partial file.
This module is the one definition of names, layout and metadata keys; the columns come from
audit.core.schema.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from audit.core.schema import METRIC_SCHEMA, SEGMENT_SCHEMA
from audit.hook.segments import MINIMUM

FORMAT_VERSION = "1"
WRITER_VERSION = "tally-writer/1"

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

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_RUN_ID = re.compile(RUN_ID_PATTERN)
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


def scan(spool: Path, skip_host_dir: Callable[[str, int], bool] | None = None,
         ) -> Iterator[SpoolFile | Stray]:
    """Every published file and every stray file under `spool`, in a stable order.

    Hidden files (temporaries of writers still running, or of killed ones) are skipped, and so
    is every `<run>/attempt=<a>/host=<h>` directory for which `skip_host_dir(rel, mtime_ns)`
    says so (given its path relative to the spool and its modification time).
    """
    spool = Path(spool)
    if not spool.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(spool):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        here = Path(dirpath)
        parts = here.relative_to(spool).parts
        if skip_host_dir is not None and len(parts) == 2:
            dirnames[:] = [d for d in dirnames if not _skipped(here / d, spool, skip_host_dir)]
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


def _skipped(path: Path, spool: Path, skip: Callable[[str, int], bool]) -> bool:
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        return True
    return skip(path.relative_to(spool).as_posix(), mtime)


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
    """The file's table and parsed metadata, or BadFile saying what is wrong."""
    try:
        pf = pq.ParquetFile(f.path)
    except Exception as exc:
        raise BadFile(f"unreadable Parquet footer (truncated or not Parquet): {exc}") from None
    expected = SCHEMAS[f.kind]
    found = pf.schema_arrow.remove_metadata()
    if not found.equals(expected):
        raise BadFile(f"schema mismatch: expected {_fmt(expected)}, found {_fmt(found)}")
    meta = _meta(pf.schema_arrow.metadata)
    if meta["format_version"] != FORMAT_VERSION:
        raise BadFile(f"spool format version {meta['format_version']}, expected "
                      f"{FORMAT_VERSION}")
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
    }
    for key, from_path in (("run_id", f.run_id), ("attempt", f.attempt), ("host", f.host)):
        if info[key] != from_path:
            raise BadFile(f"metadata {key}={info[key]!r} but the path says {from_path!r}")
    if meta["kind"] != f.kind or info["first_step"] != f.first_step:
        raise BadFile("metadata kind/first_step disagree with the file name")
    if not 0 <= info["host"] < info["host_count"]:
        raise BadFile(f"host {info['host']} is outside host_count {info['host_count']}")
    if (info["attempt"] > 0) != (info["resumed_from_step"] is not None):
        raise BadFile("attempt > 0 must say resumed_from_step, attempt 0 must not")
    if info["records_per_epoch"] is not None and info["records_per_epoch"] < 1:
        raise BadFile(f"metadata records_per_epoch={info['records_per_epoch']} is below 1")
    if pf.metadata.num_rows != info["rows"]:
        raise BadFile(f"footer holds {pf.metadata.num_rows} rows, writer wrote {info['rows']}")
    try:
        table = pf.read()
    except Exception as exc:
        raise BadFile(f"corrupt data pages: {exc}") from None
    if table.num_rows != info["rows"] or table.num_rows == 0:
        raise BadFile(f"read {table.num_rows} rows, writer wrote {info['rows']}")
    _check_values(table, f.kind, info)
    return table, info


def _fmt(schema: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name} {f.type}" for f in schema) + ")"


def _check_values(table: pa.Table, kind: str, info: dict) -> None:
    for name in table.column_names:
        if table[name].null_count:
            raise BadFile(f"column {name} has nulls")
    steps = pc.min_max(table["step"]).as_py()
    if (steps["min"], steps["max"]) != (info["first_step"], info["last_step"]):
        raise BadFile(f"steps {steps['min']}..{steps['max']} disagree with metadata "
                      f"{info['first_step']}..{info['last_step']}")
    if steps["min"] < 0:
        raise BadFile("negative step")
    if not pc.all(pc.equal(table["host"], info["host"])).as_py():
        raise BadFile(f"rows for a host other than {info['host']}")
    if kind == "seg":
        for name, low in MINIMUM.items():
            if pc.min(table[name]).as_py() < low:
                raise BadFile(f"column {name} has values below {low}")
