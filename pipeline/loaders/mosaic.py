"""MosaicML Streaming (`mosaicml-streaming`): a `StreamingDataset` fed through a torch DataLoader
(or streaming's `StreamingDataLoader`), audited in one line; replayed from a saved state.

    ds = StreamingDataset(local=DIR, batch_size=B, shuffle=True, num_canonical_nodes=N, ...)
    loader = StreamingDataLoader(ds, batch_size=B, num_workers=W)
    loader = mosaic.audited(loader, "spool", "exp1")     # host / host_count: the rank / world
    for batch in loader: ...                       # the same batches, same objects, same order

Which samples a rank reads is a function of the dataset's configuration and the topology:
each epoch, `StreamingDataset._get_work` asks `streaming.base.batching.generate_work(
batching_method, dataset, world, epoch, sample_in_epoch)` for an array [nodes, ranks per node,
workers per rank, batches per worker, batch size] of sample ids (-1: padding, skipped), from
streaming's partition (`num_canonical_nodes`, `partition_algo`, `initial_physical_nodes`) and
shuffle (`shuffle_algo`, `shuffle_seed`, `shuffle_block_size`, the epoch), and `(epoch,
sample_in_epoch)` come from `StreamingDataset._resume` (a state loaded by `load_state_dict`, or
the dataset's next epoch). Each DataLoader worker iterates its row in order and batches it by
the loader's batch size (its last batch partial unless drop_last); the loader hands the loop the
workers' batches in turn, skipping a worker that has run out. So the audit calls those same
functions of the user's dataset object (never a copy of them) in the training process, just
before each pass starts its workers (when no local rank's workers can yet have moved the shared
epoch counter on), and pairs the k-th batch the loop gets with the k-th batch of that plan; a
batch whose row count is not the plan's stops the loop with AttachError.

Record key: the sample id, the sample's index in the dataset's global sample space (streams,
then shards in index.json order, then samples): for one stream, Tally's MDS manifest key
(`tally manifest DIR`); `key_of(ids)` maps them otherwise. Epoch: streaming's. Step: counted
from `start_step`; `state_dict()` (a StreamingDataLoader's) carries the next one
(`tally_step`), so a restored loader continues steps. Content: the batch's token tensor
(`tokens_field`, [B, L]; `mask_field`) or a manifest's hashes (`hashes=PATH`).

Replay (`replay`): the same plan from a dataset built on the same directory without a cluster
(one process: the topology is given), from the beginning or from a saved `state_dict()`,
written as a spool marked replayed with the manifest's hashes.

Importing streaming: users have `import streaming` (the dataset object comes from it); this
module never imports it at import time, and `streaming_module` imports the submodules it calls
lazily, through the package when it imports, else (a `streaming/__init__.py` whose eager
`streaming.vision` import fails, e.g. a torchvision that does not load beside a CPU torch) with
the top package registered bare, so that only `streaming.base` and below run.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

try:
    import torch  # noqa: F401  (streaming's dataset is a torch IterableDataset)
except ModuleNotFoundError as _exc:  # one line naming the extra (tally.audit.extras: MODULE_EXTRA)
    raise ModuleNotFoundError(f"tally.pipeline.loaders.mosaic needs the torch extra "
                              f"({_exc.name} is not installed): pip install 'tally-audit[torch]'",
                              name=_exc.name) from None

from tally.pipeline.loaders import (
    AttachError,
    PlannedLoader,
    SteppedLoader,
    manifest_hashes,
    plan_arrays,
    spool_options,
)

STEP_KEY = SteppedLoader.STEP_KEY


# ---- streaming's own modules, imported lazily ------------------------------------------------

def _fill_bare_package(name: str) -> None:
    """Run the real `__init__.py` of a package module registered bare (a `__path__` and no
    `__file__`) in that same module object, so its names exist for the modules that import
    them; submodules already imported are reused."""
    mod = sys.modules.get(name)
    if mod is None or getattr(mod, "__file__", None) or not hasattr(mod, "__path__"):
        return
    init = Path(list(mod.__path__)[0]) / "__init__.py"
    if not init.is_file():
        return
    spec = importlib.util.spec_from_file_location(name, init,
                                                  submodule_search_locations=list(mod.__path__))
    if spec is None or spec.loader is None:
        return
    mod.__spec__, mod.__file__, mod.__loader__ = spec, str(init), spec.loader
    spec.loader.exec_module(mod)


def streaming_module(name: str) -> types.ModuleType:
    """streaming's module `name` (e.g. "streaming.base.batching"): through the package when
    `import streaming` works, else with only its top package registered bare (see the doc)."""
    if "streaming" not in sys.modules:
        try:
            importlib.import_module("streaming")
        except ModuleNotFoundError as exc:
            if exc.name == "streaming":
                raise ModuleNotFoundError("tally.pipeline.loaders.mosaic needs mosaicml-streaming "
                                          "(not installed; no extra of Tally's holds it yet "
                                          "but `test`): pip install mosaicml-streaming",
                                          name="streaming") from None
            sys.modules.pop("streaming", None)
        except Exception:  # noqa: BLE001  (the package's eager vision import failed)
            sys.modules.pop("streaming", None)
        if "streaming" not in sys.modules:
            spec = importlib.util.find_spec("streaming")
            bare = types.ModuleType("streaming")
            bare.__path__ = list(spec.submodule_search_locations)  # type: ignore[union-attr]
            sys.modules["streaming"] = bare
    # Below the top, a package registered bare by someone else is completed (deepest first).
    bare_below = [k for k, m in list(sys.modules.items()) if k.startswith("streaming.")
                  and m is not None and not getattr(m, "__file__", None)]
    for k in sorted(bare_below, key=lambda k: -k.count(".")):
        _fill_bare_package(k)
    return importlib.import_module(name)


def _is_streaming_dataset(obj: Any) -> bool:
    try:
        cls = streaming_module("streaming.base.dataset").StreamingDataset
    except Exception:  # noqa: BLE001
        return False
    return isinstance(obj, cls)


# ---- the plan: the sample ids of each batch a rank's loader hands out ------------------------

def plan(dataset: Any, *, epoch: int, sample_in_epoch: int, num_nodes: int,
         ranks_per_node: int, rank: int, workers: int, batch_size: int,
         drop_last: bool = False) -> list[np.ndarray]:
    """The sample ids of each batch rank `rank`'s loader (`workers` DataLoader workers, 0 or
    1: none) hands out in this epoch from `sample_in_epoch` on, as streaming partitions it:
    `generate_work` of the dataset's own configuration (num_canonical_nodes, shuffle,
    batch_size, ... must be set: `StreamingDataset._resume` sets them)."""
    world_cls = streaming_module("streaming.base.world").World
    generate_work = streaming_module("streaming.base.batching").generate_work
    workers = max(1, int(workers))
    world = world_cls(num_nodes=num_nodes, ranks_per_node=ranks_per_node,
                      workers_per_rank=workers, worker=rank * workers)
    work = generate_work(dataset.batching_method, dataset, world, epoch, sample_in_epoch)
    per_worker = []
    for w in range(workers):
        ids = np.asarray(work[world.node, world.rank_of_node, w], np.int64).reshape(-1)
        ids = ids[ids != -1]  # streaming's padding: never yielded
        cuts = list(range(0, len(ids), batch_size))
        chunks = [ids[c:c + batch_size] for c in cuts]
        if drop_last and chunks and len(chunks[-1]) < batch_size:
            chunks.pop()
        per_worker.append(chunks)
    out: list[np.ndarray] = []
    for k in range(max((len(c) for c in per_worker), default=0)):  # in turn, skipping ended
        out.extend(c[k] for c in per_worker if k < len(c))
    return out


def _rank_world(dataset: Any) -> Any:
    """The dataset's topology for iterating (its `replication` applied), as it detected it."""
    return dataset._parallel_rank_world


def resume_point(dataset: Any) -> tuple[int, int]:
    """(epoch, sample_in_epoch) the dataset's next pass starts at: streaming's `_resume` of
    the dataset (a loaded state, else its next epoch from 0), which also sets
    num_canonical_nodes / shuffle_block_size as the workers will."""
    world = _rank_world(dataset)
    return dataset._resume(world, dataset.next_epoch)


def _loader_workers(loader: Any) -> int:
    return max(1, int(getattr(loader, "num_workers", 0) or 0))


def check_loader(loader: Any) -> None:
    """AttachError for a loader whose batches cannot be paired with streaming's plan."""
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader):
        raise AttachError(f"expected a torch DataLoader or StreamingDataLoader, got "
                          f"{type(loader).__name__}")
    if not _is_streaming_dataset(loader.dataset):
        raise AttachError(f"expected a loader over a streaming StreamingDataset, got one over "
                          f"{type(loader.dataset).__name__}")
    if loader.batch_size is None:
        raise AttachError("batch_size=None: give the loader the dataset's batch_size")
    if not isinstance(loader.dataset.batch_size, int):
        raise AttachError("the StreamingDataset has no batch_size: streaming needs it to "
                          "partition (give it the loader's batch_size)")
    if loader.num_workers > 0 and not getattr(loader, "in_order", True):
        raise AttachError("in_order=False: workers' batches come back in any order (use "
                          "in_order=True)")


# ---- the audited loader ----------------------------------------------------------------------

class AuditedStreamingLoader(PlannedLoader):
    """A DataLoader over a StreamingDataset whose batches are recorded as the loop gets them,
    each pass planned by streaming's partition (tally.pipeline.loaders.PlannedLoader)."""

    PLAN = "streaming's partition"

    def __init__(self, loader: Any, writer: Any, **options: Any) -> None:
        check_loader(loader)
        super().__init__(loader, writer, **options)
        self.last_plan: tuple[int, int, list[np.ndarray]] | None = None  # epoch, sample, plan

    def _plan(self) -> tuple[int, list[np.ndarray]]:
        ds, loader = self.loader.dataset, self.loader
        epoch, sample_in_epoch = resume_point(ds)
        world = _rank_world(ds)
        batches = plan(ds, epoch=epoch, sample_in_epoch=sample_in_epoch,
                       num_nodes=world.num_nodes, ranks_per_node=world.ranks_per_node,
                       rank=world.rank, workers=_loader_workers(loader),
                       batch_size=int(loader.batch_size), drop_last=bool(loader.drop_last))
        self.last_plan = (epoch, sample_in_epoch, batches)
        return epoch, batches


def audited(loader: Any, spool: Any, run_id: str | None = None, *, host: int | None = None,
            host_count: int | None = None, start_step: int = 0,
            key_of: Callable[[np.ndarray], np.ndarray] | None = None,
            tokens_field: str | int | None = "input_ids", mask_field: str | int | None = None,
            hashes: Any = None, **writer_options: Any) -> AuditedStreamingLoader:
    """`loader` (a torch DataLoader or StreamingDataLoader over a StreamingDataset), recording
    every batch it hands out (see the module's doc). Call it before iterating the loader.

    `spool`: a spool directory (a LedgerWriter is made: `run_id`, `host` / `host_count`
    (default: the rank / world size streaming detected), records_per_epoch = the dataset's
    samples, `writer_options` as LedgerWriter takes them) or a LedgerWriter already made.
    `key_of`: sample ids -> record keys (vectorised). `tokens_field` / `mask_field`: the
    batch's token tensor [B, L] and optional padding mask; `hashes`: a manifest path (or
    ManifestHashes) to take hashes from instead."""
    from tally.audit.hook.writer import LedgerWriter

    check_loader(loader)
    world = streaming_module("streaming.base.world").World.detect()
    hashes = manifest_hashes(hashes)
    writer = spool
    if isinstance(spool, LedgerWriter):
        host = spool.host if host is None else host
    else:
        host = world.rank if host is None else host
        host_count = world.num_ranks if host_count is None else host_count
        if run_id is None:
            raise AttachError("audited(loader, spool, run_id): a spool directory needs a run id")
        writer = LedgerWriter(Path(spool), run_id, host=host, host_count=host_count,
                              **spool_options(hashes, writer_options,
                                                int(loader.dataset.num_samples)))
    return AuditedStreamingLoader(loader, writer, host=host, start_step=start_step,
                                  key_of=key_of, tokens_field=tokens_field,
                                  mask_field=mask_field, hashes=hashes)


# ---- replay: the same plan, without a cluster and without reading samples ---------------------

def batches(dataset: Any, *, num_nodes: int, ranks_per_node: int, rank: int, workers: int,
            batch_size: int, steps: int, drop_last: bool = False,
            state: dict[str, Any] | None = None, start_step: int = 0
            ) -> Iterator[tuple[int, np.ndarray, int]]:
    """(step, sample ids, epoch) of rank `rank`'s next `steps` batches, epoch after epoch, from
    the beginning or from a saved `state_dict()` (a StreamingDataLoader's, with or without
    `tally_step`), on the topology given. `dataset`: a StreamingDataset on the same data and
    configuration as the run's, built in this process (its own detected world is not used)."""
    step = start_step
    if state is not None:
        state = dict(state)
        if state.get(STEP_KEY) is not None:
            step = int(state.pop(STEP_KEY))
        dataset.load_state_dict(state)  # streaming's restore, read back by its _resume
        epoch = int(state["epoch"])
    else:
        epoch = int(dataset.next_epoch)
    world = streaming_module("streaming.base.world").World(
        num_nodes=num_nodes, ranks_per_node=ranks_per_node, workers_per_rank=1, worker=rank)
    done = 0
    while done < steps:
        epoch, sample_in_epoch = dataset._resume(world, epoch)
        todo = plan(dataset, epoch=epoch, sample_in_epoch=sample_in_epoch, num_nodes=num_nodes,
                    ranks_per_node=ranks_per_node, rank=rank, workers=workers,
                    batch_size=batch_size, drop_last=drop_last)
        if not todo and sample_in_epoch == 0:
            return  # an empty epoch: nothing more will come
        for ids in todo[:steps - done]:
            yield step, ids, epoch
            step += 1
        done += min(len(todo), steps - done)
        epoch += 1  # a stale loaded state: streaming starts the next epoch from 0


def replay(dataset: Any, spool: str | os.PathLike, run_id: str, *, host: int, num_nodes: int,
           ranks_per_node: int, workers: int, batch_size: int, steps: int, hashes: Any,
           drop_last: bool = False, state: dict[str, Any] | None = None, start_step: int = 0,
           fsync: bool = True) -> Any:
    """Write host `host`'s (rank's) replayed spool files: `batches(...)`, hashed from the
    manifest `hashes`, marked replayed as `tally replay` marks them. Returns
    tally.pipeline.loaders.replayed.HostReplay."""

    from tally.pipeline.loaders.replayed import HostReplay, ReplayedHost, ReplayError

    t0 = time.perf_counter()
    if not _is_streaming_dataset(dataset):
        raise ReplayError(f"expected a StreamingDataset, got {type(dataset).__name__}")
    hashes = manifest_hashes(hashes)
    hosts = num_nodes * ranks_per_node
    def resolve(idx: np.ndarray, _epoch: np.ndarray):
        content, n_tokens = hashes.lookup(idx)
        return idx, n_tokens, content

    out = ReplayedHost(spool, run_id, host, hosts, records_per_epoch=int(dataset.num_samples),
                       resolve=resolve, fsync=fsync, fingerprint=hashes.fingerprint,
                       content_basis=getattr(hashes, "content_basis", "") or "")
    for item in batches(dataset, num_nodes=num_nodes, ranks_per_node=ranks_per_node,
                        rank=host, workers=workers, batch_size=batch_size, steps=steps,
                        drop_last=drop_last, state=state, start_step=start_step):
        out.add(*item)
    out.flush()
    return HostReplay(host, out.rows, out.files, out.first, out.last, time.perf_counter() - t0)


# ---- `tally replay` and `tally preflight --loader`: a factory's Streaming loader ------------

# Streaming's state is global (every rank's StreamingDataLoader.state_dict() is the same: the
# epoch, the samples the whole job consumed in it, num_canonical_nodes, shuffle_seed,
# initial_physical_nodes), so a run's checkpoint holds one: `streaming.json` in --states.
STATE_FILE = "streaming.json"


def saved_state(states: Path) -> dict[str, Any]:
    """The loader state in `states`/streaming.json (a StreamingDataLoader's `state_dict()`, the
    audited one's carrying `tally_step`), or AttachError saying what is wrong."""
    import json

    path = Path(states) / STATE_FILE
    if not path.is_file():
        raise AttachError(f"no Streaming loader state at {path} (save any rank's "
                          "StreamingDataLoader.state_dict() there as JSON: it is global)")
    try:
        state = json.loads(path.read_text())
        int(state["epoch"]), int(state["sample_in_epoch"])
    except Exception as exc:  # noqa: BLE001
        raise AttachError(f"{path}: not a Streaming loader state ({type(exc).__name__}: "
                          f"{exc})") from None
    return state


def topology_of(hosts: int, ranks_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) of `hosts` ranks, `ranks_per_node` on each node."""
    if ranks_per_node < 1 or hosts % ranks_per_node:
        raise AttachError(f"--ranks-per-node {ranks_per_node} does not divide --hosts {hosts}")
    return hosts // ranks_per_node, ranks_per_node


def loader_shape(loader: Any) -> dict[str, Any]:
    """What of the loader decides its batches: workers, batch size, drop_last."""
    check_loader(loader)
    return {"workers": _loader_workers(loader), "batch_size": int(loader.batch_size),
            "drop_last": bool(loader.drop_last)}


def planned_keys(loader: Any, *, hosts: int, ranks_per_node: int, steps: int,
                 state: dict[str, Any] | None = None, start_step: int = 0
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(sample ids, step, rank, epoch) of every rank's next `steps` batches on `hosts` ranks,
    from the saved global `state` or fresh at `start_step`: streaming's own partition
    (`batches`) of the loader's dataset, one dataset for every rank (the partition is
    global)."""
    nodes, per_node = topology_of(hosts, ranks_per_node)
    shape = loader_shape(loader)

    def planned() -> Iterator[tuple[int, int, np.ndarray]]:
        for rank in range(hosts):
            for step, ids, epoch in batches(loader.dataset, num_nodes=nodes,
                                        ranks_per_node=per_node, rank=rank, steps=steps,
                                        state=state, start_step=start_step, **shape):
                yield rank, step, ids, epoch

    try:
        return plan_arrays(planned())
    except (ValueError, KeyError) as exc:  # streaming refuses the topology or the state
        raise AttachError(f"streaming cannot partition for {nodes} node(s) x {per_node} "
                          f"rank(s): {exc}") from None


def check_replay(spec: Any, loader: Any) -> None:
    """What a Streaming replay refuses before it writes anything (tally.pipeline.replay.check)."""
    from tally.pipeline.loaders.replayed import ReplayError

    try:
        check_loader(loader)
        topology_of(spec.hosts, spec.ranks_per_node)
        if spec.states is not None:
            saved_state(spec.states)
    except AttachError as exc:
        raise ReplayError(f"--loader {spec.loader}: {exc}") from None
    if spec.hashes != "manifest":
        raise ReplayError("--hashes source: a Streaming replay takes hashes from the manifest "
                          "(the samples are not read)")


def replay_spec_host(spec: Any, host: int, hashes: Any, loader: Any) -> Any:
    """Host (rank) `host`'s replayed spool for `spec` (tally.pipeline.replay.ReplaySpec) from the
    factory's Streaming loader: `replay` on --hosts ranks, --ranks-per-node a node."""
    nodes, per_node = topology_of(spec.hosts, spec.ranks_per_node)
    state = saved_state(spec.states) if spec.states is not None else None
    return replay(loader.dataset, spec.spool, spec.run_id, host=host, num_nodes=nodes,
                  ranks_per_node=per_node, steps=spec.steps, hashes=hashes, state=state,
                  start_step=spec.start_step, fsync=spec.fsync, **loader_shape(loader))
