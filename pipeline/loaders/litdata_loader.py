"""Lightning's litdata: a `StreamingDataset` fed through its `StreamingDataLoader`, audited in
one line; replayed from the dataset's configuration and a saved `state_dict()`.

    ds = StreamingDataset(DIR, shuffle=True, seed=S)   # DIR: what litdata.optimize wrote
    loader = StreamingDataLoader(ds, batch_size=B, num_workers=W)
    loader = litdata_loader.audited(loader, "spool", "exp1")  # host/host_count: litdata's rank
    for batch in loader: ...                       # the same batches, same objects, same order

Which samples a rank reads is a function of the dataset's configuration, the topology litdata
detected and the epoch: `StreamingDataset.__init__` freezes `_DistributedEnv.detect()`
(torch.distributed's world when it is initialized, then the env vars WORLD_SIZE, GLOBAL_RANK
(not torchrun's RANK) and NNODES override it; neither: world size 1) and forces drop_last on a
world above 1. Each pass, a worker of rank r (DataLoader worker w of W, 0 workers: one) takes
entry r * W + w of the shuffler's `get_chunks_and_intervals_per_workers(env, W, B, epoch)`
(FullShuffle: chunks permuted by (seed, epoch), then split into item intervals per worker;
NoShuffle: in index.json order) and reads its intervals in turn, each in the order the
shuffler's `__call__(items, chunks, epoch, chunk)` gives. The epoch is the StreamingDataLoader's
(1 on the first pass, +1 each pass), or the loaded state's. Each worker batches its own stream
(its last batch partial); the loader hands the loop the workers' batches in turn from worker 0,
skipping a worker that has run out. A restored loader (`load_state_dict`, same world size,
workers and batch size) starts each worker where litdata's `_replay_sampling` /
`_replay_chunks_sampling` of `num_samples_yielded` put it, and hands out batches from worker
`latest_worker_idx + 1` on.

So the audit builds the dataset's shuffler with the dataset's own `_create_cache` /
`_create_shuffler`, calls those functions in the training process just before each pass starts
its workers, and pairs the k-th batch the loop gets with the k-th batch of that plan; a batch
whose row count is not the plan's stops the loop with AttachError. litdata's batches carry no
index (nothing in a sample says where it came from unless the data holds it), and the workers'
own iterators cannot be read without reading their shared chunk locks, so the plan is the
least intrusive way that never touches what the loop receives.

Not audited (AttachError, one line): a resume on another world size, worker count or batch
size (litdata's elastic restripe of its canonical stream), a Combined/ParallelStreamingDataset,
a plain torch DataLoader (its epochs and resume are not litdata's).

Record key: the sample's global index in the optimized dataset (chunks in index.json order,
items in order), litdata's own index; `key_of(indices)` maps them otherwise. Epoch: litdata's
minus 1 (the spool's epochs count from 0). Step: counted from `start_step`; `state_dict()`
carries the next one (`tally_step`), so a restored loader continues steps. Content: the batch's
token tensor (`tokens_field`, [B, L]; `mask_field`) or a manifest's hashes (`hashes=PATH`).

Replay (`replay`): the same plan from a dataset built on the same directory and configuration
in one process without a cluster (the topology is given), from the beginning or from a saved
`state_dict()`, written as a spool marked replayed with the manifest's hashes.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

try:
    import litdata  # noqa: F401  (the user's dataset and loader come from it)
    import torch  # noqa: F401
except ModuleNotFoundError as _exc:  # one line naming the extra (audit.extras: MODULE_EXTRA)
    raise ModuleNotFoundError(f"pipeline.loaders.litdata_loader needs the litdata extra "
                              f"({_exc.name} is not installed): pip install 'tally[litdata]'",
                              name=_exc.name) from None

from litdata.streaming.dataloader import StreamingDataLoader
from litdata.streaming.dataset import (
    StreamingDataset,
    _replay_chunks_sampling,
    _replay_sampling,
)
from litdata.streaming.elastic import topology_changed
from litdata.utilities.env import _DistributedEnv, _WorkerEnv

from pipeline.loaders import (
    AttachError,
    PlannedLoader,
    SteppedLoader,
    manifest_hashes,
    spool_options,
)

STEP_KEY = SteppedLoader.STEP_KEY


# ---- the plan: the sample indices of each batch a rank's loader hands out --------------------

def _shuffler(dataset: Any, state: dict[str, Any] | None) -> Any:
    """The shuffler the workers build (seed / drop_last from `state` when one is restored),
    made by the dataset's own methods on a shallow copy, so the user's object is not moved."""
    shadow = copy.copy(dataset)
    shadow._state_dict = state
    return shadow._create_shuffler(shadow._create_cache(worker_env=_WorkerEnv(1, 0)))


def samples(dataset: Any) -> int:
    """The samples of the optimized dataset (its subsample applied): the spool's epoch size."""
    cache = copy.copy(dataset)._create_cache(worker_env=_WorkerEnv(1, 0))
    return int(sum(i[2] - i[1] for i in cache.get_chunk_intervals()))


def worker_streams(dataset: Any, env: Any, *, workers: int, batch_size: int, epoch: int,
                   state: dict[str, Any] | None = None) -> list[list[int]]:
    """The sample indices each of rank `env.global_rank`'s `workers` DataLoader workers (0 or
    1: one) iterates in litdata epoch `epoch` (from 1), from where `state` (a dataset state
    that litdata restores: same topology) left them."""
    nw = max(1, int(workers))
    shuffler = _shuffler(dataset, state)
    n_chunks = len(shuffler.cache.get_chunk_intervals())
    chunks, intervals = shuffler.get_chunks_and_intervals_per_workers(env, nw, batch_size, epoch)
    first = env.global_rank * nw
    start = {w: 0 for w in range(nw)}
    skip = {w: 0 for w in range(nw)}
    if state is not None:
        skip = _replay_sampling(int(state["num_samples_yielded"]), int(state["batch_size"]), nw)
        start, skip = _replay_chunks_sampling(
            {w: intervals[first + w] for w in range(nw)}, skip)
    out = []
    for w in range(nw):
        items: list[int] = []
        for c in range(start[w], len(intervals[first + w])):
            iv = intervals[first + w][c]
            order = shuffler(np.arange(iv[1], iv[2]), n_chunks, epoch, int(chunks[first + w][c]))
            items.extend(int(i) for i in (order[skip[w]:] if c == start[w] else order))
        out.append(items)
    return out


def plan(dataset: Any, env: Any, *, workers: int, batch_size: int, epoch: int,
         state: dict[str, Any] | None = None, first_worker: int = 0,
         drop_last: bool = False) -> list[np.ndarray]:
    """The sample indices of each batch the loader hands out in this pass: each worker's
    stream batched by `batch_size` (partial last batch unless the loader's `drop_last`), the
    workers in turn from `first_worker`, skipping one that has run out."""
    per_worker = []
    for ids in worker_streams(dataset, env, workers=workers, batch_size=batch_size,
                              epoch=epoch, state=state):
        cut = [np.asarray(ids[c:c + batch_size], np.int64) for c in range(0, len(ids),
                                                                          batch_size)]
        if drop_last and cut and len(cut[-1]) < batch_size:
            cut.pop()
        per_worker.append(cut)
    nw = len(per_worker)
    order = [(first_worker + k) % nw for k in range(nw)]
    out: list[np.ndarray] = []
    for k in range(max((len(c) for c in per_worker), default=0)):
        for w in order:
            if k < len(per_worker[w]):
                out.append(per_worker[w][k])
    return out


def _restored(state: dict[str, Any], env: Any, workers: int, batch_size: int) -> None:
    if state.get("resume_mode") == "elastic" or topology_changed(
            state, world_size=env.world_size, num_workers=max(1, workers),
            batch_size=batch_size):
        raise AttachError(
            f"the loader resumes a state saved with world size {state.get('world_size')}, "
            f"{state.get('num_workers')} workers, batch size {state.get('batch_size')} on "
            f"world size {env.world_size}, {max(1, workers)} workers, batch size {batch_size} "
            "(litdata's elastic restripe): Tally audits a resume on the same topology only")


def check_loader(loader: Any) -> None:
    """AttachError for a loader whose batches cannot be paired with litdata's plan."""
    if not isinstance(loader, StreamingDataLoader):
        raise AttachError(f"expected litdata's StreamingDataLoader, got "
                          f"{type(loader).__name__} (its epochs and resume are litdata's)")
    if not isinstance(loader.dataset, StreamingDataset):
        raise AttachError(f"expected a StreamingDataLoader over a litdata StreamingDataset, "
                          f"got one over {type(loader.dataset).__name__}")
    if loader.num_workers > 0 and not getattr(loader, "in_order", True):
        raise AttachError("in_order=False: workers' batches come back in any order (use "
                          "in_order=True)")


# ---- the audited loader ----------------------------------------------------------------------

class AuditedLitdataLoader(PlannedLoader):
    """A StreamingDataLoader whose batches are recorded as the loop gets them, each pass
    planned by litdata's own functions (pipeline.loaders.PlannedLoader)."""

    PLAN = "litdata's plan"

    def __init__(self, loader: Any, writer: Any, **options: Any) -> None:
        check_loader(loader)
        super().__init__(loader, writer, **options)

    def _plan(self) -> tuple[int, list[np.ndarray]]:
        """What the loader's next pass hands out, read as its `__iter__` will decide it: a
        restored loader continues the loaded state, else a fresh epoch one past the loader's."""
        loader, ds = self.loader, self.loader.dataset
        env, nw, bs = ds.distributed_env, loader.num_workers, int(loader.batch_size)
        state, first, epoch = None, 0, loader.current_epoch + 1
        if loader.restore and ds._state_dict:
            state = ds._state_dict
            if ds._elastic_drop_first is not None:  # load_state_dict chose litdata's restripe
                state = {**state, "resume_mode": "elastic"}
            _restored(state, env, nw, bs)
            epoch, first = int(state["current_epoch"]), loader._latest_worker_idx % max(1, nw)
        return epoch, plan(ds, env, workers=nw, batch_size=bs, epoch=epoch, state=state,
                           first_worker=first, drop_last=bool(loader.drop_last))

    def spool_epoch(self, epoch: int) -> int:
        return epoch - 1  # litdata counts epochs from 1


def audited(loader: Any, spool: Any, run_id: str | None = None, *, host: int | None = None,
            host_count: int | None = None, start_step: int = 0,
            key_of: Callable[[np.ndarray], np.ndarray] | None = None,
            tokens_field: str | int | None = "input_ids", mask_field: str | int | None = None,
            hashes: Any = None, **writer_options: Any) -> AuditedLitdataLoader:
    """`loader` (litdata's StreamingDataLoader over a StreamingDataset), recording every batch
    it hands out (see the module's doc). Call it before iterating the loader.

    `spool`: a spool directory (a LedgerWriter is made: `run_id`, `host` / `host_count`
    (default: the rank / world size litdata detected), records_per_epoch = the dataset's
    samples, `writer_options` as LedgerWriter takes them) or a LedgerWriter already made.
    `key_of`: sample indices -> record keys (vectorised). `tokens_field` / `mask_field`: the
    batch's token tensor [B, L] and optional padding mask; `hashes`: a manifest path (or
    ManifestHashes) to take hashes from instead."""
    from audit.hook.writer import LedgerWriter

    check_loader(loader)
    env = loader.dataset.distributed_env
    hashes = manifest_hashes(hashes)
    writer = spool
    if isinstance(spool, LedgerWriter):
        host = spool.host if host is None else host
    else:
        host = env.global_rank if host is None else host
        host_count = env.world_size if host_count is None else host_count
        if run_id is None:
            raise AttachError("audited(loader, spool, run_id): a spool directory needs a run id")
        writer = LedgerWriter(Path(spool), run_id, host=host, host_count=host_count,
                              **spool_options(hashes, writer_options,
                                                samples(loader.dataset)))
    return AuditedLitdataLoader(loader, writer, host=host, start_step=start_step,
                                key_of=key_of, tokens_field=tokens_field,
                                mask_field=mask_field, hashes=hashes)


# ---- replay: the same plan, without a cluster and without reading samples ---------------------

def batches(dataset: Any, *, world_size: int, rank: int, workers: int, batch_size: int,
            steps: int, num_nodes: int = 1, drop_last: bool = False,
            state: dict[str, Any] | None = None, start_step: int = 0
            ) -> Iterator[tuple[int, np.ndarray, int]]:
    """(step, sample indices, epoch from 0) of rank `rank`'s next `steps` batches, pass after
    pass, from the beginning or from a saved `state_dict()` (a StreamingDataLoader's, with or
    without `tally_step`), on the topology given. `dataset`: a StreamingDataset on the same
    data and configuration as the run's, built in this process (its detected world unused)."""
    env = _DistributedEnv(world_size=world_size, global_rank=rank, num_nodes=num_nodes)
    nw, step, loader_epoch = max(1, int(workers)), start_step, 0
    resume: dict[str, Any] | None = None
    first = 0
    if state is not None:
        step = int(state.get(STEP_KEY, step))
        ds_state, loader_epoch = dict(state["dataset"]), int(state["current_epoch"])
        _restored(ds_state, env, workers, batch_size)
        shuffler = _shuffler(dataset, ds_state)
        length = shuffler.get_len(env, nw, batch_size, int(dataset.current_epoch))
        if 0 < int(state["num_samples_yielded"]) < length:  # as load_state_dict decides
            resume, first = ds_state, (int(state["latest_worker_idx"]) + 1) % nw
    done = 0
    while done < steps:
        if resume is not None:
            epoch = int(resume["current_epoch"])
        else:
            loader_epoch += 1
            epoch = loader_epoch
        todo = plan(dataset, env, workers=workers, batch_size=batch_size, epoch=epoch,
                    state=resume, first_worker=first, drop_last=drop_last)
        if not todo and resume is None:
            return  # an empty pass: nothing more will come
        resume, first = None, 0
        for ids in todo[:steps - done]:
            yield step, ids, epoch - 1
            step += 1
        done += min(len(todo), steps - done)


def replay(dataset: Any, spool: str | Path, run_id: str, *, host: int, world_size: int,
           workers: int, batch_size: int, steps: int, hashes: Any, num_nodes: int = 1,
           drop_last: bool = False, state: dict[str, Any] | None = None, start_step: int = 0,
           fsync: bool = True) -> Any:
    """Write host `host`'s (rank's) replayed spool files: `batches(...)`, hashed from the
    manifest `hashes`, marked replayed as `tally replay` marks them. Returns
    pipeline.loaders.replayed.HostReplay."""
    from pipeline.loaders.replayed import HostReplay, ReplayedHost, ReplayError

    t0 = time.perf_counter()
    if not isinstance(dataset, StreamingDataset):
        raise ReplayError(f"expected a litdata StreamingDataset, got {type(dataset).__name__}")
    hashes = manifest_hashes(hashes)

    def resolve(idx: np.ndarray, _epoch: np.ndarray):
        content, n_tokens = hashes.lookup(idx)
        return idx, n_tokens, content

    out = ReplayedHost(spool, run_id, host, world_size, records_per_epoch=samples(dataset),
                       resolve=resolve, fsync=fsync, fingerprint=hashes.fingerprint,
                       content_basis=getattr(hashes, "content_basis", "") or "")
    try:
        for item in batches(dataset, world_size=world_size, rank=host, workers=workers,
                            batch_size=batch_size, steps=steps, num_nodes=num_nodes,
                            drop_last=drop_last, state=state, start_step=start_step):
            out.add(*item)
    except AttachError as exc:
        raise ReplayError(str(exc)) from None
    out.flush()
    return HostReplay(host, out.rows, out.files, out.first, out.last, time.perf_counter() - t0)
