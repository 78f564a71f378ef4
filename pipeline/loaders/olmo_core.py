"""OLMo-core (`ai2-olmo-core`): its numpy fixed-length datasets and data loader, audited as they
are, by a trainer callback or around a plain loop; replayed from the loader's configuration.

    dataset = NumpyFSLDataset(*paths, sequence_length=L, dtype=np.uint32, ...)
    loader = NumpyFSLDataLoader(dataset, global_batch_size=G * L, seed=S, dp_world_size=W,
                                dp_rank=r, ...)
    trainer = TrainerConfig(..., callbacks={"tally": TallyCallback("spool", "exp1")}).build(
        train_module, loader)                               # the Trainer's loop, or
    loader = olmo_core.audited(loader, "spool", "exp1")     # a loop of one's own:
    loader.reshuffle(epoch=1); for batch in loader: ...; loader.reset()

OLMo-core's contract (olmo_core.data.data_loader, read on 3.0.0): an epoch's global instance
order is `NumpyFSLDataLoader._build_global_indices()`: `arange(len(dataset))`, permuted by
`get_rng(seed + epoch)` when `shuffle` (whole chunks of `chunk_size` instances when that is
above 1), built by `reshuffle(epoch)` (and saved in `work_dir` as
`global_indices_..._epoch{E}_seed{S}...npy`, or kept in memory). The epoch's batches are that
order cut to `total_size` (a whole number of global batches; the rest is left out this epoch)
and reshaped [batches, global_batch_size // sequence_length]; the first `batches_processed`
are skipped, and data-parallel rank r takes columns r, r + W, ... of each batch
(`_get_local_instance_indices`; workers take whole batches in turn, which keeps the order).
Every instance carries its global index into the batch (`batch["index"]`). `state_dict()`
holds `batches_processed`, `tokens_processed` (global), `seed` and `epoch`; `load_state_dict`
takes the seed from the state and sets `batches_processed = tokens_processed //
global_batch_size`. So a resume at another data-parallel world size (the same global batch) or
with another configured seed continues exactly; a loader state not restored starts the epoch
again (records repeated), and a resume with another global batch size rounds the consumed
tokens down to whole new batches: the instances of the remainder are read again.

Record key: `batch["index"]`, read from the batch (`key_field`). For a `NumpyFSLDataset` that
is the instance's id in the files in the order given, each cut into `tokens //
sequence_length` instances: the id `tally.pipeline.olmo` gives the same files in the same order
(`tally manifest` of the mix's index.json); EOS plays no part in the cut. For OLMo-core's other
FSL datasets (mixtures, padded, packed) `key_of` maps their indices. Epoch: OLMo-core's (from
1). Step: the Trainer's `global_step - 1` (from 0; it continues across a restore), or counted
by the audited loader (`tally_step` in its `state_dict()`). Content: the batch's `input_ids`
(`tokens_field`) or the manifest's hashes (`hashes=PATH`).

`TallyCallback` is an OLMo-core `Callback`: its `pre_train` makes the host's LedgerWriter
(host = the loader's dp_rank of dp_world_size; on a restored run, the attempt after the one the
checkpoint saved, resumed at the restored step), `pre_step(batch)` hands the batch's keys to
the writer, `state_dict()` (taken by every checkpoint save) flushes the writer first, so the
ledger is never behind a checkpoint, and `post_train` finishes it.

Replay (`replay`): a data loader built from the run's dataset and loader configuration for one
rank, its saved state (or none), and olmo_core's own `reshuffle` / `_get_local_instance_indices`
give the rank's batches, written as a spool marked replayed with the manifest's hashes.
`tally replay --loader MODULE:FUNCTION` and `tally preflight --loader` take a factory returning
the loader of dp rank h of H (`replay_spec_host`, `planned_keys`) and the states where a Trainer
checkpoint keeps them (`--states <checkpoint>`: `train/rank<r>.pt`, a trainer state or a
loader's `state_dict()`), each new rank restoring its own file, else rank0.pt, as OLMo-core's
Checkpointer does (pure data parallelism: the global rank is the dp rank).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

try:
    import torch  # noqa: F401  (OLMo-core's batches are torch tensors)
    from olmo_core.data.data_loader import NumpyFSLDataLoader
    from olmo_core.train.callbacks.callback import Callback
except ModuleNotFoundError as _exc:  # one line naming the extra (tally.audit.extras: MODULE_EXTRA)
    _top = (_exc.name or "olmo_core").split(".")[0]
    raise ModuleNotFoundError(f"tally.pipeline.loaders.olmo_core needs the olmo extra "
                              f"({_top} is not installed): pip install 'tally-audit[olmo]'",
                              name=_top) from None

from tally.pipeline.loaders import (
    AttachError,
    SteppedLoader,
    batch_content,
    field,
    leading_rows,
    manifest_hashes,
    plan_arrays,
    record,
    spool_options,
)

STEP_KEY = SteppedLoader.STEP_KEY


def check_loader(loader: Any) -> None:
    """AttachError for a data loader whose batches Tally cannot key."""
    if not isinstance(loader, NumpyFSLDataLoader):
        raise AttachError(f"expected an OLMo-core NumpyFSLDataLoader, got "
                          f"{type(loader).__name__} (variable-length loaders are not audited)")


def _epoch(loader: Any) -> int:
    try:
        return int(loader.epoch)
    except RuntimeError:
        raise AttachError("the data loader has no epoch yet: call data_loader.reshuffle(epoch) "
                          "before iterating it (OLMo-core's contract)") from None


def _keys(batch: Any, key_field: str, tokens_field: str, step: int) -> np.ndarray:
    """The batch's instance indices, copied now (the batch is the loop's)."""
    keys = np.asarray(field(batch, key_field), np.int64).reshape(-1).copy()
    rows = leading_rows(field(batch, tokens_field))
    if rows is not None and rows != len(keys):
        raise AttachError(f"step {step}: the batch has {len(keys)} indices for {rows} rows")
    return keys


class _Recorder:
    """What the callback and the audited loader share: one batch to the writer."""

    writer: Any
    host: int
    hashes: Any
    tokens_field: str
    key_field: str
    key_of: Callable[[np.ndarray], np.ndarray] | None

    def _record(self, batch: Any, step: int, epoch: int) -> None:
        keys = _keys(batch, self.key_field, self.tokens_field, step)
        content = batch_content(batch, hashes=self.hashes, tokens_field=self.tokens_field)
        record(self.writer, step, self.host, keys, content, epoch, self.key_of)


class AuditedOlmoLoader(_Recorder, SteppedLoader):
    """An OLMo-core data loader whose batches are recorded as the loop gets them; every other
    attribute (`reshuffle`, `reset`, `batches_processed`, ...) is the loader's, and
    `state_dict()` adds the next step (`tally_step`)."""

    def __init__(self, loader: Any, writer: Any, *, host: int, start_step: int = 0,
                 key_of: Callable | None = None, tokens_field: str = "input_ids",
                 key_field: str = "index", hashes: Any = None) -> None:
        check_loader(loader)
        self.loader, self.writer, self.host, self.next_step = loader, writer, host, start_step
        self.key_of, self.hashes = key_of, hashes
        self.tokens_field, self.key_field = tokens_field, key_field

    def __iter__(self) -> Iterator[Any]:
        epoch = _epoch(self.loader)
        for batch in self.loader:
            step, self.next_step = self.next_step, self.next_step + 1
            self._record(batch, step, epoch)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """The loader's state, plus the next step."""
        return {**self.loader.state_dict(), STEP_KEY: self.next_step}


def _writer(spool: Any, run_id: str | None, loader: Any, hashes: Any,
            options: dict[str, Any]) -> Any:
    from tally.audit.hook.writer import LedgerWriter

    if isinstance(spool, LedgerWriter):
        return spool
    if run_id is None:
        raise AttachError("a spool directory needs a run id")
    return LedgerWriter(Path(spool), run_id, host=int(loader.dp_rank),
                        host_count=int(loader.dp_world_size),
                        **spool_options(hashes, options, len(loader.dataset)))


def audited(loader: Any, spool: Any, run_id: str | None = None, *, start_step: int = 0,
            key_of: Callable[[np.ndarray], np.ndarray] | None = None,
            tokens_field: str = "input_ids", key_field: str = "index", hashes: Any = None,
            **writer_options: Any) -> AuditedOlmoLoader:
    """`loader` (a NumpyFSLDataLoader), recording every batch a loop of one's own gets from it
    (see the module's doc). `spool`: a spool directory (a LedgerWriter is made: `run_id`, host
    = the loader's dp_rank of dp_world_size, records_per_epoch = len(dataset), and
    `writer_options` as LedgerWriter takes them) or a LedgerWriter already made. `hashes`: a
    manifest path (or ManifestHashes) to take hashes from instead of the batch's tokens."""
    check_loader(loader)
    hashes = manifest_hashes(hashes)
    writer = _writer(spool, run_id, loader, hashes, writer_options)
    return AuditedOlmoLoader(loader, writer, host=writer.host, start_step=start_step,
                             key_of=key_of, tokens_field=tokens_field, key_field=key_field,
                             hashes=hashes)


class TallyCallback(_Recorder, Callback):
    """An OLMo-core trainer callback recording the batch every step consumes (see the module's
    doc). `spool`, `run_id`, `hashes`, `key_of`, `tokens_field`, `key_field` and
    `writer_options` as for `audited`; a LedgerWriter given is the caller's to close."""

    # Above the checkpointer's (1), so that a host's batch is handed over before anything else.
    priority = 2

    def __init__(self, spool: Any, run_id: str | None = None, *, hashes: Any = None,
                 key_of: Callable[[np.ndarray], np.ndarray] | None = None,
                 tokens_field: str = "input_ids", key_field: str = "index",
                 **writer_options: Any) -> None:
        self.spool, self.run_id, self.options = spool, run_id, writer_options
        self.hashes, self.key_of = manifest_hashes(hashes), key_of
        self.tokens_field, self.key_field = tokens_field, key_field
        self.writer: Any = None
        self.host = 0
        self.saved_attempt: int | None = None  # the attempt a restored checkpoint was saved in
        self.finished = self.closed = False

    def __deepcopy__(self, memo: dict) -> TallyCallback:
        # TrainerConfig.with_callback deep-copies its callbacks: the writer (a thread) and the
        # manifest's hashes are shared, never copied.
        return self

    def pre_train(self) -> None:
        trainer = self.trainer
        check_loader(trainer.data_loader)
        resumed = int(trainer.global_step)
        if self.writer is None:
            options = dict(self.options)
            if resumed and "attempt" not in options:
                if self.saved_attempt is None:
                    raise AttachError(f"the trainer resumed at step {resumed} from a checkpoint "
                                      "without TallyCallback's state: give attempt=")
                options["attempt"] = self.saved_attempt + 1
            attempt = int(options.setdefault("attempt", 0))
            if attempt:
                options.setdefault("resumed_from_step", resumed)
            self.writer = _writer(self.spool, self.run_id, trainer.data_loader, self.hashes,
                                  options)
        self.host = self.writer.host

    def pre_step(self, batch: dict[str, Any]) -> None:
        trainer = self.trainer
        self._record(batch, int(trainer.global_step) - 1, int(trainer.epoch))

    def state_dict(self) -> dict[str, Any]:
        """Taken by every checkpoint save: the writer is flushed first."""
        if self.writer is None:
            return {}
        if not self.closed:
            self.writer.flush()
        return {"attempt": int(self.writer.attempt)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "attempt" in state_dict:
            self.saved_attempt = int(state_dict["attempt"])

    def post_train(self) -> None:
        self.finished = not self.trainer.is_canceled

    def close(self) -> None:
        # After post_train: the checkpointer's final save (its post_train) still takes
        # state_dict(), so the writer is finished here, when the trainer shuts down.
        if self.writer is not None and self.writer is not self.spool and not self.closed:
            self.closed = True
            self.writer.finish() if self.finished else self.writer.close()

    def on_error(self, exc: BaseException) -> None:
        if self.writer is not None and self.writer is not self.spool and not self.closed:
            self.closed = True
            self.writer.__exit__(type(exc), exc, exc.__traceback__)


# ---- replay: the rank's batches from olmo_core's own order, without reading instances --------

def batches(loader: Any, *, steps: int, state: dict[str, Any] | None = None,
            start_step: int = 0, epoch: int = 1) -> Iterator[tuple[int, np.ndarray, int]]:
    """(step, instance indices, epoch) of the next `steps` batches of `loader`'s rank, epoch
    after epoch: from `epoch`'s start, or from a saved `state` (the loader's `state_dict()`,
    with or without `tally_step`, or a Trainer's state dict: its `data_loader` and
    `global_step`). `loader`: a NumpyFSLDataLoader built from the run's dataset and loader
    configuration for that rank; its state is set here (load_state_dict, reshuffle, reset)."""
    check_loader(loader)
    step = start_step
    if state is not None:
        state = dict(state)
        if "data_loader" in state:  # a Trainer's
            step = int(state.get("global_step", step))
            state = dict(state["data_loader"])
        if state.get(STEP_KEY) is not None:
            step = int(state.pop(STEP_KEY))
        try:
            loader.load_state_dict(state)  # OLMo-core's restore (seed, batches_processed)
        except (KeyError, RuntimeError) as exc:  # another dataset, or not a loader's state
            raise AttachError(f"the saved state does not restore this data loader: "
                              f"{exc}") from None
        epoch = int(state.get("epoch") or epoch)
    else:
        loader.batches_processed = 0
    per_rank = loader.rank_batch_size // loader.dataset.sequence_length
    while steps > 0:
        loader.reshuffle(epoch, in_memory=True)  # olmo_core's own global order
        local = np.asarray(loader._get_local_instance_indices(loader.get_global_indices()),
                           np.int64).reshape(-1, per_rank)
        if not len(local) and not loader.batches_processed:
            return  # an epoch with no whole batch: nothing more will come
        for ids in local[:steps]:
            yield step, ids, epoch
            step += 1
        steps -= min(len(local), steps)
        loader.reset()
        epoch += 1


def replay(loader: Any, spool: str | os.PathLike, run_id: str, *, steps: int, hashes: Any,
           state: dict[str, Any] | None = None, start_step: int = 0, epoch: int = 1,
           key_of: Callable[[np.ndarray], np.ndarray] | None = None,
           fsync: bool = True) -> Any:
    """Write the replayed spool files of `loader`'s rank (host dp_rank of dp_world_size):
    `batches(...)`, hashed from the manifest `hashes`, marked replayed as `tally replay` marks
    them. Returns tally.pipeline.loaders.replayed.HostReplay."""
    import time

    from tally.pipeline.loaders.replayed import HostReplay, ReplayedHost, ReplayError

    t0 = time.perf_counter()
    if not isinstance(loader, NumpyFSLDataLoader):
        raise ReplayError(f"expected an OLMo-core NumpyFSLDataLoader, got "
                          f"{type(loader).__name__}")
    hashes = manifest_hashes(hashes)

    def resolve(idx: np.ndarray, _epoch: np.ndarray):
        keys = idx if key_of is None else np.asarray(key_of(idx), np.int64)
        content, n_tokens = hashes.lookup(keys)
        return keys, n_tokens, content

    out = ReplayedHost(spool, run_id, int(loader.dp_rank), int(loader.dp_world_size),
                       records_per_epoch=len(loader.dataset), resolve=resolve, fsync=fsync,
                       fingerprint=hashes.fingerprint,
                       content_basis=getattr(hashes, "content_basis", "") or "")
    for item in batches(loader, steps=steps, state=state, start_step=start_step, epoch=epoch):
        out.add(*item)
    out.flush()
    return HostReplay(out.host, out.rows, out.files, out.first, out.last,
                      time.perf_counter() - t0)


# ---- the factory-based commands: `tally replay --loader` and `tally preflight --loader` ------
# A Trainer checkpoint keeps each rank's trainer state (its `data_loader` state and
# `global_step`) in `<checkpoint>/train/rank<r>.pt`; a plain loop saves the audited loader's
# `state_dict()` (with `tally_step`) the same way. OLMo-core's Checkpointer restores rank r
# from rank<r>.pt, else from rank0.pt (a checkpoint of another world size): the loader states
# all hold the global tokens consumed, so any rank's restores any other.

def _train_dir(states: Path) -> Path:
    """`states` is a checkpoint directory (holding train/) or its train/ directory."""
    return states / "train" if (states / "train").is_dir() else states


def state_file(states: Path, rank: int) -> Path:
    """The file new dp rank `rank` restores, as OLMo-core's Checkpointer picks it."""
    train = _train_dir(Path(states))
    for path in (train / f"rank{rank}.pt", train / "rank0.pt"):
        if path.is_file():
            return path
    raise AttachError(f"--states {states}: no OLMo-core trainer state for rank {rank} "
                      f"(expected a checkpoint directory holding train/rank{rank}.pt or "
                      "train/rank0.pt)")


def read_state(path: Path) -> dict[str, Any]:
    """A trainer state or a data loader's `state_dict()`, torch.save'd; AttachError else."""
    try:
        # Not weights_only: a trainer state holds the RNG states (OLMo-core loads it so too).
        state = torch.load(path, weights_only=False)
        loader_state = state.get("data_loader", state)
        int(loader_state["tokens_processed"]), int(loader_state["seed"])
    except Exception as exc:  # noqa: BLE001  (a file that is not a state)
        raise AttachError(f"{path}: not an OLMo-core trainer or data loader state "
                          f"({type(exc).__name__}: {exc})") from None
    return state


def resume_step(state: dict[str, Any]) -> int | None:
    """The step of the next batch after `state`: the Trainer's `global_step` (its steps so
    far), the audited loader's `tally_step`, or None (a bare loader state does not say)."""
    if "data_loader" in state:
        return int(state["global_step"])
    return None if state.get(STEP_KEY) is None else int(state[STEP_KEY])


def factory_loader(loader: Any, host: int, hosts: int) -> None:
    """AttachError unless the factory gave an audited kind of loader of dp rank host of
    hosts (the spool's host is the loader's dp_rank)."""
    check_loader(loader)
    if (int(loader.dp_rank), int(loader.dp_world_size)) != (host, hosts):
        raise AttachError(f"the factory's loader for host {host} of {hosts} is dp rank "
                          f"{loader.dp_rank} of {loader.dp_world_size}")


def replay_spec_host(spec: Any, host: int, hashes: Any, loader: Any) -> Any:
    """Host (dp rank) `host`'s replayed spool for `spec` (tally.pipeline.replay.ReplaySpec) from the
    factory's loader, restored from --states as the Trainer restores it (else fresh, numbered
    from --start-step): `replay`."""
    from tally.pipeline.loaders.replayed import ReplayError

    try:
        factory_loader(loader, host, spec.hosts)
        state = None if spec.states is None else read_state(state_file(spec.states, host))
    except AttachError as exc:
        raise ReplayError(f"--loader {spec.loader} (host {host}): {exc}") from None
    return replay(loader, spec.spool, spec.run_id, steps=spec.steps, hashes=hashes,
                  state=state, start_step=spec.start_step, fsync=spec.fsync)


def check_replay(spec: Any, loader: Any) -> None:
    """What an OLMo-core replay refuses before it writes anything (tally.pipeline.replay.check)."""
    from tally.pipeline.loaders.replayed import ReplayError

    if spec.hashes != "manifest":
        raise ReplayError("--hashes source: an OLMo-core replay takes hashes from the manifest "
                          "(the instances are not read)")
    try:
        factory_loader(loader, 0, spec.hosts)
        if spec.states is not None:
            for h in range(spec.hosts):
                read_state(state_file(spec.states, h))
    except AttachError as exc:
        raise ReplayError(f"--loader {spec.loader}: {exc}") from None


def planned_keys(make: Callable[[int, int], Any], hosts: int, steps: int, *,
                 states: Path | None = None, start_step: int = 0
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(instance indices, step, dp rank, epoch) of every new rank's next `steps` batches: the loader
    `make(rank, hosts)`, restored from its state in `states` as the Trainer restores it (steps
    numbered from the state's), or fresh from epoch 1 numbered from `start_step`."""
    def planned() -> Iterator[tuple[int, int, np.ndarray]]:
        for rank in range(hosts):
            loader = make(rank, hosts)
            factory_loader(loader, rank, hosts)
            state = None if states is None else read_state(state_file(states, rank))
            for step, ids, epoch in batches(loader, steps=steps, state=state,
                                        start_step=start_step):
                yield rank, step, ids, epoch

    return plan_arrays(planned())
