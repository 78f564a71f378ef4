"""PyTorch-side loaders audited as they are: the one contract every adapter gives the writer.

An adapter (`tally.pipeline.loaders.torch_loader` for torch's DataLoader and torchdata's
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

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tally.audit.core.errors import TallyError
from tally.audit.core.hashing import as_token_array, hash_runs
from tally.audit.hook.segments import Segments


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


def manifest_hashes(hashes: Any) -> Any:
    """A manifest path as its hashes by record key (tally.pipeline.manifest_file.ManifestHashes);
    anything else (None, hashes already read) as it is."""
    if isinstance(hashes, (str, os.PathLike)):
        from tally.pipeline.manifest_file import ManifestHashes

        return ManifestHashes(hashes)
    return hashes


def spool_options(hashes: Any, options: dict[str, Any], records: int | None
                   ) -> dict[str, Any]:
    """A LedgerWriter's options for an adapter's spool: the records an epoch (`records`, None:
    not known), and from the manifest's hashes, its fingerprint and content basis (what the
    hashes are of), unless the user gave them."""
    if records is not None:
        options.setdefault("records_per_epoch", records)
    if hashes is not None:
        options.setdefault("manifest_fingerprint", hashes.fingerprint)
        basis = getattr(hashes, "content_basis", "")
        if basis:
            options.setdefault("content_basis", basis)
    return options


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


def restore(loader: Any, state: dict[str, Any]) -> None:
    """Load a saved state (Tally's step taken out) into `loader`: its own `load_state_dict` (a
    StatefulDataLoader's), else its dataset's (`state["dataset"]`, as a plain DataLoader's
    audited state keeps it)."""
    if callable(getattr(loader, "load_state_dict", None)):
        loader.load_state_dict(state)
    else:
        loader.dataset.load_state_dict(state.get("dataset", state))


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
        restore(self.loader, state)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class PlannedLoader(SteppedLoader):
    """An audited loader whose every pass is planned from the tool before it starts (its
    workers not yet moving the tool's shared counters): `_plan()` gives the pass's epoch and
    the sample ids of each batch it will hand out, and the k-th batch the loop gets is recorded
    with the plan's k-th. A batch whose rows or a pass whose length is not the plan's stops the
    loop with AttachError: the loader is not the one planned. `len()`, `load_state_dict()` and
    every other attribute are the loader's; `state_dict()` adds the next step."""

    PLAN = "the tool's plan"  # what the errors call the plan
    writer: Any
    host: int
    key_of: Callable[[np.ndarray], np.ndarray] | None
    hashes: Any
    tokens_field: str | int | None
    mask_field: str | int | None

    def __init__(self, loader: Any, writer: Any, *, host: int, start_step: int = 0,
                 key_of: Callable | None = None, tokens_field: str | int | None = "input_ids",
                 mask_field: str | int | None = None, hashes: Any = None) -> None:
        self.loader, self.writer, self.host = loader, writer, host
        self.next_step = start_step
        self.key_of, self.hashes = key_of, hashes
        self.tokens_field, self.mask_field = tokens_field, mask_field

    def _plan(self) -> tuple[int, list[np.ndarray]]:
        raise NotImplementedError

    def spool_epoch(self, epoch: int) -> int:
        """The spool's epoch (0 first) of the tool's `epoch`."""
        return epoch

    def __iter__(self) -> Iterator[Any]:
        epoch, batches = self._plan()
        k = -1
        for k, batch in enumerate(self.loader):
            if k >= len(batches):
                raise AttachError(f"batch {k} of epoch {epoch}: {self.PLAN} gives this rank "
                                  f"{len(batches)} batches (a loader or dataset that is not "
                                  "the one attached?)")
            self._record(batch, batches[k], self.spool_epoch(epoch))
            yield batch
        if k + 1 != len(batches):
            raise AttachError(f"epoch {epoch} ended after {k + 1} batches; {self.PLAN} "
                              f"gives this rank {len(batches)}")

    def _record(self, batch: Any, ids: np.ndarray, epoch: int) -> None:
        rows = leading_rows(batch)
        if rows is not None and rows != len(ids):
            raise AttachError(f"step {self.next_step}: the batch has {rows} rows, {self.PLAN} "
                              f"{len(ids)} samples")
        step, self.next_step = self.next_step, self.next_step + 1
        content = batch_content(batch, hashes=self.hashes, tokens_field=self.tokens_field,
                                mask_field=self.mask_field)
        record(self.writer, step, self.host, ids, content, epoch, self.key_of)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """The loader's state, plus the next step (STEP_KEY)."""
        if not callable(getattr(self.loader, "state_dict", None)):
            raise AttachError(f"a plain {type(self.loader).__name__} has no state: use the "
                              "tool's own stateful loader (or save its state and the step "
                              "yourself)")
        state = dict(self.loader.state_dict() or {})
        state[self.STEP_KEY] = self.next_step
        return state


def plan_arrays(planned: Iterable[tuple[int, int, np.ndarray, int]]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A pre-flight plan's (rank, step, sample ids, epoch) batches as flat arrays: (record keys,
    step of each, rank of each, epoch of each: the tool's pass the batch belongs to, which the
    check reads to find where the relaunch's epoch ends)."""
    keys, at, ranks, epochs = [], [], [], []
    for rank, step, ids, epoch in planned:
        keys.append(np.asarray(ids, np.int64))
        at.append(np.full(len(ids), step, np.int64))
        ranks.append(np.full(len(ids), rank, np.int32))
        epochs.append(np.full(len(ids), epoch, np.int64))
    if not keys:
        empty = np.zeros(0, np.int64)
        return empty, empty, np.zeros(0, np.int32), empty
    return np.concatenate(keys), np.concatenate(at), np.concatenate(ranks), \
        np.concatenate(epochs)


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
