"""Hugging Face `datasets` fed through a torch DataLoader, audited in one line.

    ds = Dataset.load_from_disk(DIR).with_format("torch")
    node = split_dataset_by_node(ds, rank, world_size)           # or the whole of ds
    loader = DataLoader(node, batch_size=B, ...)
    loader = hf_datasets.audited(loader, "spool", "exp1", full=ds, rank=rank,
                                 world_size=world_size)
    for batch in loader: ...                       # the same batches, same objects, same order

**A map-style `Dataset`**: the loader's sampler indexes the node's dataset, so the audit is
torch's (`tally.pipeline.loaders.torch_loader`) with one key mapping: a node-local index back to the
row's index in the dataset that was split (`full`). `split_dataset_by_node` on a map-style
dataset is `full.shard(world_size, rank, contiguous=True)` (datasets' arrow_dataset.py,
checked on 5.0.1): with div, mod = divmod(len(full), world_size), node `rank` holds rows
div * rank + min(rank, mod) onward, div (+ 1 while rank < mod) of them; `contiguous=False` is
rows rank, rank + world_size, ... (`NodeKeys`). The split is not readable from the node's
dataset itself (a contiguous `select` slices the table and keeps no offset), so `full`,
`rank` and `world_size` are given, and a node whose length is not the shard's is refused.
`split_dataset_by_node(full, rank, world_size)` here does datasets' split and marks the node
(`tally_record_keys`, `tally_records_per_epoch`), so that a `tally replay` loader factory that
builds its loader on it replays the same keys (torch_loader's replay reads the marks).

**An `IterableDataset`** (`to_iterable_dataset(num_shards=K)`, `split_dataset_by_node`,
`shuffle`, its `state_dict` / `load_state_dict`, a torchdata StatefulDataLoader over it): its
examples come from the dataset's own iterator, in workers or not, with no sampler to read; its
`state_dict` counts Arrow chunks and rebatching, not examples. So the record key is carried by
the example: an index column added to the map-style dataset before it becomes iterable and
before any shuffle (the user's one line, `ds = ds.map(lambda _, i: {"tally_key": i},
with_indices=True)`), read from each batch (`key_field`). Steps count the batches the loop got;
`state_dict()` is the loader's (or, for a plain DataLoader, the dataset's) with the next step
added (`tally_step`), so a restore continues steps, and keys come with the examples.

Content hashed, as torch_loader does: the batch's tokens (`tokens_field`, `mask_field`), or the
manifest's hashes (`hashes=PATH`).

**Replay of an IterableDataset** (`tally replay --loader MODULE:FACTORY`, `replay_host`): no
arithmetic gives its order (shards, shuffle buffers, the split and the workers decide it as it
runs), so the factory's own loader runs, restored from the saved state, over the key column
alone: its dataset becomes `dataset.select_columns([key_field])`, which wraps the same example
iterable (same shards, order, buffers, split; datasets' state has the same shape), and its
collate_fn torch's default (the user's may need the columns left out); batch size, workers and
every other setting stay the loader's. No token column is formatted or collated (an Arrow-backed
dataset does not decode it either). Saved states as for torch: each host's audited
`state_dict()` as `dataloader_<h>-of-<n>.json|.pt`, host h restoring old host h % n's. datasets'
state of a split dataset counts the rank's own shards when the shards divide among the ranks
(`shard_data_sources`), or a position in the whole stream that each rank reads every
world-size-th example of (`StepExamplesIterable`); the first cannot be restored on another world
size, and such a replay is refused (`check_restorable`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

try:
    import datasets
    from datasets.distributed import split_dataset_by_node as _hf_split
    from torch.utils.data import DataLoader, default_collate, default_convert
except ModuleNotFoundError as _exc:  # one line naming the extra (tally.audit.extras: MODULE_EXTRA)
    raise ModuleNotFoundError(f"tally.pipeline.loaders.hf_datasets needs the hf extra "
                              f"({_exc.name} is not installed): pip install 'tally-audit[hf]'",
                              name=_exc.name) from None

from tally.pipeline.loaders import (
    AttachError,
    SteppedLoader,
    batch_content,
    leading_rows,
    manifest_hashes,
    plan_arrays,
    record,
    restore,
    spool_options,
    torch_loader,
)

KEY_FIELD = "tally_key"
STEP_KEY = SteppedLoader.STEP_KEY


# ---- map-style: node-local index -> the index in the dataset that was split ------------------

class NodeKeys:
    """Node `rank`'s indices -> indices of the `n`-row dataset split over `world_size` nodes,
    as `Dataset.shard(world_size, rank, contiguous)` took them (vectorised, picklable)."""

    def __init__(self, n: int, rank: int, world_size: int, contiguous: bool = True) -> None:
        if not 0 <= rank < world_size:
            raise AttachError(f"rank {rank} is outside 0..{world_size - 1}")
        self.n, self.rank, self.world_size, self.contiguous = n, rank, world_size, contiguous
        div, mod = divmod(n, world_size)
        if contiguous:
            self.start = div * rank + min(rank, mod)
            self.length = div + (1 if rank < mod else 0)
        else:
            self.start, self.length = rank, len(range(rank, n, world_size))

    def __call__(self, idx: Any) -> np.ndarray:
        idx = np.asarray(idx, np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.length):
            raise AttachError(f"node index {int(idx.max())} beyond node {self.rank}'s "
                              f"{self.length} rows")
        if self.contiguous:
            return self.start + idx
        return self.rank + self.world_size * idx


def mark(node: Any, n: int, rank: int, world_size: int, contiguous: bool = True) -> Any:
    """Mark `node` (datasets' shard `rank` of `world_size` of an `n`-row dataset) with its key
    mapping and the whole dataset's size, which torch_loader reads live and in replay."""
    keys = NodeKeys(n, rank, world_size, contiguous)
    if len(node) != keys.length:
        raise AttachError(f"the node's dataset has {len(node)} rows; shard {rank} of "
                          f"{world_size} of a {n}-row dataset has {keys.length} (give the "
                          "dataset that was split as full=, and the same rank / world_size)")
    node.tally_record_keys = keys
    node.tally_records_per_epoch = n
    return node


def split_dataset_by_node(dataset: Any, rank: int, world_size: int) -> Any:
    """datasets' `split_dataset_by_node`; a map-style node comes back marked (see `mark`)."""
    node = _hf_split(dataset, rank=rank, world_size=world_size)
    if isinstance(dataset, datasets.Dataset):
        mark(node, len(dataset), rank, world_size)
    return node


# ---- IterableDataset: the key carried by the example -----------------------------------------

class AuditedIterableLoader(SteppedLoader):
    """A DataLoader over a `datasets.IterableDataset` whose batches are recorded as the loop
    gets them: record keys from the batch's `key_field`. Everything else is the loader's."""

    def __init__(self, loader: Any, writer: Any, *, host: int, start_step: int = 0,
                 key_field: str = KEY_FIELD, key_of: Callable | None = None,
                 tokens_field: str | int | None = "input_ids",
                 mask_field: str | int | None = None, hashes: Any = None) -> None:
        self.loader, self.writer, self.host = loader, writer, host
        self.next_step = start_step
        self.key_field, self.key_of = key_field, key_of
        self.tokens_field, self.mask_field, self.hashes = tokens_field, mask_field, hashes

    def __iter__(self) -> Any:
        for batch in self.loader:
            self._record(batch)
            yield batch

    def _record(self, batch: Any) -> None:
        if not hasattr(batch, "keys") or self.key_field not in batch:
            raise AttachError(f"the batch has no {self.key_field!r} field: add the row index "
                              "to the map-style dataset before it becomes iterable (and before "
                              f"any shuffle): ds = ds.map(lambda _, i: {{{self.key_field!r}: i}}"
                              ", with_indices=True)")
        idx = np.asarray(batch[self.key_field], np.int64).reshape(-1)
        rows = leading_rows(batch)
        if rows is not None and rows != len(idx):
            raise AttachError(f"the batch has {rows} rows and {len(idx)} keys")
        step, self.next_step = self.next_step, self.next_step + 1
        epoch = getattr(self.loader.dataset, "epoch", -1)
        epoch = epoch if isinstance(epoch, int) else -1
        content = batch_content(batch, hashes=self.hashes, tokens_field=self.tokens_field,
                                mask_field=self.mask_field)
        record(self.writer, step, self.host, idx, content, epoch, self.key_of)

    def state_dict(self) -> dict[str, Any]:
        """The loader's state (a StatefulDataLoader's), else the dataset's; plus the next step.
        Taken between batches of a plain DataLoader it is exact only without workers."""
        if callable(getattr(self.loader, "state_dict", None)):
            state = dict(self.loader.state_dict())
        else:
            state = {"dataset": self.loader.dataset.state_dict()}
        state[STEP_KEY] = self.next_step
        return state


# ---- the one line ----------------------------------------------------------------------------

def audited(loader: Any, spool: Any, run_id: str | None = None, *, full: Any = None,
            rank: int | None = None, world_size: int | None = None, contiguous: bool = True,
            host: int | None = None, host_count: int | None = None, start_step: int = 0,
            key_of: Callable[[np.ndarray], np.ndarray] | None = None,
            key_field: str = KEY_FIELD, tokens_field: str | int | None = "input_ids",
            mask_field: str | int | None = None, hashes: Any = None,
            **options: Any) -> Any:
    """`loader` (a torch DataLoader or torchdata StatefulDataLoader over a `datasets.Dataset`
    or `datasets.IterableDataset`), recording every batch it hands out (see the module's doc).

    Map-style: `full`, `rank`, `world_size` (and `contiguous`) say how the loader's dataset was
    split from `full` (omit them for the whole dataset, or use this module's
    `split_dataset_by_node`); record key = the row's index in `full`, or `key_of(that index)`.
    Iterable: record key = the batch's `key_field`, or `key_of(it)`. `host` / `host_count`
    default to `rank` / `world_size`; the rest is torch_loader.audited's (a spool directory or a
    LedgerWriter, run_id, start_step, tokens_field, mask_field, hashes, writer options)."""
    from tally.audit.hook.writer import LedgerWriter

    dataset = getattr(loader, "dataset", None)
    host = rank if host is None else host
    host_count = world_size if host_count is None else host_count
    if isinstance(dataset, datasets.Dataset):
        if full is not None or rank is not None or world_size is not None:
            if full is None or rank is None or world_size is None:
                raise AttachError("a split dataset: give full= (the dataset that was split), "
                                  "rank= and world_size= together")
            mark(dataset, len(full), rank, world_size, contiguous)
        node_keys = getattr(dataset, "tally_record_keys", None)
        keys: Callable | None = node_keys
        if key_of is not None:
            keys = key_of if node_keys is None else (lambda i: key_of(node_keys(i)))
        if not isinstance(spool, LedgerWriter):
            options.setdefault("records_per_epoch",
                               getattr(dataset, "tally_records_per_epoch", len(dataset)))
        return torch_loader.audited(loader, spool, run_id, host=host, host_count=host_count,
                                    start_step=start_step, key_of=keys,
                                    tokens_field=tokens_field, mask_field=mask_field,
                                    hashes=hashes, **options)
    if not isinstance(dataset, datasets.IterableDataset):
        raise AttachError(f"expected a DataLoader over a datasets.Dataset or IterableDataset, "
                          f"got one over {type(dataset).__name__} (use "
                          "tally.pipeline.loaders.torch_loader for a torch Dataset)")
    writer = spool
    if isinstance(spool, LedgerWriter):
        host = spool.host if host is None else host
    else:
        distributed = getattr(dataset, "_distributed", None)
        if host is None and distributed is not None:
            host, host_count = distributed.rank, distributed.world_size
        if host is None or host_count is None:
            raise AttachError("give host= and host_count= (or rank= and world_size=, or a "
                              "LedgerWriter)")
        if run_id is None:
            raise AttachError("audited(loader, spool, run_id): a spool directory needs a run id")
    hashes = manifest_hashes(hashes)
    if not isinstance(spool, LedgerWriter):
        writer = LedgerWriter(Path(spool), run_id, host=host, host_count=host_count,
                              **spool_options(hashes, options, None))
    return AuditedIterableLoader(loader, writer, host=host, start_step=start_step,
                                 key_field=key_field, key_of=key_of, tokens_field=tokens_field,
                                 mask_field=mask_field, hashes=hashes)


# ---- replay and checks of a factory's loader -------------------------------------------------

def check_marked(dataset: Any, records: int) -> None:
    """AttachError for a map-style `dataset` whose sampler indices are not the manifest's
    `records` keys: not marked with its keys (`mark`) and not the whole dataset. A node of
    datasets' own split_dataset_by_node keeps no trace of its rows' place in the dataset that
    was split, so its indices 0.. would be read as the first records on every rank."""
    if getattr(dataset, "tally_record_keys", None) is None and len(dataset) != records:
        raise AttachError(f"the loader's datasets.Dataset has {len(dataset):,} rows, the "
                          f"manifest {records:,} records, and no keys of its rows (a node of "
                          "datasets' split_dataset_by_node?): build the node with "
                          "tally.pipeline.loaders.hf_datasets.split_dataset_by_node, or mark "
                          "it with hf_datasets.mark(node, len(full), rank, world_size)")


def check_iterable(loader: Any, key_field: str = KEY_FIELD) -> None:
    """AttachError unless `loader` is a torch DataLoader, not yet iterated, over a
    datasets.IterableDataset with a `key_field` column (where its columns are known)."""
    if not isinstance(loader, DataLoader):
        raise AttachError(f"expected a torch DataLoader (or torchdata's StatefulDataLoader), "
                          f"got {type(loader).__name__}")
    dataset = loader.dataset
    if not isinstance(dataset, datasets.IterableDataset):
        raise AttachError(f"expected a DataLoader over a datasets.IterableDataset, got one "
                          f"over {type(dataset).__name__}")
    if getattr(loader, "_iterator", None) is not None:
        raise AttachError("the factory's loader was iterated before it was returned")
    columns = dataset.column_names
    if columns is not None and key_field not in columns:
        raise AttachError(f"its IterableDataset has no {key_field!r} column (columns: "
                          f"{', '.join(columns)}): add the row index before the dataset "
                          f"becomes iterable and before any shuffle: ds = ds.map(lambda _, "
                          f"i: {{{key_field!r}: i}}, with_indices=True)")


def split_of(dataset: Any) -> tuple[int, int] | None:
    """(rank, world size) of a split IterableDataset (split_dataset_by_node), else None."""
    distributed = getattr(dataset, "_distributed", None)
    return None if distributed is None else (distributed.rank, distributed.world_size)


def check_restorable(dataset: Any, saved_world: int) -> None:
    """AttachError when a state saved on `saved_world` ranks is one datasets cannot restore
    on `dataset`'s world size: where the shards divide among the ranks (on either side), each
    rank reads whole shards of its own and its state counts those; else every rank reads
    every world-size-th example of the one stream, and the state is a place in that stream."""
    split = split_of(dataset)
    if split is None or split[1] == saved_world:
        return
    world, shards = split[1], dataset._ex_iterable.num_shards
    whole = [w for w in (saved_world, world) if shards % w == 0]
    if whole:
        raise AttachError(f"states saved on {saved_world} ranks, the loader's dataset is split "
                          f"over {world}: datasets gives each of {whole[0]} ranks whole "
                          f"shards of the {shards} (split_dataset_by_node) and its state counts "
                          "the rank's own, which it cannot restore on another world size")


def check_loadable(dataset: Any, saved_world: int) -> None:
    """AttachError when datasets cannot load a state saved on `saved_world` ranks into
    `dataset` at all: one world size divides the shards (each rank reads whole shards of its
    own, its state a place in them) and the other does not (each rank steps through the one
    stream, its state a place in it and a step count), so the two states differ in shape and
    datasets' load fails (KeyError). Where both or neither divide, datasets loads the state
    on another world size and reads from it what it reads: pre-flight plans that."""
    split = split_of(dataset)
    if split is None or split[1] == saved_world:
        return
    world, shards = split[1], dataset._ex_iterable.num_shards
    if (shards % saved_world == 0) == (shards % world == 0):
        return
    whole, stepped = (saved_world, world) if shards % saved_world == 0 else (world, saved_world)
    raise AttachError(f"states saved on {saved_world} ranks, the loader's dataset is split over "
                      f"{world}: of its {shards} shards datasets gives each of {whole} ranks "
                      f"whole shards but has each of {stepped} ranks step through the one "
                      "stream, and it cannot load a state of one into the other")


def key_only(loader: Any, key_field: str = KEY_FIELD) -> Any:
    """The factory's `loader` made to read `key_field` alone (see the module's doc)."""
    check_iterable(loader, key_field)
    dataset = loader.dataset
    keyed = dataset.select_columns([key_field])
    if dataset.epoch:
        keyed.set_epoch(dataset.epoch)
    object.__setattr__(loader, "dataset", keyed)  # DataLoader refuses a plain setattr
    loader.collate_fn = default_convert if loader.batch_size is None else default_collate
    return loader


def saved_epoch(state: Any) -> int | None:
    """The epoch of the first datasets IterableDataset state inside a loader's saved `state`
    (a worker's, the main process's, or a plain DataLoader's "dataset"), else None. datasets
    restores a state only into a dataset at that epoch."""
    if isinstance(state, dict):
        if "examples_iterable" in state and isinstance(state.get("epoch"), int):
            return state["epoch"]
        values = state.values()
    elif isinstance(state, list):
        values = state
    else:
        return None
    for value in values:
        epoch = saved_epoch(value)
        if epoch is not None:
            return epoch
    return None


def key_batches(loader: Any, steps: int, *, start_step: int = 0,
                state: dict[str, Any] | None = None, key_field: str = KEY_FIELD
                ) -> Iterator[tuple[int, np.ndarray, int]]:
    """(step, record keys, epoch) of the factory's loader's next `steps` batches, run over
    the key column (`key_only`), restored from `state` (an audited loader's `state_dict()`:
    its `tally_step` numbers the first batch, else `start_step`), pass after pass (the dataset
    set to its epoch + 1 at each new pass, as a training loop does; a state saved at its
    epoch's end restores an empty pass, and the next epoch follows)."""
    loader = key_only(loader, key_field)
    base = start_step
    restored = state is not None
    if state is not None:
        state = dict(state)
        saved_step = state.pop(STEP_KEY, None)
        base = base if saved_step is None else int(saved_step)
        epoch = saved_epoch(state)
        if epoch is not None and epoch != loader.dataset.epoch:
            loader.dataset.set_epoch(epoch)  # as the job sets it before iterating again
        restore(loader, state)
    done = 0
    while done < steps:
        epoch, drew = loader.dataset.epoch, False
        it = iter(loader)
        for _ in range(steps - done):
            try:
                batch = next(it)
            except StopIteration:
                break
            except Exception as exc:  # noqa: BLE001  (datasets' or a worker's, in one line)
                said = (str(exc).strip().splitlines() or [""])[-1]
                raise AttachError(f"the loader over the {key_field!r} column failed at step "
                                  f"{base + done}: {type(exc).__name__}: {said}") from None
            drew = True
            yield base + done, np.asarray(batch[key_field], np.int64).reshape(-1), epoch
            done += 1
        if not drew and not restored:
            return  # an empty pass: nothing more will come
        restored = False  # a state saved at its epoch's end: the job goes on to the next
        loader.dataset.set_epoch(epoch + 1)


def _states(spec: Any) -> tuple[int, dict[int, dict[str, Any]]] | None:
    """(n, each old host's saved state) from spec.states, found as torch's are."""
    if spec.states is None:
        return None
    return saved_states(spec.states)


def saved_states(states: Path) -> tuple[int, dict[int, dict[str, Any]]]:
    """(n, every old host's saved state by host) from `dataloader_<h>-of-<n>.json|.pt` in
    `states`, each holding a datasets IterableDataset state (torch_loader.saved_states)."""
    return torch_loader.saved_states(Path(states), check=_check_state)


def _check_state(state: Any) -> None:
    if saved_epoch(state) is None:
        raise ValueError("no datasets IterableDataset state in it")


def resume_step(state: dict[str, Any]) -> int | None:
    """The step of the next batch a loader restored from an audited `state` hands out (its
    `tally_step`), else None."""
    step = state.get(STEP_KEY)
    return None if step is None else int(step)


def planned_keys(make: Callable[[int, int], Any], hosts: int, steps: int, *,
                 states: tuple[int, dict[int, dict[str, Any]]] | None = None,
                 start_step: int = 0
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(record keys, step, rank, epoch) of every new rank's next `steps` batches: the loader
    `make(rank, hosts)` run over its key column (`key_batches`), restored from old rank
    rank % n's state of `states` ((n, states by rank), as the relaunched job's
    `load_state_dict` restores it), or fresh with its first batch numbered `start_step`. The
    real loader runs, workers, shuffle buffers and datasets' own restore included: its order
    is made as it runs."""
    def planned() -> Iterator[tuple[int, int, np.ndarray, int]]:
        for rank in range(hosts):
            loader = make(rank, hosts)
            state = None
            if states is not None:
                check_loadable(loader.dataset, states[0])
                state = states[1][rank % states[0]]
            for step, keys, epoch in key_batches(loader, steps, start_step=start_step,
                                                 state=state):
                yield rank, step, keys, epoch

    return plan_arrays(planned())


def replay_host(spec: Any, host: int, hashes: Any, loader: Any) -> Any:
    """Write host `host`'s replayed spool files for `spec` (tally.pipeline.replay.ReplaySpec)
    from the factory's DataLoader over an IterableDataset, restored from old host
    host % n's state; returns tally.pipeline.loaders.replayed.HostReplay."""
    from tally.pipeline.loaders.replayed import HostReplay, ReplayedHost, ReplayError

    t0 = time.perf_counter()
    try:
        old = _states(spec)
        state = None
        if old is not None:
            check_restorable(loader.dataset, old[0])
            state = old[1][host % old[0]]
        out = ReplayedHost(spec.spool, spec.run_id, host, spec.hosts,
                           records_per_epoch=len(hashes), resolve=manifest_resolve(hashes),
                           fsync=spec.fsync, fingerprint=hashes.fingerprint,
                           content_basis=hashes.content_basis)
        for item in key_batches(loader, spec.steps, start_step=spec.start_step, state=state):
            out.add(*item)
    except AttachError as exc:
        raise ReplayError(f"--loader {spec.loader} (host {host}): {exc}") from None
    out.flush()
    return HostReplay(host, out.rows, out.files, out.first, out.last, time.perf_counter() - t0)


def manifest_resolve(hashes: Any) -> Callable[[np.ndarray, np.ndarray], tuple]:
    """Record keys -> (keys, n_tokens, content hashes) from the manifest's hashes."""

    def resolve(keys: np.ndarray, _epochs: np.ndarray) -> tuple:
        content, n_tokens = hashes.lookup(keys)
        return keys, n_tokens, content

    return resolve


def check_replay(spec: Any, loader: Any) -> None:
    """What a replay of an IterableDataset refuses before it writes anything
    (tally.pipeline.replay.check): hashes read from the source (the replay reads the key column
    alone), a loader or dataset it cannot run over its key column, states it cannot restore."""
    from tally.pipeline.loaders.replayed import ReplayError

    if spec.hashes == "source":
        raise ReplayError(f"--loader {spec.loader}: an IterableDataset is replayed over its "
                          f"{KEY_FIELD!r} column alone: give the run's --manifest for the "
                          "content hashes, not --hashes source")
    try:
        check_iterable(loader)
        old = _states(spec)
        if old is not None:
            check_restorable(loader.dataset, old[0])
    except AttachError as exc:
        raise ReplayError(f"--loader {spec.loader}: {exc}") from None
