"""Consumption rows cut into record-key buckets and exchanged through files.

Each input file's effective rows are ordered by bucket (one radix sort) and written once, as one
file of narrow columns; the pipeline then shuffles only references, `(bucket, Slice)`, and each
bucket's worker reads its slices of every file straight into its column arrays. Moving the rows
themselves through the runner's shuffle cost more than all the computing: FnApiRunner pickles,
copies and re-encodes each element several times and holds them all in the runner process.

Layout (private to one job, removed with its work folder): per bucket, in bucket order, that
bucket's rows of each column in COLUMNS order, native byte order. A bucket's slice is then one
contiguous byte range, read with one `preadv` into the destination arrays: one copy from the
page cache, no parsing. The files live under the job's work folder, which every worker must
reach (as the per-record parts already do).

Rows are narrowed to what a bucket computes with, 27 bytes instead of the spool's 52: the key as
its offset from the bucket's first key (whole keys only in the overflow bucket, where keys lie
beyond the manifest), the step as its offset from the file's first step, a record's start as a
flag instead of the segment's offset, and the loss only when the file holds one (31 bytes then).
Writing these files is the read stage's largest cost (fresh page-cache pages), and at 500M rows
they outgrow the page cache beside the spool, so bytes count.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tally.audit.core.exposure import starts
from tally.audit.core.schema import SEGMENT_DTYPES

# What a bucket needs of each row: the key narrowed to its offset in the bucket (uint32; int64
# in the overflow bucket), the step to its offset from the file's first step (uint32: a run spans
# fewer than 2^31 steps, tally.audit.buckets.plan.MAX_RUN_STEPS), the host to uint16
# (tally.audit.core.schema.MAX_HOSTS), the offset to a start flag
# (tally.audit.core.exposure.starts); the
# other columns as the segment schema has them. `read` gives the step back as int64.
COLUMNS = {"key": np.uint32, "step": np.uint32, "host": np.uint16, "start": np.bool_,
           **{k: SEGMENT_DTYPES[k].type for k in ("n_tokens", "content_hash", "epoch",
                                                  "loss")}}
WHOLE_KEY = np.int64
STEP_SPAN = 2**32


def _types(overflow: bool, loss: bool = True) -> dict[str, type]:
    types = {**COLUMNS, "key": WHOLE_KEY} if overflow else dict(COLUMNS)
    if not loss:
        del types["loss"]
    return types


def row_bytes(overflow: bool, loss: bool = True) -> int:
    return sum(np.dtype(t).itemsize for t in _types(overflow, loss).values())


_IOV_MAX = 1024


class Slice(NamedTuple):
    """`rows` rows of one bucket, starting `offset` bytes into a bucket file whose steps are
    offsets from `step_base` and which holds a loss column when `loss`."""

    path: str
    offset: int
    rows: int
    step_base: int = 0
    loss: bool = True


def write(cols: dict[str, np.ndarray], bucket_size: int, buckets: int,
          path: Path) -> list[tuple[int, Slice]]:
    """Write `cols` (spool columns) cut by bucket to `path`; return each non-empty bucket's
    slice. Keys beyond the last bucket go to the overflow bucket `buckets`."""
    key = cols["record_key"]
    bucket = np.minimum(key // bucket_size, buckets)
    # Small integer types sort by radix: linear, and a tenth of the cost of a general argsort.
    small = np.uint8 if buckets < 2**8 else np.uint16 if buckets < 2**16 else np.uint32
    order = np.argsort(bucket.astype(small), kind="stable")
    counts = np.bincount(bucket, minlength=buckets + 1)
    key, bucket = key[order], bucket[order]
    step = np.asarray(cols["step"])
    base = int(step.min()) if step.size else 0
    if step.size and int(step.max()) - base >= STEP_SPAN:
        raise ValueError(f"steps {base}..{int(step.max())} span more than {STEP_SPAN:,}")
    loss = np.asarray(cols["loss"])
    # No loss logged (all NaN): the column stays out of the file, 4 of 31 bytes a row.
    with_loss = bool(np.isfinite(loss).any())
    ordered = {"key": key - bucket * bucket_size, "start": starts(cols["offset"][order]),
               "step": (step[order] - base).astype(np.uint32)}
    for k in ("host", "n_tokens", "content_hash", "epoch", *(("loss",) if with_loss else ())):
        ordered[k] = np.asarray(cols[k])[order].astype(COLUMNS[k], copy=False)
    ends = np.cumsum(counts)
    refs, chunks, offset = [], [], 0
    for b in np.flatnonzero(counts):
        lo, hi = int(ends[b] - counts[b]), int(ends[b])
        refs.append((int(b), Slice(str(path), offset, hi - lo, base, with_loss)))
        overflow = b == buckets
        for k, t in _types(overflow, with_loss).items():
            col = (key if overflow and k == "key" else ordered[k])[lo:hi]
            chunks.append(memoryview(np.ascontiguousarray(col, dtype=t)).cast("B"))
        offset += (hi - lo) * row_bytes(overflow, with_loss)
    # Per process: a worker the scheduler gave up on may still be writing when another worker
    # redoes the task, and two writers of one temporary file could leave holes in it.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(0, len(chunks), _IOV_MAX):
            part = chunks[i:i + _IOV_MAX]
            want = sum(c.nbytes for c in part)
            if os.writev(fd, part) != want:  # regular files take all of it, or raise
                raise OSError(f"short write to {tmp}")
    finally:
        os.close(fd)
    tmp.replace(path)  # a retried bundle rewrites the same file whole
    return refs


def read(slices: list[Slice], overflow: bool = False) -> dict[str, np.ndarray]:
    """The rows of one bucket's `slices`, concatenated, read straight into the column arrays
    (`overflow`: the overflow bucket's, with whole keys); steps as int64, and a loss column
    only when a slice has one (NaN for the rows of those without)."""
    slices = sorted(slices)  # the same order on every runner
    total = sum(s.rows for s in slices)
    with_loss = any(s.loss for s in slices)
    out = {k: np.empty(total, t) for k, t in _types(overflow, with_loss).items()}
    step = np.empty(total, np.int64)
    pos = 0
    for s in slices:
        names = _types(overflow, s.loss)
        views = [memoryview(out[k][pos:pos + s.rows]).cast("B") for k in names]
        fd = os.open(s.path, os.O_RDONLY)
        try:
            got = os.preadv(fd, views, s.offset)
        finally:
            os.close(fd)
        if got != s.rows * row_bytes(overflow, s.loss):
            raise OSError(f"bucket file {s.path} is short: {got} of "
                          f"{s.rows * row_bytes(overflow, s.loss)} bytes at {s.offset}")
        np.add(out["step"][pos:pos + s.rows], s.step_base, out=step[pos:pos + s.rows],
               dtype=np.int64, casting="unsafe")
        if with_loss and not s.loss:
            out["loss"][pos:pos + s.rows] = np.nan
        pos += s.rows
    out["step"] = step
    return out
