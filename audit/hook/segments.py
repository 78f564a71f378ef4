"""Segments: the parts of records inside one batch, the unit the ledger counts.

A segment is `(row, record_key, offset, n_tokens, epoch, content_hash)`. An unpacked record is
one segment with offset 0; packing puts several in a row, concat-then-split can cut one record
across rows. `segments_from_batch` turns a batch in Grain's packed layout into segments.

Batch layout (what `pipeline`'s keyed loader emits, and what any loop can build):
- `tokens`: int [B, L] token ids.
- `tokens_segment_ids`: int [B, L], 0 for padding, a new id per segment within a row
  (Grain's packing output). Absent: each row is one segment of all L tokens.
- `key`: int64 [B, L] per token, or [B] per row: the record's global index `epoch * N + key`
  carried from `map_with_index` directly after the source.
- `pos`: int [B, L] per token, the token's position in its record, carried from before packing
  so that a record cut by concat-then-split keeps its true offset. Absent: Grain's
  `tokens_positions` (right for first-fit packing), or offset 0 for unpacked rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tally.audit.core.hashing import as_token_array, hash_runs
from tally.audit.core.schema import SEGMENT_COLUMNS, SEGMENT_DTYPES, names

# The columns a step's segments carry: the segment schema less the step and host, which the
# writer adds for the whole step.
FIELDS = tuple(n for n in names(SEGMENT_COLUMNS) if n not in ("step", "host"))
# Smallest value each column may hold (the spool's checks say the same, tally.audit.hook.spool).
MINIMUM = {"row": 0, "record_key": 0, "offset": 0, "n_tokens": 1}


@dataclass(frozen=True)
class Segments:
    """Column arrays for the segments of one step, in the spool's dtypes
    (tally.audit.core.schema)."""

    row: np.ndarray
    record_key: np.ndarray
    offset: np.ndarray
    n_tokens: np.ndarray
    content_hash: np.ndarray
    epoch: np.ndarray  # -1 when unknown
    loss: np.ndarray | None = None  # float32 training loss per segment (optional)

    def __len__(self) -> int:
        return len(self.row)

    @classmethod
    def build(
        cls,
        *,
        row: np.ndarray,
        record_key: np.ndarray,
        n_tokens: np.ndarray,
        content_hash: np.ndarray,
        offset: np.ndarray | None = None,
        epoch: np.ndarray | None = None,
        loss: np.ndarray | None = None,
    ) -> Segments:
        """Checked constructor: equal lengths, sane values, spool dtypes."""
        n = len(row)
        given = {"row": row, "record_key": record_key, "n_tokens": n_tokens,
                 "content_hash": content_hash,
                 "offset": np.zeros(n) if offset is None else offset,
                 "epoch": np.full(n, -1) if epoch is None else epoch}
        cols = {f: np.asarray(given[f], dtype=SEGMENT_DTYPES[f]) for f in FIELDS}
        for name, arr in cols.items():
            if arr.shape != (n,):
                raise ValueError(
                    f"segments: column {name!r} has shape {arr.shape}, expected ({n},)")
        if n:
            for name, low in MINIMUM.items():
                if cols[name].min() < low:
                    raise ValueError(f"segments: column {name!r} has values below {low}"
                                     + (" (a segment holds at least one token)"
                                        if name == "n_tokens" else ""))
        if loss is not None:
            loss = np.asarray(loss, np.float32)
            if loss.shape != (n,):
                raise ValueError(f"segments: column 'loss' has shape {loss.shape}, "
                                 f"expected ({n},)")
        return cls(**cols, loss=loss)


def segments_from_batch(
    batch: Mapping[str, np.ndarray],
    *,
    records_per_epoch: int | None = None,
    feature: str = "tokens",
    key: str = "key",
    position: str = "pos",
    segment_ids: str | None = None,
    loss: np.ndarray | None = None,
) -> Segments:
    """The segments a batch holds, with each segment's hash over exactly its tokens.

    `loss` (optional) is the training loss the step computed on this batch: per token, [B, L]
    or [B, L - 1], the value at position p being the loss of predicting token p + 1 from it
    (a causal language model's shifted targets), or per row, [B]. Each segment then carries
    the mean loss over the predictions inside it (positions s .. s + n - 2: the record's own
    next tokens; NaN for a one-token segment), or its row's loss.

    `records_per_epoch` (N) splits the carried index into `epoch = idx // N` and
    `record_key = idx % N`; without it the index is taken as the record key and epoch is -1.
    Field names default to Grain's packing layout: `feature`, `{feature}_segment_ids`, `key`,
    `pos` (or `{feature}_positions`); other loaders name theirs (MaxText: `inputs`,
    `inputs_segmentation`, `inputs_position`).
    """
    tokens = np.asarray(batch[feature])
    if tokens.ndim != 2:
        raise ValueError(f"batch[{feature!r}] must be [batch, length], got shape {tokens.shape}")
    n_rows, length = tokens.shape
    keys = np.asarray(batch[key])
    if keys.shape not in ((n_rows,), (n_rows, length)):
        raise ValueError(
            f"batch[{key!r}] has shape {keys.shape}; expected ({n_rows},) or ({n_rows}, {length})"
        )
    seg_ids = batch.get(segment_ids or f"{feature}_segment_ids")
    positions = batch.get(position)
    if positions is None:
        positions = batch.get(f"{feature}_positions")

    flat_tokens = as_token_array(tokens).reshape(-1)
    size = n_rows * length
    if seg_ids is None and keys.ndim == 1:
        starts = np.arange(0, size, length)  # one segment per row: nothing to scan
        lengths = np.full(n_rows, length)
    else:
        # A run starts at each row start and wherever the segment id changes (the carried key
        # when there are no segment ids); id 0 is padding. Every full pass over the [B, L]
        # grid costs ~1 ms at 512 x 8192, so this makes exactly one.
        marks = np.asarray(seg_ids if seg_ids is not None else keys).reshape(-1)
        change = np.empty(size, dtype=bool)
        change[0] = True
        np.not_equal(marks[1:], marks[:-1], out=change[1:])
        change[::length] = True
        starts = np.flatnonzero(change)
        lengths = np.diff(np.append(starts, size))
        if seg_ids is not None:
            keep = marks[starts] != 0
            starts, lengths = starts[keep], lengths[keep]

    rows = starts // length
    index = keys.reshape(-1)[starts] if keys.ndim == 2 else keys[rows]
    index = index.astype(np.int64)
    if records_per_epoch is not None:
        epoch, record_key = np.divmod(index, records_per_epoch)
    else:
        epoch, record_key = None, index
    offset = None if positions is None else np.asarray(positions).reshape(-1)[starts]
    return Segments.build(
        row=rows,
        record_key=record_key,
        offset=offset,
        n_tokens=lengths,
        epoch=epoch,
        content_hash=hash_runs(flat_tokens, starts, lengths),
        loss=None if loss is None else segment_loss(loss, n_rows, length, starts, lengths),
    )


def segment_loss(loss: np.ndarray, n_rows: int, length: int, starts: np.ndarray,
                 lengths: np.ndarray) -> np.ndarray:
    """Each segment's mean loss (see `segments_from_batch`), from per-token or per-row loss."""
    loss = np.asarray(loss, np.float64)
    if loss.shape == (n_rows,):
        return loss[starts // length].astype(np.float32)
    if loss.shape == (n_rows, length - 1):
        loss = np.concatenate([loss, np.zeros((n_rows, 1))], axis=1)
    if loss.shape != (n_rows, length):
        raise ValueError(f"loss has shape {loss.shape}; expected ({n_rows},), "
                         f"({n_rows}, {length - 1}) or ({n_rows}, {length})")
    cum = np.concatenate([[0.0], np.cumsum(loss.reshape(-1))])
    predictions = lengths - 1
    total = cum[starts + np.maximum(predictions, 0)] - cum[starts]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(predictions > 0, total / predictions, np.nan).astype(np.float32)
