"""PyTorch-side loaders audited as they are: the one contract every adapter gives the writer.

An adapter (`pipeline.loaders.torch_loader` for torch's DataLoader and torchdata's
StatefulDataLoader; Hugging Face datasets, Streaming, litdata and OLMo-core to follow) reads
which records a batch holds from the loader itself and hands the writer, per consumed batch,
one `Consumed`: the step, the host, each row's record key (and epoch, -1 unknown), and the
content, either the rows' tokens (hashed on the writer's thread, padding left out by an optional
mask) or hashes already known (a manifest's). `Consumed.segments()` turns it into the spool's
segments; `hand_over` queues it on a `LedgerWriter` so that keys, reads and hashes are computed
on the writer's thread, never the training thread's.

This module imports nothing beyond the base install (numpy and the hook): an adapter imports
its own package (torch, ...) and a missing one is one line naming the extra.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from audit.core.errors import TallyError
from audit.core.hashing import as_token_array, hash_runs
from audit.hook.segments import Segments


class AttachError(TallyError):
    """A loader Tally cannot audit from what it knows of it (the message says what to do)."""


@dataclass(frozen=True)
class Tokens:
    """The tokens of a batch's rows: [B, L] integers (anything numpy takes: a CPU tensor too),
    with an optional [B, L] mask, nonzero where a token belongs to the row's record (padding
    0, on either side). Each row is one record: its hash is over its unmasked tokens."""

    tokens: Any
    mask: Any = None

    def hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """(content_hash uint64, n_tokens int64) per row."""
        tok = as_token_array(np.asarray(self.tokens))
        if tok.ndim != 2:
            raise AttachError(f"the batch's tokens have shape {tok.shape}: expected "
                              "[batch, length] (name the token field, or hash from the "
                              "manifest or the dataset instead)")
        b, length = tok.shape
        if self.mask is None:
            lengths = np.full(b, length, np.int64)
            return hash_runs(tok.reshape(-1), np.arange(b, dtype=np.int64) * length,
                             lengths), lengths
        keep = np.asarray(self.mask).astype(bool)
        if keep.shape != tok.shape:
            raise AttachError(f"the padding mask has shape {keep.shape}, the tokens "
                              f"{tok.shape}")
        lengths = keep.sum(axis=1).astype(np.int64)
        if b and lengths.min() == 0:
            raise AttachError(f"row {int(np.argmin(lengths))} of the batch is all padding: "
                              "no record to hash")
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        return hash_runs(np.ascontiguousarray(tok[keep]), starts, lengths), lengths


@dataclass(frozen=True)
class Hashes:
    """Hashes already known (a manifest's), one per row."""

    content_hash: np.ndarray
    n_tokens: np.ndarray

    def hashes(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.content_hash, np.uint64), np.asarray(self.n_tokens, np.int64)


@dataclass(frozen=True)
class Consumed:
    """What one host consumed at one step: the contract every adapter gives the writer.

    `record_keys` [B] (int64), `epochs` [B] (-1: unknown; None: all unknown), `rows` [B] (the
    batch row of each record; None: 0..B-1), `content`: Tokens, Hashes, or a function of the
    record keys returning one of them (called on the writer's thread: a dataset read again, a
    manifest lookup)."""

    step: int
    host: int
    record_keys: np.ndarray
    content: Tokens | Hashes | Callable[[np.ndarray], Tokens | Hashes]
    epochs: np.ndarray | None = None
    rows: np.ndarray | None = None

    def segments(self) -> Segments:
        keys = np.asarray(self.record_keys, np.int64)
        content = self.content
        if not isinstance(content, (Tokens, Hashes)):
            content = content(keys)
        content_hash, n_tokens = content.hashes()
        if len(content_hash) != len(keys):
            raise AttachError(f"step {self.step}: {len(content_hash)} rows of content for "
                              f"{len(keys)} record keys")
        rows = np.arange(len(keys)) if self.rows is None else self.rows
        return Segments.build(row=rows, record_key=keys, n_tokens=n_tokens,
                              content_hash=content_hash, epoch=self.epochs)


def hand_over(writer: Any, step: int, consumed: Callable[[], Consumed]) -> None:
    """Queue one step on `writer` (a LedgerWriter): `consumed` runs on the writer's thread, so
    that key mapping, reads and hashing cost the training thread nothing."""
    host = writer.host

    def segments() -> Segments:
        c = consumed()
        if c.host != host:
            raise AttachError(f"a batch of host {c.host} handed to host {host}'s writer")
        if c.step != step:
            raise AttachError(f"a batch of step {c.step} handed over as step {step}")
        return c.segments()

    writer.write_segments(step, segments)


def batch_content(batch: Any, *, hashes: Any = None, tokens_field: str | int | None = None,
                  mask_field: str | int | None = None) -> Any:
    """What one batch's rows are hashed from: the manifest's hashes by record key (`hashes`,
    looked up on the writer's thread), else the batch's own tokens and optional mask."""
    if hashes is not None:
        return lambda keys: Hashes(*hashes.lookup(keys))
    mask = None if mask_field is None else field(batch, mask_field)
    return Tokens(field(batch, tokens_field), mask)


def record(writer: Any, step: int, host: int, indices: np.ndarray, content: Any,
           epochs: Callable[[], np.ndarray] | int,
           key_of: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
    """Hand one batch to `writer`: the loader's `indices` (record keys through `key_of`) and
    their epochs (one for all, or a function of nothing, both resolved on the writer's
    thread)."""

    def consumed() -> Consumed:
        keys = indices if key_of is None else np.asarray(key_of(indices), np.int64).reshape(-1)
        ep = epochs() if callable(epochs) else np.full(len(indices), epochs, np.int64)
        return Consumed(step, host, keys, content, ep)

    hand_over(writer, step, consumed)


def field(batch: Any, name: str | int | None) -> Any:
    """batch[name] for a dict batch (or a tuple's item name), the batch itself for None."""
    if name is None:
        return batch
    if isinstance(batch, Mapping):
        if name not in batch:
            raise AttachError(f"the batch has no field {name!r} (fields: {sorted(batch)}): "
                              "name the token field with tokens_field=")
        return batch[name]
    if isinstance(batch, (list, tuple)) and isinstance(name, int):
        return batch[name]
    raise AttachError(f"cannot take field {name!r} of a {type(batch).__name__} batch")


class SteppedLoader:
    """An audited loader whose every other attribute is the user's loader's own, and whose
    saved state carries the next step (STEP_KEY) beside the loader's (or dataset's) state."""

    STEP_KEY = "tally_step"
    loader: Any
    next_step: int

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        step = state.pop(self.STEP_KEY, None)
        if step is not None:
            self.next_step = int(step)
        if callable(getattr(self.loader, "load_state_dict", None)):
            self.loader.load_state_dict(state)
        else:
            self.loader.dataset.load_state_dict(state.get("dataset", state))

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


def leading_rows(batch: Any) -> int | None:
    """The leading dimension of the batch's first array (dicts, tuples and lists walked)."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else None
    values = batch.values() if isinstance(batch, Mapping) else \
        batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        rows = leading_rows(v)
        if rows is not None:
            return rows
    return None
