"""Audit a `torch.utils.data.DataLoader` (or torchdata's `StatefulDataLoader`) as it is, in one
line, from the indices its sampler draws; replay the same from the loader without running it.

    loader = DataLoader(ds, batch_size=B, sampler=DistributedSampler(ds, H, h, seed=0))
    loader = tally_torch.audited(loader, "spool", run_id="exp1", host=h, host_count=H)
    for batch in loader: ...                       # the same batches, same objects, same order

The contract (map-style datasets): torch's DataLoader draws every batch's indices from its batch
sampler in the main process, with or without workers, and with `in_order=True` hands the loop
the batches in the order it drew them. So the audit records each index batch as the loader draws
it (a recorder around the batch sampler's iterator: every call, `state_dict` and
`load_state_dict` included, passes through) and pairs the k-th batch of an epoch the loop gets
with the k-th index batch drawn for it. A restored StatefulDataLoader resumes inside an epoch: the
batch's ordinal in its epoch (the iterator's `_num_yielded`) and the draw's (counted from the
restored sampler state) say which drawn batch it is; a pairing that does not hold stops the loop
with AttachError rather than mis-record it. Refused in one line: an IterableDataset, batch_size
None, `in_order=False` with workers.

Record key of sampler index i: `key_of(indices)` (vectorised), else the dataset's
`tally_record_keys(indices)`, else i. Epoch: `epoch_of(indices)`, else the sampler's `epoch`
(DistributedSampler's `set_epoch`, StatefulDistributedSampler) when the pass began, else -1; a
pass that begins after a whole one with that epoch unchanged (set_epoch not called) is recorded
as the epoch after the last, with a warning.
Step: the epoch's base step + the batch's ordinal in the epoch; the base is `start_step` for the
first pass, then where the previous pass ended; a state from the audited loader's `state_dict()`
carries it (`tally_epoch_base`), so a restored loader continues steps exactly across epochs.

Content hashed: the batch rows' tokens (`tokens_field`, an int [B, L] tensor; `mask_field` an
optional padding mask), or each record read again from the dataset on the writer's thread
(`content="source"`), or the manifest's hashes (`hashes=PATH`).
"""

from __future__ import annotations

import collections
import itertools
import json
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

try:
    import torch
    from torch.utils.data import DataLoader, IterableDataset
except ModuleNotFoundError as _exc:  # one line naming the extra (tally.audit.extras: MODULE_EXTRA)
    raise ModuleNotFoundError(f"tally.pipeline.loaders.torch_loader needs the torch extra "
                              f"({_exc.name} is not installed): pip install 'tally-audit[torch]'",
                              name=_exc.name) from None

from tally.pipeline.loaders import (
    AttachError,
    Hashes,
    batch_content,
    leading_rows,
    manifest_hashes,
    record,
    spool_options,
)

STATE_KEY = "tally_epoch_base"  # the step of ordinal 0 of the epoch a saved state is inside


# ---- checks and what the loader's sampler says -----------------------------------------------

def check_loader(loader: Any) -> None:
    """AttachError for a loader whose batches cannot be paired with its drawn indices."""
    if not isinstance(loader, DataLoader):
        raise AttachError(f"expected a torch.utils.data.DataLoader (or torchdata's "
                          f"StatefulDataLoader), got {type(loader).__name__}")
    if isinstance(loader.dataset, IterableDataset):
        raise AttachError("an IterableDataset: its batches are not drawn from a sampler, so "
                          "Tally cannot read their records from the loader (carry the record "
                          "key in the batch and use LedgerWriter.write_batch)")
    if loader.batch_sampler is None:
        raise AttachError("batch_size=None: the loader hands out single samples, not batches "
                          "(give batch_size or a batch_sampler)")
    if loader.num_workers > 0 and not getattr(loader, "in_order", True):
        raise AttachError("in_order=False: workers' batches come back in any order, so a batch "
                          "no longer follows the indices drawn for it (use in_order=True)")


def element_sampler(batch_sampler: Any) -> Any:
    """The sampler under a batch sampler (its `.sampler`), or the batch sampler itself."""
    return getattr(batch_sampler, "sampler", batch_sampler)


def sampler_epoch(batch_sampler: Any) -> int:
    """The pass's epoch as the sampler knows it (DistributedSampler.set_epoch), else -1."""
    for s in (batch_sampler, element_sampler(batch_sampler)):
        epoch = getattr(s, "epoch", None)
        if isinstance(epoch, int):
            return epoch
    return -1


def topology(batch_sampler: Any) -> tuple[int | None, int | None]:
    """(rank, num_replicas) of a distributed sampler, else (None, None)."""
    for s in (batch_sampler, element_sampler(batch_sampler)):
        rank, n = getattr(s, "rank", None), getattr(s, "num_replicas", None)
        if isinstance(rank, int) and isinstance(n, int):
            return rank, n
    return None, None


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and \
        callable(getattr(obj, "load_state_dict", None))


def _keys_function(loader: DataLoader, key_of: Callable | None
                   ) -> Callable[[np.ndarray], np.ndarray]:
    fn = key_of or getattr(loader.dataset, "tally_record_keys", None)
    if fn is None:
        return lambda idx: idx
    return lambda idx: np.asarray(fn(idx), np.int64).reshape(-1)


# ---- the recorder around the batch sampler ---------------------------------------------------

class _Recorder:
    """The batch sampler's iterator, recording every index batch drawn (the draw's ordinal in
    the epoch with it). Everything else is the inner iterator's."""

    def __init__(self, it: Iterator, epoch: int) -> None:
        self._it, self.epoch = it, epoch
        self.told = epoch  # the sampler's own epoch when the pass began
        self.drawn: collections.deque = collections.deque()
        self.count = 0  # draws since this recorder began (or was restored)
        self.base: int | None = 0  # epoch ordinal of draw 0 (None: restored, not yet known)

    def __iter__(self) -> _Recorder:
        return self

    def __next__(self) -> Any:
        idx = next(self._it)
        self.drawn.append((self.count, idx))
        self.count += 1
        return idx

    def __getattr__(self, name: str) -> Any:
        if name == "_it":
            raise AttributeError(name)
        return getattr(self._it, name)

    def take(self, ordinal: int, it: Any) -> np.ndarray:
        """The indices drawn for the epoch's batch `ordinal` (earlier draws were consumed by
        the loader itself: a restore's fast-forward, a skipped prefix)."""
        if self.base is None:  # restored: the loader counts draws in the epoch, we since then
            self.base = int(it._sampler_iter_yielded) - self.count
        while self.drawn and self.drawn[0][0] + self.base < ordinal:
            self.drawn.popleft()
        if not self.drawn or self.drawn[0][0] + self.base != ordinal:
            have = (self.drawn[0][0] + self.base) if self.drawn else None
            raise AttachError(f"batch {ordinal} of the epoch has no drawn indices (next drawn: "
                              f"{have}): the loader did not hand out batches in the order it "
                              "drew them")
        return np.asarray(self.drawn.popleft()[1], np.int64).reshape(-1)


class _StatefulRecorder(_Recorder):
    """A recorder around a stateful iterator (torchdata's): its state is the inner one's."""

    def state_dict(self) -> Any:
        return self._it.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self._it.load_state_dict(state)
        self.drawn.clear()
        self.count, self.base = 0, None


class _RecordingBatchSampler:
    """Stands in for the loader's batch sampler: iterating it gives a recorder; any attribute
    (`sampler`, `batch_size`, `state_dict`, ...) and len() are the batch sampler's own."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.latest: _Recorder | None = None

    def __iter__(self) -> _Recorder:
        it = iter(self._inner)
        cls = _StatefulRecorder if _stateful(it) else _Recorder
        told, prev = sampler_epoch(self._inner), self.latest
        epoch = told
        if told >= 0 and prev is not None and prev.told == told and prev.base == 0 and \
                prev.count >= len(self._inner):
            # A new pass after a whole one with the sampler's epoch unchanged: set_epoch was
            # not called. The pass is an epoch of its own all the same (recorded as the one
            # after the last), or every later pass would read as repeats within epoch `told`.
            epoch = prev.epoch + 1
            warnings.warn(f"the sampler's epoch is still {told} at a new pass over the "
                          "DataLoader: call sampler.set_epoch(epoch) before each epoch "
                          "(DistributedSampler reads the same order every epoch without it); "
                          "Tally records this pass as epoch " + str(epoch), stacklevel=2)
        self.latest = cls(it, epoch)
        self.latest.told = told
        return self.latest

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)


# ---- the audited loader ----------------------------------------------------------------------

class AuditedIterator(Iterator[Any]):
    """The loader's iterator, recording each batch it hands out (same objects, same order)."""

    def __init__(self, it: Any, owner: AuditedLoader, recorder: _Recorder, base: int) -> None:
        self._it, self._owner, self._rec, self.base = it, owner, recorder, base
        self.finished = False

    def __iter__(self) -> AuditedIterator:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._it)
        except StopIteration:
            self.finished = True
            raise
        o = self._owner
        ordinal = int(self._it._num_yielded) - 1
        idx = self._rec.take(ordinal, self._it)
        rows = leading_rows(batch)
        if rows is not None and rows != len(idx):
            raise AttachError(f"batch {ordinal} has {rows} rows, its sampler drew "
                              f"{len(idx)} indices: a collate_fn that changes the row count")
        step = self.base + ordinal
        o.next_step = step + 1
        epoch = self._rec.epoch
        if o.content == "batch":
            content: Any = batch_content(batch, tokens_field=o.tokens_field,
                                         mask_field=o.mask_field)
        elif o.content == "source":
            content = o.source_content(idx)
        else:
            content = o.manifest_content
        epoch_of = o.epoch_of
        record(o.writer, step, o.host, idx, content, epoch if epoch_of is None else
               (lambda: np.asarray(epoch_of(idx), np.int64)), o.keys_of)
        return batch

    def __getattr__(self, name: str) -> Any:
        if name == "_it":
            raise AttributeError(name)
        return getattr(self._it, name)


class AuditedLoader:
    """A DataLoader whose iterators record what they hand out. `len()`, `state_dict()`,
    `load_state_dict()` and every other attribute are the loader's own; `state_dict()` adds
    `tally_epoch_base` (the step of the current epoch's first batch), which a restore reads."""

    def __init__(self, loader: DataLoader, writer: Any, *, host: int, start_step: int = 0,
                 key_of: Callable | None = None, tokens_field: str | int | None = "input_ids",
                 mask_field: str | int | None = None, content: str = "batch",
                 hashes: Any = None, epoch_of: Callable | None = None) -> None:
        check_loader(loader)
        if getattr(loader, "_iterator", None) is not None:
            raise AttachError("the loader was iterated (or asked for its state) before it was "
                              "audited: attach first, then iterate")
        if content not in ("batch", "source") and hashes is None:
            raise AttachError(f"content={content!r}: 'batch' (the rows' tokens), 'source' "
                              "(read again from the dataset), or give hashes=MANIFEST")
        self.loader, self.writer, self.host = loader, writer, host
        self.next_step, self.start_step = start_step, start_step
        self.tokens_field, self.mask_field = tokens_field, mask_field
        self.content = "manifest" if hashes is not None else content
        self.keys_of, self.epoch_of = _keys_function(loader, key_of), epoch_of
        self._current: AuditedIterator | None = None
        self._restored_base: int | None = None
        if hashes is not None:
            self.manifest_content = lambda keys: Hashes(*hashes.lookup(keys))
        if self.content == "source":
            from tally.pipeline.grain_attach import SourceHashes  # its reader, not a copy of it

            self._source = SourceHashes(loader.dataset, tokens_field or "tokens")
        self._recording = _RecordingBatchSampler(loader.batch_sampler)
        # The loader's own attribute, swapped in place (DataLoader refuses a plain setattr):
        # the iterators it makes draw through the recorder; nothing else changes.
        object.__setattr__(loader, "batch_sampler", self._recording)

    def source_content(self, idx: np.ndarray) -> Callable[[np.ndarray], Hashes]:
        source = self._source

        def read(_keys: np.ndarray) -> Hashes:  # the dataset is indexed by sampler index
            seg = source.segments(idx, np.zeros(len(idx), np.int64))
            return Hashes(seg.content_hash, seg.n_tokens)

        return read

    def __iter__(self) -> AuditedIterator:
        state = getattr(self.loader, "next_iter_state", None)
        if state is not None:  # a restored StatefulDataLoader
            base = state.get(STATE_KEY, self._restored_base)
            base = self.start_step if base is None else int(base)
        else:
            base = self.next_step
        it = iter(self.loader)
        self.next_step = base + int(it._num_yielded)  # a restored iterator's position
        rec = self._recording.latest
        if rec is None:
            raise AttachError("the loader drew no indices through its batch sampler")
        self._current = AuditedIterator(it, self, rec, base)
        return self._current

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        state = dict(self.loader.state_dict())
        cur = self._current
        live = cur is not None and not cur.finished and not getattr(cur._it, "_finished", False)
        state[STATE_KEY] = cur.base if live else self.next_step
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        base = state.pop(STATE_KEY, None)
        self._restored_base = None if base is None else int(base)
        self._current = None
        self.loader.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


def audited(loader: Any, spool: Any, run_id: str | None = None, *, host: int | None = None,
            host_count: int | None = None, start_step: int = 0,
            key_of: Callable[[np.ndarray], np.ndarray] | None = None,
            tokens_field: str | int | None = "input_ids", mask_field: str | int | None = None,
            content: str = "batch", hashes: Any = None,
            epoch_of: Callable[[np.ndarray], np.ndarray] | None = None,
            **writer_options: Any) -> AuditedLoader:
    """`loader`, recording every batch its iterators hand out (see the module's doc).

    `spool`: a spool directory (a LedgerWriter is made: `run_id`, `host` / `host_count`
    (default: the sampler's rank / num_replicas), records_per_epoch = len(dataset), and
    `writer_options` as LedgerWriter takes them) or a LedgerWriter already made.
    `start_step`: the step of the first batch of a fresh loader (or of ordinal 0 of the epoch a
    state without Tally's key restores). `key_of`: sampler indices -> record keys (vectorised).
    `tokens_field` / `mask_field`: the batch's token tensor [B, L] and optional padding mask;
    `content="source"` reads each record again from the dataset (`tokens_field` of a dict
    item) on the writer's thread; `hashes`: a manifest path (or ManifestHashes) to take
    hashes from. The loop must not change the token tensor in place after it gets the batch."""
    from tally.audit.hook.writer import LedgerWriter

    check_loader(loader)
    rank, replicas = topology(loader.batch_sampler)
    writer = spool
    if isinstance(spool, LedgerWriter):
        host = spool.host if host is None else host
    else:
        host = rank if host is None else host
        host_count = replicas if host_count is None else host_count
        if host is None or host_count is None:
            raise AttachError("the loader's sampler does not say its rank: give host= and "
                              "host_count= (or a LedgerWriter)")
        if run_id is None:
            raise AttachError("audited(loader, spool, run_id): a spool directory needs a run id")
    hashes = manifest_hashes(hashes)
    if not isinstance(spool, LedgerWriter):
        writer = LedgerWriter(Path(spool), run_id, host=host, host_count=host_count,
                              **spool_options(hashes, writer_options, len(loader.dataset)))
    return AuditedLoader(loader, writer, host=host, start_step=start_step, key_of=key_of,
                         tokens_field=tokens_field, mask_field=mask_field, content=content,
                         hashes=hashes, epoch_of=epoch_of)


# ---- replay: the same index batches, from the loader, without loading data -------------------

def check_deterministic(loader: DataLoader) -> None:
    """AttachError unless the loader's index order follows from its configuration alone."""
    from torch.utils.data import RandomSampler

    s = element_sampler(loader.batch_sampler)
    if isinstance(s, RandomSampler) and s.generator is None:
        raise AttachError("a RandomSampler without a generator draws from torch's global seed: "
                          "its order cannot be replayed (give it "
                          "generator=torch.Generator().manual_seed(SEED))")


def restored_iterator(batch_sampler: Any, state: dict[str, Any]
                      ) -> tuple[Iterator, int, bool]:
    """(the batch sampler's iterator as a StatefulDataLoader restored from `state` draws, the
    epoch ordinal of its next batch, whether the saved epoch had finished): torchdata's own
    restore of its main state, without the dataset or workers."""
    if "_snapshot" in state:  # saved with workers
        snap = state["_snapshot"]
        main, ordinal = snap["_main_snapshot"], int(snap["_snapshot_step"])
        skip = int(state["_steps_since_snapshot"])
    else:
        main, ordinal, skip = state, int(state["_num_yielded"]), 0
    if state.get("_iterator_finished"):
        return iter(()), ordinal, True
    it: Iterator
    if _stateful(batch_sampler) or _stateful(it := iter(batch_sampler)):
        if _stateful(batch_sampler):
            batch_sampler.load_state_dict(main["_index_sampler_state"])
        it = iter(batch_sampler)
        if main["_sampler_iter_state"] is not None:
            it.load_state_dict(main["_sampler_iter_state"])
    else:
        it = itertools.islice(iter(batch_sampler), int(main["_sampler_iter_yielded"]), None)
    for _ in range(skip):
        next(it, None)
    return it, ordinal + skip, False


def index_batches(loader: DataLoader, steps: int, *, start_step: int = 0,
                  state: dict[str, Any] | None = None
                  ) -> Iterator[tuple[int, np.ndarray, int]]:
    """(step, sampler indices, epoch) of the loader's next `steps` batches, epoch after epoch
    (a sampler with set_epoch is set to its epoch + 1 at each new pass, as a training loop
    does), from the beginning or from a StatefulDataLoader's saved `state`."""
    bs = loader.batch_sampler
    base = start_step
    it: Iterator | None = None
    ordinal = 0
    if state is not None:
        if state.get(STATE_KEY) is not None:
            base = int(state[STATE_KEY])
        it, ordinal, finished = restored_iterator(bs, state)
        if finished:
            base, it, ordinal = base + ordinal, None, 0
            _next_epoch(bs)
    done = 0
    while done < steps:
        if it is None:
            it, ordinal = iter(bs), 0
        epoch = sampler_epoch(bs)
        drew = False
        for idx in it:
            drew = True
            yield base + ordinal, np.asarray(idx, np.int64).reshape(-1), epoch
            ordinal += 1
            done += 1
            if done >= steps:
                return
        if not drew and ordinal == 0:
            return  # an empty epoch: nothing more will come
        base, it = base + ordinal, None
        _next_epoch(bs)


def _next_epoch(batch_sampler: Any) -> None:
    s = element_sampler(batch_sampler)
    if callable(getattr(s, "set_epoch", None)) and isinstance(getattr(s, "epoch", None), int):
        s.set_epoch(s.epoch + 1)


def state_file(states: Path, host: int, hosts: int) -> Path | None:
    """Host `host`'s saved StatefulDataLoader state: `dataloader_<h>-of-<H>.json` (or `.pt`,
    torch.save of the state dict)."""
    for ext in ("json", "pt"):
        p = states / f"dataloader_{host}-of-{hosts}.{ext}"
        if p.is_file():
            return p
    return None


def read_state(path: Path) -> dict[str, Any]:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return torch.load(path, weights_only=True)


def replay_host(spec: Any, host: int, hashes: Any, loader: DataLoader) -> Any:
    """Write host `host`'s replayed spool files for `spec` (tally.pipeline.replay.ReplaySpec) from
    a torch DataLoader; returns tally.pipeline.loaders.replayed.HostReplay."""

    from tally.pipeline.loaders.replayed import HostReplay, ReplayedHost, ReplayError

    t0 = time.perf_counter()
    try:
        check_loader(loader)
        check_deterministic(loader)
    except AttachError as exc:
        raise ReplayError(f"--loader {spec.loader} (host {host}): {exc}") from None
    state = None
    if spec.states is not None:
        path = state_file(spec.states, host, spec.hosts)
        if path is None:
            raise ReplayError(f"no loader state for host {host} of {spec.hosts} in "
                              f"{spec.states} (dataloader_{host}-of-{spec.hosts}.json or .pt)")
        state = read_state(path)
    keys_of = _keys_function(loader, None)
    source = None
    if spec.hashes == "source":
        from tally.pipeline.grain_attach import SourceHashes

        source = SourceHashes(loader.dataset, "input_ids")
    def resolve(idx: np.ndarray, epoch: np.ndarray):
        key = keys_of(idx)
        if source is not None:
            seg = source.segments(idx, epoch)
            return key, seg.n_tokens, seg.content_hash
        content, n_tokens = hashes.lookup(key)
        return key, n_tokens, content

    out = ReplayedHost(spec.spool, spec.run_id, host, spec.hosts,
                       records_per_epoch=getattr(loader.dataset, "tally_records_per_epoch",
                                                 len(loader.dataset)),
                       resolve=resolve, fsync=spec.fsync,
                       fingerprint=hashes.fingerprint if hashes is not None else "",
                       content_basis=getattr(hashes, "content_basis", "")
                       if hashes is not None else "")
    for item in index_batches(loader, spec.steps, start_step=spec.start_step, state=state):
        out.add(*item)
    out.flush()
    return HostReplay(host, out.rows, out.files, out.first, out.last, time.perf_counter() - t0)


def check_replay(spec: Any, loader: DataLoader) -> None:
    """What a torch replay refuses before it writes anything (tally.pipeline.replay.check)."""
    from tally.pipeline.loaders.replayed import ReplayError

    try:
        check_loader(loader)
        check_deterministic(loader)
    except AttachError as exc:
        raise ReplayError(f"--loader {spec.loader}: {exc}") from None
    if spec.states is not None:
        for h in range(spec.hosts):
            path = state_file(spec.states, h, spec.hosts)
            if path is None:
                raise ReplayError(f"no loader state for host {h} of {spec.hosts} in "
                                  f"{spec.states} (dataloader_{h}-of-{spec.hosts}.json or .pt)")
            try:
                read_state(path)
            except Exception as exc:
                raise ReplayError(f"{path}: not a saved DataLoader state "
                                  f"({type(exc).__name__}: {exc})") from None


# ---- pre-flight: the relaunch's plan, from the loaders and the states it restores ------------

def saved_states(states: Path, check: Callable[[dict[str, Any]], Any] | None = None
                 ) -> tuple[int, dict[int, dict[str, Any]]]:
    """(n, every old host's saved state by host) from `dataloader_<h>-of-<n>.json|.pt` in
    `states`, one n for all, each passing `check` (default: a StatefulDataLoader's, see
    `resume_step`); AttachError naming what was found otherwise."""
    found = sorted(p for p in states.glob("dataloader_*-of-*.*") if p.suffix in (".json", ".pt"))
    counts = {p.stem.rsplit("-of-", 1)[-1] for p in found}
    if not found or len(counts) != 1 or not next(iter(counts)).isdigit():
        raise AttachError(f"--states {states}: expected the saved StatefulDataLoader states "
                         f"dataloader_<h>-of-<n>.json (or .pt) for one host count n, found "
                         f"{[p.name for p in found[:4]] or 'none'}")
    n = int(next(iter(counts)))
    out = {}
    for h in range(n):
        path = state_file(states, h, n)
        if path is None:
            raise AttachError(f"--states {states}: no state for old host {h} of {n} "
                             f"(dataloader_{h}-of-{n}.json or .pt)")
        try:
            out[h] = read_state(path)
            (check or resume_step)(out[h])
        except Exception as exc:  # noqa: BLE001  (a file that is not a loader state)
            raise AttachError(f"{path}: not a saved StatefulDataLoader state "
                             f"({type(exc).__name__}: {exc})") from None
    return n, out


def resume_step(state: dict[str, Any]) -> int:
    """The step of the next batch a StatefulDataLoader restored from `state` hands out: the
    epoch's base step (`tally_epoch_base`, 0 for a state saved without Tally) plus the batches
    the epoch had yielded (torchdata's own count: `_num_yielded`, or with workers the snapshot's
    step plus the steps since it)."""
    base = int(state.get(STATE_KEY) or 0)
    if "_snapshot" in state:
        return base + int(state["_snapshot"]["_snapshot_step"]) + \
            int(state["_steps_since_snapshot"])
    return base + int(state["_num_yielded"])


def planned_keys(loader: DataLoader, steps: int, *, start_step: int = 0,
                 state: dict[str, Any] | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(record keys, step of each, epoch of each: the sampler's, -1 unknown) of the loader's
    next `steps` batches as `index_batches` draws them (from `state` when given), keys through
    the dataset's `tally_record_keys`."""
    check_loader(loader)
    check_deterministic(loader)
    keys_of = _keys_function(loader, None)
    keys, at, epochs = [], [], []
    for step, idx, epoch in index_batches(loader, steps, start_step=start_step, state=state):
        keys.append(keys_of(idx))
        at.append(np.full(len(idx), step, np.int64))
        epochs.append(np.full(len(idx), epoch, np.int64))
    if not keys:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(keys), np.concatenate(at), np.concatenate(epochs)
