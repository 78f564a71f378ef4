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
`latest_worker_idx + 1` on. Restored on another world size, worker count or batch size (or from
a state marked `resume_mode: elastic`), litdata 0.2.76 resumes elastically
(`litdata.streaming.elastic`): the epoch's canonical stream (the saved topology's worker
streams in DDP lockstep, `_canonical_plans`) drops the state's global `sample_in_epoch`, rounded
down to a whole step of the new ranks (what the rounding drops is read again), and
`restripe_items` deals the rest to the new ranks' workers a batch at a time (with drop_last:
whole rounds only); batches come from worker 0 on. Each worker runs that in
`_setup_elastic_resume`; the audit runs the same method on a copy of the dataset per worker.

So the audit builds the dataset's shuffler with the dataset's own `_create_cache` /
`_create_shuffler`, calls those functions in the training process just before each pass starts
its workers, and pairs the k-th batch the loop gets with the k-th batch of that plan; a batch
whose row count is not the plan's stops the loop with AttachError. litdata's batches carry no
index (nothing in a sample says where it came from unless the data holds it), and the workers'
own iterators cannot be read without reading their shared chunk locks, so the plan is the
least intrusive way that never touches what the loop receives.

Not audited (AttachError, one line): a state litdata itself refuses (its
`_validate_state_dict`: another seed, shuffle, input dir, or drop_last — e.g. a 2-rank state,
drop_last forced there, on 1 rank), a Combined/ParallelStreamingDataset, a plain torch
DataLoader (its epochs and resume are not litdata's).

A litdata fault the audit shows as it happens: with DataLoader workers, a state saved after an
elastic resume loses `resume_mode` (litdata marks it in its workers' copies only), so resumed
again on the same topology litdata replays the new grid's standard order by the samples since
the restripe: records read twice and others never in that epoch (reconcile's duplicates,
pre-flight's `repeats` / `skips`).

Record key: the sample's global index in the optimized dataset (chunks in index.json order,
items in order), litdata's own index; `key_of(indices)` maps them otherwise. Epoch: litdata's
minus 1 (the spool's epochs count from 0). Step: counted from `start_step`; `state_dict()`
carries the next one (`tally_step`), so a restored loader continues steps. Content: the batch's
token tensor (`tokens_field`, [B, L]; `mask_field`) or a manifest's hashes (`hashes=PATH`).

Replay (`replay`): the same plan from a dataset built on the same directory and configuration
in one process without a cluster (the topology is given), from the beginning or from a saved
`state_dict()`, written as a spool marked replayed with the manifest's hashes. `tally replay
--loader MODULE:FUNCTION` and `tally preflight --loader` (kind "litdata") call the factory for
rank h of H under litdata's own env vars (WORLD_SIZE, GLOBAL_RANK) and restore new rank h from
old rank h % n's `litdata_<h>-of-<n>.json` in --states (see `saved_states`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

try:
    import litdata  # noqa: F401  (the user's dataset and loader come from it)
    import torch  # noqa: F401
except ModuleNotFoundError as _exc:  # one line naming the extra (tally.audit.extras: MODULE_EXTRA)
    raise ModuleNotFoundError(f"tally.pipeline.loaders.litdata_loader needs the litdata extra "
                              f"({_exc.name} is not installed): pip install 'tally-audit[litdata]'",
                              name=_exc.name) from None

from litdata.streaming.dataloader import StreamingDataLoader
from litdata.streaming.dataset import (
    StreamingDataset,
    _replay_chunks_sampling,
    _replay_sampling,
)
from litdata.streaming.elastic import topology_changed
from litdata.utilities.env import _DistributedEnv, _WorkerEnv

from tally.pipeline.loaders import (
    AttachError,
    PlannedLoader,
    SteppedLoader,
    manifest_hashes,
    plan_arrays,
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


def _worker_dataset(dataset: Any, env: Any, workers: int, worker: int, batch_size: int,
                    state: dict[str, Any]) -> Any:
    """A shallow copy of `dataset` as DataLoader worker `worker` of `workers` on `env` holds it
    when its `__iter__` resumes `state` (a copy: litdata's resume writes into the state), its
    state checked by litdata's own `_validate_state_dict` (ValueError where litdata refuses)."""
    shadow = copy.copy(dataset)
    shadow._state_dict = copy.deepcopy(state)
    shadow.distributed_env, shadow.worker_env = env, _WorkerEnv(workers, worker)
    shadow.batch_size = batch_size
    shadow.cache = shadow._create_cache(worker_env=shadow.worker_env)
    shadow.shuffler = shadow._create_shuffler(shadow.cache)
    shadow._shuffle_num_chunks = len(shadow.cache.get_chunk_intervals())
    shadow._validate_state_dict()
    shadow.current_epoch = int(shadow._state_dict["current_epoch"])
    return shadow


def elastic(state: dict[str, Any], env: Any, *, workers: int, batch_size: int) -> bool:
    """Whether a dataset restored from `state` on `env` with `workers` DataLoader workers takes
    litdata's elastic path (`StreamingDataset.__iter__`'s own test: another world size, worker
    count or batch size than the state's, or a state saved after an elastic resume)."""
    return state.get("resume_mode") == "elastic" or topology_changed(
        state, world_size=env.world_size, num_workers=max(1, int(workers)),
        batch_size=batch_size)


def worker_streams(dataset: Any, env: Any, *, workers: int, batch_size: int, epoch: int,
                   state: dict[str, Any] | None = None) -> list[list[int]]:
    """The sample indices each of rank `env.global_rank`'s `workers` DataLoader workers (0 or
    1: one) iterates in litdata epoch `epoch` (from 1), from where `state` (a dataset state
    that litdata restores) left them: on the state's topology by litdata's per-worker replay
    (`_replay_sampling`), on another by its elastic restripe of the canonical stream
    (`_setup_elastic_resume`, run on a copy of the dataset as each worker runs it)."""
    nw = max(1, int(workers))
    if state is not None:
        try:
            shadow = _worker_dataset(dataset, env, nw, 0, batch_size, state)
        except (ValueError, KeyError) as exc:  # litdata refuses the state (in its workers)
            raise AttachError(f"litdata refuses to resume this state: {exc}") from None
        if elastic(state, env, workers=nw, batch_size=batch_size):
            same = not topology_changed(state, world_size=env.world_size, num_workers=nw,
                                        batch_size=batch_size)
            out = []
            for w in range(nw):
                if w:
                    shadow = _worker_dataset(dataset, env, nw, w, batch_size, state)
                shadow._setup_elastic_resume(replay_workers=same)
                out.append([int(i) for items in shadow._elastic_item_lists for i in items])
            return out
        state = shadow._state_dict  # as litdata validated it (an override applied)
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
    planned by litdata's own functions (tally.pipeline.loaders.PlannedLoader)."""

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
            # Same topology: litdata's per-worker replay, handed out from the worker after the
            # saved one; another (elastic): the restripe, from worker 0 (load_state_dict's).
            state = ds._state_dict
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
    from tally.audit.hook.writer import LedgerWriter

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
    if world_size > 1 and dataset.distributed_env.world_size != world_size and \
            not dataset.drop_last:
        # A dataset made on another world than the run's: litdata's __init__ forces drop_last
        # on a world above 1 (an explicit drop_last=False there is not visible here: build the
        # dataset under the rank's WORLD_SIZE / GLOBAL_RANK, as `tally replay` does).
        dataset = copy.copy(dataset)
        dataset.drop_last = True
    nw, step, loader_epoch = max(1, int(workers)), start_step, 0
    resume: dict[str, Any] | None = None
    first = 0
    if state is not None:
        step = int(state.get(STEP_KEY, step))
        ds_state, loader_epoch = dict(state["dataset"]), int(state["current_epoch"])
        # As StreamingDataLoader.load_state_dict decides: litdata's elastic restripe always
        # resumes (from worker 0); a same-topology state only inside its epoch.
        if elastic(ds_state, env, workers=nw, batch_size=batch_size):
            resume, first = ds_state, 0
        else:
            shuffler = _shuffler(dataset, ds_state)
            length = shuffler.get_len(env, nw, batch_size, int(dataset.current_epoch))
            if 0 < int(state["num_samples_yielded"]) < length:
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
    tally.pipeline.loaders.replayed.HostReplay."""
    from tally.pipeline.loaders.replayed import HostReplay, ReplayedHost, ReplayError

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


# ---- `tally replay` and `tally preflight --loader`: a factory's StreamingDataLoader ---------

# A StreamingDataLoader's state_dict() is per rank but names no rank (the dataset's state, the
# loader's epoch, samples this rank yielded, the latest worker), so the ranks' states of one
# step are equal: a relaunch loads rank h % n's (any rank's) on new rank h. On the same world
# size litdata replays each worker's prefix; on another its elastic restripe reads the state's
# global `sample_in_epoch`. A run's checkpoint holds `litdata_<h>-of-<n>.json` per rank.
STATE_GLOB = "litdata_*-of-*.json"


def state_file(states: Path, host: int, hosts: int) -> Path:
    return Path(states) / f"litdata_{host}-of-{hosts}.json"


def saved_states(states: Path) -> tuple[int, dict[int, dict[str, Any]]]:
    """(n, every old rank's saved state by rank) from `litdata_<h>-of-<n>.json` in `states`,
    one n for all; AttachError naming what is wrong otherwise."""
    import json

    found = sorted(Path(states).glob(STATE_GLOB))
    counts = {p.stem.rsplit("-of-", 1)[-1] for p in found}
    if not found or len(counts) != 1 or not next(iter(counts)).isdigit():
        raise AttachError(f"--states {states}: expected each rank's StreamingDataLoader "
                          f"state_dict() as litdata_<h>-of-<n>.json for one rank count n, "
                          f"found {[p.name for p in found[:4]] or 'none'}")
    n, out = int(next(iter(counts))), {}
    for h in range(n):
        path = state_file(states, h, n)
        if not path.is_file():
            raise AttachError(f"--states {states}: no state for old rank {h} of {n} "
                              f"({path.name})")
        try:
            out[h] = json.loads(path.read_text())
            int(out[h]["current_epoch"]), int(out[h]["dataset"]["num_samples_yielded"])
        except Exception as exc:  # noqa: BLE001  (a file that is not a loader state)
            raise AttachError(f"{path}: not a litdata StreamingDataLoader state "
                              f"({type(exc).__name__}: {exc})") from None
    return n, out


def resume_step(state: dict[str, Any], path: Any = "the state") -> int:
    """The step a loader restored from `state` numbers its next batch: the audited loader's
    `tally_step` (a plain StreamingDataLoader's state does not know the run's step)."""
    if state.get(STEP_KEY) is None:
        raise AttachError(f"{path} has no {STEP_KEY}: save the audited loader's state_dict() "
                          "(it carries the step)")
    return int(state[STEP_KEY])


@contextlib.contextmanager
def rank_env(rank: int, world_size: int) -> Iterator[None]:
    """litdata's own topology env vars (WORLD_SIZE, GLOBAL_RANK; NNODES unset) while a factory
    builds rank `rank`'s loader in this process: its StreamingDataset detects the run's world
    there (and forces drop_last on a world above 1 as the run's did)."""
    names = ("WORLD_SIZE", "GLOBAL_RANK", "NNODES")
    old = {k: os.environ.pop(k, None) for k in names}
    os.environ.update({"WORLD_SIZE": str(world_size), "GLOBAL_RANK": str(rank)})
    try:
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def rank_loader(factory: str, rank: int, world_size: int) -> Any:
    """The factory's loader for rank `rank` of `world_size`, built as that rank builds it."""
    from tally.pipeline.replay import make_loader

    with rank_env(rank, world_size):
        loader = make_loader(factory, rank, world_size)
    check_loader(loader)
    return loader


def loader_shape(loader: Any) -> dict[str, Any]:
    """What of the loader decides its batches: workers, batch size, drop_last."""
    return {"workers": int(loader.num_workers), "batch_size": int(loader.batch_size),
            "drop_last": bool(loader.drop_last)}


def planned_keys(factory: str, *, hosts: int, steps: int,
                 states: dict[int, dict[str, Any]] | None = None, start_step: int = 0
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(sample indices, step, rank, epoch) of every rank's next `steps` batches on `hosts` ranks:
    rank h's loader from the factory, restored from old rank h % n's state of `states` (or
    fresh, its first batch numbered `start_step`)."""
    def planned() -> Iterator[tuple[int, int, np.ndarray]]:
        for h in range(hosts):
            loader = rank_loader(factory, h, hosts)
            st = states[h % len(states)] if states else None
            for step, ids, epoch in batches(loader.dataset, world_size=hosts, rank=h, steps=steps,
                                        state=st, start_step=start_step,
                                        **loader_shape(loader)):
                yield h, step, ids, epoch

    return plan_arrays(planned())


def check_replay(spec: Any, loader: Any) -> None:
    """What a litdata replay refuses before it writes anything (tally.pipeline.replay.check)."""
    from tally.pipeline.loaders.replayed import ReplayError

    try:
        check_loader(loader)
        if spec.states is not None:
            saved_states(spec.states)
    except AttachError as exc:
        raise ReplayError(f"--loader {spec.loader}: {exc}") from None
    if spec.hashes != "manifest":
        raise ReplayError("--hashes source: a litdata replay takes hashes from the manifest "
                          "(the samples are not read)")


def replay_spec_host(spec: Any, host: int, hashes: Any, _loader: Any = None) -> Any:
    """Rank `host`'s replayed spool for `spec` (tally.pipeline.replay.ReplaySpec): the factory's
    loader built as rank `host` of --hosts builds it, restored from old rank host % n's state
    in --states (litdata's elastic restripe where n is not --hosts) or from the beginning."""
    from tally.pipeline.loaders.replayed import ReplayError

    try:
        loader = rank_loader(spec.loader, host, spec.hosts)
        state = None
        if spec.states is not None:
            _, old = saved_states(spec.states)
            state = old[host % len(old)]
    except AttachError as exc:
        raise ReplayError(f"--loader {spec.loader} (host {host}): {exc}") from None
    return replay(loader.dataset, spec.spool, spec.run_id, host=host, world_size=spec.hosts,
                  steps=spec.steps, hashes=hashes, state=state, start_step=spec.start_step,
                  fsync=spec.fsync, **loader_shape(loader))


def epoch_remainder(n: int, loader: Any, hosts: int,
                    state: dict[str, Any] | None = None) -> int:
    """Records a correct litdata pass may leave out on `hosts` ranks: a fresh epoch's drop_last
    (N mod the rows of a step over the ranks, `_associate_chunks_and_intervals_to_workers`);
    an elastic resume's restripe with drop_last trims the rest of its epoch to whole batches of
    every worker of every rank (`restripe_items`): under one such round."""
    shape = loader_shape(loader)
    bs, nw = shape["batch_size"], max(1, shape["workers"])
    env = _DistributedEnv(world_size=hosts, global_rank=0, num_nodes=1)
    restripe = state is not None and elastic(state["dataset"], env, workers=nw, batch_size=bs)
    return n % (bs * hosts) + (hosts * nw * bs - 1 if restripe else 0)
