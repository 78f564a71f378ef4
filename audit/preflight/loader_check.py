"""Pre-flight for a user's own loader: `tally preflight --loader MODULE:FUNCTION`.

The new topology's loaders come from the user's own factory, FUNCTION(host, host_count), as the
relaunched job would build them, started where it would start them: restored from the loader
states the run checkpointed (`--states`), or fresh with their first batch at `--at-step` (a
sampler resumed by its own start offset, MaxText's `initial_step`). Which planner reads the
plan follows from the loader the factory returns (`tally.pipeline.replay.loader_kind`), each from
the
tool's own contract exactly as replay reads it; nothing of the pipeline runs and no record is
read, so a plan of 64 hosts x 1,000 steps takes seconds:
- Grain: the index contract (`tally.pipeline.grain_attach`); states `process_<i>-of-<n>.json`, new
  host h taking old host h % n's (the transfer a job does when the host count changes). A
  dataset pipeline (MaxText's: mixture, mp_prefetch) by `DatasetContract.schedule`, its states
  the JSON of each iterator's `get_state()`, its keys by file through the manifest where its
  sources read files.
- torch DataLoader / torchdata StatefulDataLoader (any sampler): the batch sampler drawn alone
  (`tally.pipeline.loaders.torch_loader.index_batches`, torchdata's own restore of a saved state);
  states `dataloader_<i>-of-<n>.json|.pt`, new host h restoring old host h % n's as the job's
  `load_state_dict` would. A StatefulDistributedSampler's saved offset counts the old rank's
  own samples, so restored on another world size it repeats (fewer ranks) or skips (more).
  Over a Hugging Face map-style node (`hf_datasets.split_dataset_by_node`) the same, indices
  mapped to the rows' keys in the dataset that was split by the node's marks; a node without
  them (datasets' own split) is refused, its keys unknown.
- MosaicML Streaming: streaming's own partition (`tally.pipeline.loaders.mosaic.batches`) on the new
  ranks (`--ranks-per-node`), from the one global state `streaming.json` (streaming re-partitions
  a saved sample offset elastically, keeping num_canonical_nodes) or fresh at `--at-step`.
- litdata: litdata's own plan (`tally.pipeline.loaders.litdata_loader.batches`), new rank h built
  under litdata's env vars and restored from old rank h % n's `litdata_<i>-of-<n>.json` (the
  ranks' states are equal; on another topology litdata's elastic restripe), or fresh.
- OLMo-core: its own order (`tally.pipeline.loaders.olmo_core.planned_keys`) on the new dp ranks,
  rank r restoring the Trainer checkpoint's `train/rank<r>.pt` (else rank0.pt) as its
  Checkpointer does, at the state's global_step, or fresh at `--at-step`.
- Hugging Face IterableDataset: no arithmetic gives its order, so the factory's own loaders run
  over the key column (`tally.pipeline.loaders.hf_datasets.planned_keys`, workers included),
  new rank h restored from old rank h % n's `dataloader_<h>-of-<n>.json|.pt` by datasets' own
  restore; a state datasets cannot load on the new world size (one layout's on the other's:
  `hf_datasets.check_loadable`) is refused.
The planners differ; the check does not. Each says the epoch of each planned key where the
tool has passes (Grain: none), so that the check can find where the relaunch's epoch ends.

The checks need no epochs (a custom sampler need not say them): the run's effective exposures
before the step, from the ledger, plus the plan's, against the ideal of the DESIGN ("every
record seen floor(C/N) or ceil(C/N) times"). A correct continuation adds no exposure beyond
ceil(C/N) and, once the plan reaches the next multiple of N exposures, leaves no record below
floor(C/N); what the plan adds beyond the ledger's own distance from the ideal is what the
relaunch would do. A plan that stops short of the multiple (short last batches) goes on to the
end of its epoch on every host and is judged there, as an IterableDataset's always is (see
_plan_findings):
- `repeats`: exposures beyond ceil(C/N) the plan adds (records already seen as often as the
  ideal allows, planned again);
- `skips`: records the plan leaves below floor(C/N) when its horizon reaches a multiple of N;
- `planned_twice`: records planned more often than the horizon itself allows, on two hosts;
- `global_batch_changed`, `ledger_behind`, `horizon_short` as the keyed-loader check says them.
Where the run with the plan weights its domains (tally.audit.core.exposure.weighted_domains on
the exposures, with the manifest's domains), each domain is judged so against its own ideal,
its records renumbered 0..N_d - 1, and the findings name their domain (INFO domain_weighted).
What a correct loader also does is allowed and said as INFO: with W Grain worker streams a
host's reads at a step boundary are not a prefix of its order (each stream but one up to a batch
ahead; torch and Streaming hand batches over in the order drawn: no allowance), and a sampler
may drop N mod hosts or N mod global batch records an epoch. Not caught: a fault whose plan
stays within one epoch's unseen records until past the horizon (a twice sharded loader starting
at an epoch's start with a horizon short of the corpus): the finding `horizon_short` says the
check ended there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tally.audit.core.errors import TallyError
from tally.audit.core.exposure import effective_sql, start_sql
from tally.audit.ledger.database import Ledger, one
from tally.audit.preflight.verdict import PreflightVerdict
from tally.pipeline.replay import check_hf_keys, grain_dataset, loader_kind, make_loader

DEFAULT_MAX_HORIZON = 1000


def run_loader_preflight(ledger: Ledger | str | Path, run_id: str, manifest: str | Path,
                         loader: str, new_hosts: int, *, at_step: int | None = None,
                         states: str | Path | None = None, horizon: int | None = None,
                         ranks_per_node: int = 1) -> PreflightVerdict:
    """Plan the user's loaders on `new_hosts` and check the plan against the ledger
    (`ranks_per_node`: a Streaming loader's ranks a node)."""
    t0 = time.perf_counter()
    if new_hosts < 1:
        raise TallyError(f"--hosts must be at least 1, got {new_hosts}")
    if horizon is not None and horizon < 1:
        raise TallyError(f"--horizon must be at least 1 step, got {horizon}")
    if (states is None) == (at_step is None):
        raise TallyError("give the loader states the run checkpointed (--states DIR) or the "
                         "step the relaunched loaders start at (--at-step S), one of them")
    if states is not None and not Path(states).is_dir():
        raise TallyError(f"--states {states}: not a directory")
    from tally.pipeline.manifest_file import manifest_info

    n = int(manifest_info(manifest)["train_records"])
    relaunch = _Relaunch(run_id, n, loader, new_hosts, at_step, states, horizon, ranks_per_node,
                         Path(manifest))
    if isinstance(ledger, Ledger):
        return _check(ledger, relaunch, t0)
    if not Path(ledger).is_file():
        raise TallyError(f"no ledger at {ledger}")
    with Ledger(ledger, read_only=True) as opened:
        return _check(opened, relaunch, t0)


@dataclass
class _Plan:
    """A relaunch's plan, whichever tool's: its first step, its global batch, and each host's
    record keys for a horizon (`keys(steps)` -> keys, step of each, host of each, and the
    tool's epoch of each, or None where the tool does not say its passes); `slack` and
    `remainder` are what a correct loader of this kind may show (see _plan_findings)."""

    kind: str
    step: int
    batch: int
    keys: Any
    slack: int = 0
    remainder: int = 0
    # Judged at its epoch's end even where the plan reaches the next multiple of N first: a
    # loader whose epoch does not end on a whole global batch (an IterableDataset's last
    # batches are short, one a worker), so the multiple falls inside a step (see
    # _plan_findings).
    by_epoch: bool = False


def _planner(spec: str, new_hosts: int, at_step: int | None, states: Path | None, n: int,
             ranks_per_node: int, manifest: Path) -> _Plan:
    first = make_loader(spec, 0, new_hosts)
    kind = loader_kind(first)
    if ranks_per_node != 1 and kind != "streaming":
        raise TallyError(f"--ranks-per-node is for a Streaming loader; {spec} returns a {kind} "
                         "loader")
    from tally.pipeline.loaders import AttachError

    try:
        if kind == "torch":
            check_hf_keys(first, n)  # a Hugging Face node: its rows' keys must be known
            return _torch_plan(spec, new_hosts, at_step, states, n)
        if kind == "streaming":
            return _streaming_plan(first, new_hosts, at_step, states, ranks_per_node)
        if kind == "litdata":
            return _litdata_plan(spec, first, new_hosts, at_step, states, n)
        if kind == "olmo":
            return _olmo_plan(spec, first, new_hosts, at_step, states, n)
        if kind == "hf_iterable":
            return _hf_iterable_plan(spec, first, new_hosts, at_step, states)
        if grain_dataset(first):
            return _grain_dataset_plan(spec, first, new_hosts, at_step, states, manifest)
    except AttachError as exc:
        raise TallyError(f"--loader {spec}: {exc}") from None
    return _grain_plan(spec, first, new_hosts, at_step, states, n)


def _grain_plan(spec: str, first: Any, new_hosts: int, at_step: int | None,
                states: Path | None, n: int) -> _Plan:
    from tally.pipeline.grain_attach import SamplerKeys, contract_of
    from tally.pipeline.replay import batches

    loaders = [first] + [make_loader(spec, h, new_hosts) for h in range(1, new_hosts)]
    try:
        contracts = [contract_of(x) for x in loaders]
    except TallyError as exc:
        raise TallyError(f"--loader {spec}: {exc}") from None
    old: dict[int, dict] = {}
    if states is not None:
        old, at_step = _old_grain_states(states, spec)
    cursors, firsts = [], []
    for h, c in enumerate(contracts):
        st = old[h % len(old)] if old else None
        cur_h = c.cursor(st)
        cursors.append(cur_h)
        nxt = c.next_batch(cur_h)
        firsts.append(None if nxt is None else nxt[1])
    # The relaunch's step: --at-step, else the step the checkpointed loaders were at.
    step = int(at_step)
    new_batch = sum(c.batch_size for c in contracts)

    def keys(steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, None]:
        k, at, on = [], [], []
        for h, (x, c, cu) in enumerate(zip(loaders, contracts, cursors, strict=True)):
            idx, ordinal, _ = batches(c, cu, steps)
            k.append(SamplerKeys(x._sampler).keys(idx))
            at.append(ordinal - (firsts[h] or 0) + step)
            on.append(np.full(len(idx), h, np.int32))
        # Grain's index contract numbers records, not passes: no epochs.
        return np.concatenate(k), np.concatenate(at), np.concatenate(on), None

    # With W worker streams a host's reads at a step boundary are not a prefix of its order:
    # each stream but one may be up to a batch ahead, on the run's side and on the plan's
    # (assumed alike), so that many records may sit across an epoch's end in a correct run.
    slack = 2 * sum((c.streams - 1) * c.batch_size for c in contracts)
    # Samplers that drop an epoch's remainder leave up to N mod hosts (per-host blocks) or
    # N mod global batch records unread each epoch, by design.
    remainder = n % new_hosts + n % max(1, new_batch)
    return _Plan("grain", step, new_batch, keys, slack, remainder)


def _grain_dataset_plan(spec: str, first: Any, new_hosts: int, at_step: int | None,
                        states: Path | None, manifest: Path) -> _Plan:
    """A Grain dataset pipeline's plan (MaxText's: a mixture, mp_prefetch): the same
    `DatasetContract.schedule` as its live audit and replay, each new host from the start
    (fresh at --at-step) or restored from old host h % n's iterator state (the JSON of
    `get_state()`, `process_<i>-of-<n>.json` as Grain's checkpoint handler writes it)."""
    import itertools

    from tally.pipeline.grain_attach import dataset_contract, keyed_by_file, leaves
    from tally.pipeline.grain_attach import source_indices as element_keys
    from tally.pipeline.manifest_file import ManifestHashes

    pipelines = [first] + [make_loader(spec, h, new_hosts) for h in range(1, new_hosts)]
    contracts = [dataset_contract(x) for x in pipelines]
    old: dict[int, Any] = {}
    if states is not None:
        old = _old_dataset_states(states)
    cursors = [c.schedule(old[h % len(old)] if old else None) for h, c in enumerate(contracts)]
    heads = [next(cu, None) for cu in cursors]
    firsts = [hd[0] if hd is not None else None for hd in heads]
    known = [f for f in firsts if f is not None]
    step = int(at_step) if at_step is not None else min(known, default=0)
    # Sources that read files are keyed by file through the manifest, as the live attach did.
    hashes = ManifestHashes(manifest)
    by_file = keyed_by_file(hashes, leaves(contracts[0].elements))
    mapped = None if by_file is hashes else by_file
    taken: list[list[tuple[int, np.ndarray]]] = [[] if hd is None else [hd] for hd in heads]

    def keys(steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, None]:
        k, at, on = [], [], []
        for h, c in enumerate(contracts):
            while len(taken[h]) < steps:  # the horizon grows: go on where the plan stopped
                more = list(itertools.islice(cursors[h], steps - len(taken[h])))
                if not more:
                    break
                taken[h] += more
            for ordinal, idx in taken[h][:steps]:
                got, _ = element_keys(c.elements, idx)
                k.append(mapped.keys(got) if mapped is not None else got)
                at.append(np.full(len(idx), ordinal - (firsts[h] or 0) + step, np.int64))
                on.append(np.full(len(idx), h, np.int32))
        if not k:
            return (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32), None)
        return np.concatenate(k), np.concatenate(at), np.concatenate(on), None

    new_batch = sum(c.batch_size for c in contracts)
    slack = 2 * sum((max(1, c.workers) - 1) * c.batch_size for c in contracts)
    n = len(leaves(contracts[0].elements))
    return _Plan("grain_dataset", step, new_batch, keys, slack,
                 n % new_hosts + n % max(1, new_batch))


def _old_host_count(states: Path) -> int:
    """The old host count n of Grain's process_<i>-of-<n>.json files (one n for all)."""
    found = sorted(states.glob("process_*-of-*.json"))
    counts = {p.name.rsplit("-of-", 1)[1].removesuffix(".json") for p in found}
    if not found or len(counts) != 1 or not next(iter(counts)).isdigit():
        raise TallyError(f"--states {states}: expected Grain's process_<i>-of-<n>.json for "
                         f"one host count n, found {[p.name for p in found[:4]]}")
    return int(next(iter(counts)))


def _old_dataset_states(states: Path) -> dict[int, Any]:
    """Every old host's dataset iterator state (process_<i>-of-<n>.json), by host."""
    import json

    old = _old_host_count(states)
    out = {}
    for h in range(old):
        path = states / f"process_{h}-of-{old}.json"
        try:
            out[h] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise TallyError(f"{path}: not a loader state ({type(exc).__name__}: {exc})"
                             ) from None
    return out


def _old_grain_states(states: Path, spec: str) -> tuple[dict[int, dict], int]:
    """Every old host's state, by host (process_<i>-of-<n>.json, one n for all), and the step
    they resume at: the old loaders' next batch ordinal (the lowest, should hosts differ)."""
    from tally.pipeline.grain_attach import contract_of
    from tally.pipeline.replay import read_state

    old = _old_host_count(states)
    out, step = {}, None
    for h in range(old):
        loader = make_loader(spec, h, old)
        out[h] = read_state(states, h, old, loader)
        contract = contract_of(loader)
        nxt = contract.next_batch(contract.cursor(out[h]))
        if nxt is not None:
            step = nxt[1] if step is None else min(step, nxt[1])
    return out, step or 0


def _torch_plan(spec: str, new_hosts: int, at_step: int | None, states: Path | None,
                n: int) -> _Plan:
    """New host h's loader restored from old host h % n's saved state, as the relaunched job's
    `load_state_dict` restores it, or fresh with its first batch at --at-step."""
    from tally.pipeline.loaders import torch_loader as tl

    old: dict[int, dict] = {}
    if states is not None:
        _, old = tl.saved_states(states)
        # The relaunch's step: the step the checkpointed loaders were at (the lowest).
        at_step = min(tl.resume_step(st) for st in old.values())
    step = int(at_step)

    def keys(steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        k, at, on, ep = [], [], [], []
        for h in range(new_hosts):
            # Loaders made afresh for each plan: drawing moves a sampler on (its epoch, an
            # offset it was given), as the relaunched job's loaders start from their factory.
            x = make_loader(spec, h, new_hosts)
            st = old[h % len(old)] if old else None
            # A restored loader numbers its steps from its state; a fresh one from --at-step.
            kh, ah, eh = tl.planned_keys(x, steps, start_step=0 if old else step, state=st)
            k.append(kh)
            at.append(ah)
            on.append(np.full(len(kh), h, np.int32))
            ep.append(eh)
        return np.concatenate(k), np.concatenate(at), np.concatenate(on), np.concatenate(ep)

    batch = int(len(keys(1)[0]))  # the rows of the plan's first step
    remainder = n % new_hosts + n % max(1, batch)
    # The DataLoader hands batches over in the order its batch sampler drew them, workers or
    # not: no allowance for streams read ahead.
    return _Plan("torch", step, batch, keys, 0, remainder)


def _streaming_plan(loader: Any, new_hosts: int, at_step: int | None, states: Path | None,
                    ranks_per_node: int) -> _Plan:
    """Streaming's partition of the factory's dataset on the new ranks, from the one global
    saved state (its `tally_step` the relaunch's step) or fresh at --at-step."""
    from tally.pipeline.loaders import AttachError, mosaic

    # One dataset for every rank (the factory's for host 0): streaming's partition is global.
    state = None
    if states is not None:
        state = mosaic.saved_state(states)
        if state.get(mosaic.STEP_KEY) is None:
            raise AttachError(f"{Path(states) / mosaic.STATE_FILE} has no {mosaic.STEP_KEY}: "
                              "save the audited loader's state_dict() (it carries the step)")
        at_step = int(state[mosaic.STEP_KEY])
    step = int(at_step)
    shape = mosaic.loader_shape(loader)

    def keys(steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return mosaic.planned_keys(loader, hosts=new_hosts, ranks_per_node=ranks_per_node,
                                   steps=steps, state=state, start_step=step)

    # In order, as torch's DataLoader hands over its workers' batches: no allowance.
    return _Plan("streaming", step, shape["batch_size"] * new_hosts, keys)


def _olmo_plan(spec: str, first: Any, new_hosts: int, at_step: int | None,
               states: Path | None, n: int) -> _Plan:
    """OLMo-core's own order on the new dp ranks: rank r restored from the checkpoint's
    train/rank<r>.pt, else train/rank0.pt, as its Checkpointer restores it (the global tokens
    consumed, resumed at whole batches of the new global batch), or fresh from the epoch's
    start with its first batch at --at-step."""
    from tally.pipeline.loaders import AttachError
    from tally.pipeline.loaders import olmo_core as oc

    oc.factory_loader(first, 0, new_hosts)
    if states is not None:
        # The relaunch's step: the Trainer's global_step (or tally_step) the states were at.
        at = {oc.resume_step(oc.read_state(oc.state_file(states, h))) for h in range(new_hosts)}
        if None in at:
            raise AttachError(f"--states {states}: a data loader state without its step: give "
                              "the Trainer's checkpoint, or save the audited loader's "
                              "state_dict() (it carries tally_step)")
        at_step = min(at)
    step = int(at_step)

    def keys(steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return oc.planned_keys(lambda h, hosts: make_loader(spec, h, hosts), new_hosts, steps,
                               states=states, start_step=step)

    batch = int(first.global_batch_size // first.dataset.sequence_length)
    # Ranks take their columns of each global batch in order: no allowance for streams; an
    # epoch leaves out its last N mod global batch instances (OLMo-core's total_size).
    return _Plan("olmo", step, batch, keys, 0, n % max(1, batch))


def _litdata_plan(spec: str, first: Any, new_hosts: int, at_step: int | None,
                  states: Path | None, n: int) -> _Plan:
    """New rank h's StreamingDataLoader built by the factory under litdata's env vars for h of
    the new world, restored from old rank h % n's litdata_<h>-of-<n>.json (the ranks' states
    are equal; on another world size, worker count or batch size litdata's elastic restripe
    reads the state's global sample_in_epoch), or fresh with its first batch at --at-step."""
    from tally.pipeline.loaders import litdata_loader as ll

    ll.check_loader(first)
    old: dict[int, dict] = {}
    if states is not None:
        _, old = ll.saved_states(states)
        # The relaunch's step: the step the checkpointed loaders were at (the lowest).
        at_step = min(ll.resume_step(st, ll.state_file(states, h, len(old)))
                      for h, st in old.items())
    step = int(at_step)

    def keys(steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return ll.planned_keys(spec, hosts=new_hosts, steps=steps, states=old or None,
                               start_step=step)

    # The loader hands out its workers' batches in turn, in the order planned: no allowance
    # for streams.
    return _Plan("litdata", step, int(first.batch_size) * new_hosts, keys, 0,
                 ll.epoch_remainder(n, first, new_hosts, old.get(0)))


def _hf_iterable_plan(spec: str, first: Any, new_hosts: int, at_step: int | None,
                      states: Path | None) -> _Plan:
    """The factory's own loaders over a Hugging Face IterableDataset, run over the key column
    (`hf_datasets.planned_keys`): new rank h restored from old rank h % n's
    dataloader_<h>-of-<n>.json|.pt as the job's `load_state_dict` restores it (datasets
    reads from a state saved on another world size what it reads: a place in the rank's own
    shards, or in the one stream it steps through), or fresh at --at-step. No arithmetic
    gives this order (shards, shuffle buffers, the split and the workers make it as it runs),
    so the real loader runs; a state datasets cannot load at all is refused."""
    from tally.pipeline.loaders import AttachError
    from tally.pipeline.loaders import hf_datasets as hf

    hf.check_iterable(first)
    old = None
    if states is not None:
        old = hf.saved_states(states)
        at = {hf.resume_step(st) for st in old[1].values()}
        if None in at:
            raise AttachError(f"--states {states}: a loader state without its step "
                              f"({hf.STEP_KEY}): save the audited loader's state_dict() (it "
                              "carries the step)")
        at_step = min(at)  # the relaunch's step: the lowest the old ranks were at
        hf.check_loadable(first.dataset, old[0])
    step = int(at_step)

    def keys(steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return hf.planned_keys(lambda h, hosts: make_loader(spec, h, hosts), new_hosts, steps,
                               states=old, start_step=step)

    batch = max(1, int(first.batch_size or 1))
    # The shadow is the loader itself, its workers' batches in the order it hands them over:
    # no allowance for streams. Every example reaches one rank an epoch, unless drop_last
    # drops each worker's short last batch (fewer than a batch a worker).
    workers = max(1, int(first.num_workers))
    dropped = (batch - 1) * workers * new_hosts if first.drop_last else 0
    return _Plan("hf_iterable", step, batch * new_hosts, keys, 0, dropped, by_epoch=True)


@dataclass(frozen=True)
class _Relaunch:
    """What the check is asked: may `run_id` (`n` train records an epoch) go on with the
    loaders the factory `spec` makes on `new_hosts` hosts (`ranks_per_node` a node: Streaming),
    restored from `states` or fresh at `at_step`, planned for `horizon` steps (None: to the
    next multiple of N exposures, or on to the end of the epoch on every host, at most
    DEFAULT_MAX_HORIZON)?"""

    run_id: str
    n: int
    spec: str
    new_hosts: int
    at_step: int | None
    states: str | Path | None
    horizon: int | None
    ranks_per_node: int
    manifest: Path


def _check(ledger: Ledger, relaunch: _Relaunch, t0: float) -> PreflightVerdict:
    run_id, n, spec, new_hosts = relaunch.run_id, relaunch.n, relaunch.spec, relaunch.new_hosts
    at_step, states, horizon = relaunch.at_step, relaunch.states, relaunch.horizon
    ranks_per_node = relaunch.ranks_per_node
    cur = ledger.cursor()
    try:
        row = one(cur, "SELECT run FROM runs WHERE run_id = ?", [run_id])
        if row is None:
            raise TallyError(f"run {run_id!r} is not in ledger {ledger.path} (ingest its spool "
                             "first)")
        run = row[0]
        plan = _planner(spec, new_hosts, at_step, None if states is None else Path(states), n,
                        ranks_per_node, relaunch.manifest)
        step, new_batch = plan.step, plan.batch
        old_hosts, old_batch, last = _ledger_shape(cur, run, step)
        v = PreflightVerdict(run_id, "safe", numbers={
            "checkpoint_step": step, "old_hosts": old_hosts, "new_hosts": new_hosts,
            "old_global_batch": old_batch, "new_global_batch": new_batch,
            "records_per_epoch": n, "plan": "loader", "loader": spec,
            "loader_kind": plan.kind})
        add = v.findings.add
        if step > 0 and (last is None or last < step - 1):
            held = "nothing" if last is None else f"steps up to {last}"
            add("UNKNOWN", "ledger_behind",
                f"the relaunch starts at step {step}, but the ledger holds {held} of this run: "
                "ingest the spool first", ledger_last_step=last)
            return _done(v, t0)
        if old_batch is not None and old_batch != new_batch:
            add("FAIL", "global_batch_changed",
                f"the global batch would change from {old_batch} to {new_batch} rows at step "
                f"{step}: positions recomputed from a step no longer name the next records",
                before=old_batch, after=new_batch)
        counts = _consumed(cur, run, step, n)
    finally:
        cur.close()
    consumed = int(counts.sum())
    to_multiple = n - consumed % n if consumed % n else n
    steps = horizon or min(DEFAULT_MAX_HORIZON, -(-to_multiple // max(1, new_batch)))
    from tally.pipeline.loaders import AttachError

    try:
        k, s, hh, ep = plan.keys(steps)
        # Whole batches to the next multiple of N can stop short of the epoch's end: a
        # loader's last batches may be short (an IterableDataset's, one a worker). Where the
        # tool says its passes, the default horizon goes on until every host's epoch ends.
        grow = max(1, steps // 8)
        while (horizon is None and ep is not None and steps < DEFAULT_MAX_HORIZON
               and _epoch_of_plan(ep, hh, new_hosts) is None
               and (plan.by_epoch or not _reaches_multiple(consumed, consumed + len(k), n))):
            steps, grow, planned = min(DEFAULT_MAX_HORIZON, steps + grow), 2 * grow, len(k)
            k, s, hh, ep = plan.keys(steps)
            if len(k) == planned:
                break  # the loaders have nothing more to give
    except AttachError as exc:
        raise TallyError(f"--loader {spec}: {exc}") from None
    domains = _domains(relaunch.manifest, n)
    if domains is not None and len(k) and k.min() >= 0 and k.max() < n and _weighted(
            domains, counts, counts + np.bincount(k, minlength=n)):
        _domain_findings(v, domains, counts, (k, s, hh, ep), steps, plan)
    else:
        _plan_findings(v, counts, k, s, hh, n, steps, add, slack=plan.slack,
                       remainder=plan.remainder, epochs=ep, by_epoch=plan.by_epoch)
    return _done(v, t0)


def _domains(manifest: Path, n: int) -> tuple[np.ndarray, list[str]] | None:
    """Each train record's domain (a code into the names), or None for a corpus of one domain.
    A byte a record where the domains fit (the check already holds 8 bytes a record)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    names: dict[str, int] = {}
    parts = []
    pf = pq.ParquetFile(manifest, read_dictionary=["domain"])
    for batch in pf.iter_batches(columns=["domain", "split"], batch_size=1 << 20):
        train = pc.equal(batch["split"], "train").to_numpy(zero_copy_only=False)
        col = batch["domain"].filter(pa.array(train))
        if not isinstance(col.type, pa.DictionaryType):
            col = col.dictionary_encode()
        ids = np.array([names.setdefault(x, len(names)) for x in col.dictionary.to_pylist()],
                       np.int32)
        parts.append(ids[col.indices.to_numpy(zero_copy_only=False)] if len(ids) else
                     np.zeros(0, np.int32))
    if len(names) < 2:
        return None
    codes = np.concatenate(parts)[:n]
    return codes.astype(np.uint8 if len(names) < 256 else np.int32), list(names)


def _weighted(domains: tuple[np.ndarray, list[str]], before: np.ndarray,
              after: np.ndarray) -> bool:
    """Whether the run with the plan weights its domains (tally.audit.core.exposure's rule,
    on the exposures alone: the check has no epochs), and the run had already read them at
    different rates before the step: then each domain is judged by its own ideal, where the
    split's would call a mixture's upsampled domain repeated. A relaunch that reads one
    domain again where the run read all alike (a naive restore over domain-ordered records)
    is not a weight but the fault, and is judged by the split's."""
    from tally.audit.core import exposure

    codes, names = domains
    rates = [before[codes == d].sum() / max(1, int((codes == d).sum()))
             for d in range(len(names))]
    if min(rates) <= 0 or max(rates) < exposure.WEIGHT_RATIO * min(rates):
        return False
    levels = {name: np.bincount(after[codes == d]) for d, name in enumerate(names)}
    own = exposure.domain_distance(levels)
    split = exposure.excess(np.bincount(after), int(after.sum()), len(after))
    return exposure.weighted_domains((*split, 0), (sum(a for a, _ in own.values()),
                                                   sum(b for _, b in own.values()), 0), levels)


def _domain_findings(v: PreflightVerdict, domains: tuple[np.ndarray, list[str]],
                     counts: np.ndarray, planned: tuple, steps: int, plan: _Plan) -> None:
    """The plan judged domain by domain, each against its own ideal (its records renumbered
    0..N_d - 1): findings say their domain; repeats and skips add up."""
    codes, names = domains
    k, s, hh, ep = planned
    totals: dict[str, Any] = {"repeats": 0, "skipped": None, "duplicates": 0}
    reached, bad = True, []
    for d, name in enumerate(names):
        keys = np.flatnonzero(codes == d)
        at = codes[k] == d
        sub = PreflightVerdict(v.run_id, "safe", numbers=dict(v.numbers))
        _plan_findings(sub, counts[keys], np.searchsorted(keys, k[at]), s[at], hh[at],
                       len(keys), steps, sub.findings.add, slack=plan.slack,
                       remainder=plan.remainder, epochs=None if ep is None else ep[at],
                       by_epoch=plan.by_epoch)
        for f in sub.findings:
            v.findings.add(f.severity, f.code, f"domain {name}: {f.message}",
                           **{**f.numbers, "domain": name})
        for key in totals:
            if sub.numbers.get(key) is not None:
                totals[key] = (totals[key] or 0) + sub.numbers[key]
        reached = reached and sub.numbers["reached_multiple"]
        bad += [x for x in (sub.numbers.get("first_bad_step"),
                            sub.numbers.get("last_bad_step")) if x is not None]
        if d == 0:
            v.numbers.update({key: sub.numbers[key] for key in (
                "horizon_steps", "planned", "allowance_streams", "epoch_end_step")})
    v.numbers.update(totals, consumed_exposures=int(counts.sum()), planned=len(k),
                     by_domain=True, reached_multiple=reached,
                     first_bad_step=min(bad, default=None),
                     last_bad_step=max(bad, default=None))
    v.findings.add("INFO", "domain_weighted",
                   f"the run weights its domains ({len(names)}): each is checked against its "
                   "own ideal, as the reconcile measures such a run")


def _reaches_multiple(c0: int, c1: int, n: int) -> bool:
    """Do exposures going from c0 to c1 reach the next multiple of the corpus (n)?"""
    return c1 // n > c0 // n or (c0 % n == 0 and c1 > c0 and c1 % n == 0)


def _epoch_of_plan(epochs: np.ndarray | None, hosts: np.ndarray, new_hosts: int
                   ) -> int | None:
    """The epoch the relaunch is in (the plan's first), if every host's plan goes past its
    end (a batch of a later epoch, or none at all: a loader with nothing to give), else None
    (the tool says no passes, or the plan stops inside the epoch on some host)."""
    if epochs is None or not len(epochs):
        return None
    first = int(epochs.min())
    later = np.zeros(new_hosts, bool)
    later[np.unique(hosts[epochs > first])] = True
    later[np.setdiff1d(np.arange(new_hosts), hosts)] = True
    return first if later.all() else None


# A correct loader's last batches of an epoch may be short (drop_last=False; an
# IterableDataset's, one a worker and rank): the run's global batch is the largest step among
# the last few, on the last step's hosts, not the last step's rows.
SHAPE_STEPS = 16


def _ledger_shape(cur: Any, run: int, step: int) -> tuple[int | None, int | None, int | None]:
    """(hosts, rows per step, last step) of the surviving lineage just before `step`: the rows
    the largest of its last SHAPE_STEPS steps held on the last step's host count."""
    rows = cur.execute(f"""
        SELECT h.step, count(DISTINCT h.host), sum(h.exposures) FROM agg_steps h JOIN attempts a
            USING (run, attempt)
        WHERE h.run = ? AND {effective_sql("h", "a")} AND h.step < ?
        GROUP BY h.step ORDER BY h.step DESC LIMIT ?""", [run, step, SHAPE_STEPS]).fetchall()
    if not rows:
        return None, None, None
    last, hosts, _ = rows[0]
    starts = max(int(r[2]) for r in rows if r[1] == hosts)
    return int(hosts), starts, int(last)


def _consumed(cur: Any, run: int, step: int, n: int) -> np.ndarray:
    """Effective exposures per train record before `step`."""
    got = cur.execute(
        f"SELECT record_key, count(*)::BIGINT AS c FROM effective_consumption "
        f"WHERE run = ? AND step < ? AND {start_sql()} AND record_key < ? GROUP BY record_key",
        [run, step, n]).fetchnumpy()
    counts = np.zeros(n, np.int64)
    counts[np.asarray(got["record_key"], np.int64)] = np.asarray(got["c"], np.int64)
    return counts


def _plan_findings(v: PreflightVerdict, before: np.ndarray, keys: np.ndarray,
                   steps_at: np.ndarray, hosts: np.ndarray, n: int, horizon: int, add, *,
                   slack: int = 0, remainder: int = 0,
                   epochs: np.ndarray | None = None, by_epoch: bool = False) -> None:
    """The plan's findings. Counts within what a correct loader does (`slack`: worker streams'
    reads across a step boundary; `remainder`: records an epoch drops by design, per epoch
    the plan crosses) are said as INFO with the reason, beyond it as FAIL.

    Where the plan is judged: where it reaches the next multiple of N exposures (a correct
    epoch reads at most N, so a plan that gets there inside its epoch repeats anyway), or,
    where the tool says its passes (`epochs`) and every host's plan gets past the end of the
    epoch it is in, at that end when the plan does not reach the multiple, or always for a
    plan `by_epoch`: a record is skipped only if the epoch ends without it (short last
    batches, a host a batch behind the others, are the epoch's own), and what later epochs
    plan is not this one's."""
    num = v.numbers
    outside = (keys < 0) | (keys >= n)
    if outside.any():
        add("UNKNOWN", "unknown_keys",
            f"the loaders plan {int(outside.sum()):,} record keys outside the manifest's "
            f"0..{n - 1}: is it this run's corpus?", records=int(outside.sum()))
        return
    planned = np.bincount(keys, minlength=n)
    after = before + planned
    c0, c1 = int(before.sum()), int(after.sum())
    bad_steps: list[np.ndarray] = []

    def beyond(counts: np.ndarray, c: int) -> tuple[int, int]:
        hi, lo = -(-c // n), c // n
        return int(np.maximum(counts - hi, 0).sum()), int(np.maximum(lo - counts, 0).sum())

    def judge(code: str, amount: int, allowed: int, why: str, message: str, **numbers) -> None:
        if amount <= allowed:
            add("INFO", f"{code}_within_allowance",
                f"{message} — within the {allowed:,} a correct loader may show ({why})",
                **numbers)
        else:
            add("FAIL", code, message, **numbers)

    excess0, _ = beyond(before, c0)
    epoch = None
    if by_epoch or not _reaches_multiple(c0, c1, n):
        epoch = _epoch_of_plan(epochs, hosts, int(num.get("new_hosts") or 0))
    if epoch is None:
        judged = np.ones(len(keys), bool)
        hi, lo1, decided = -(-c1 // n), c1 // n, _reaches_multiple(c0, c1, n)
    else:
        # The epoch's target: one read more than the epochs the ledger completed, unless the
        # ledger stands at a multiple and the epoch planned nothing (a state saved at its
        # epoch's end).
        judged = epochs == epoch
        hi = lo1 = c0 // n + (1 if c0 % n or judged.any() else 0)
        decided = True
    after_judged = before + np.bincount(keys[judged], minlength=n)
    c_judged = int(after_judged.sum())
    num.update(horizon_steps=horizon, planned=len(keys), consumed_exposures=c0,
               reached_multiple=_reaches_multiple(c0, c1, n), allowance_streams=slack,
               epoch_end_step=None if epoch is None or not judged.any()
               else int(steps_at[judged].max()))
    streams_why = "worker streams read up to a batch ahead of each other"

    # Records planned more often than the epochs the plan touches allow, by two hosts or more.
    cap = -(-(c0 % n + len(keys)) // n)
    twice = planned > cap
    num["duplicates"] = int(twice.sum())
    if twice.any():
        on = np.zeros(n, np.int64)
        lo = np.full(n, np.iinfo(np.int32).max)
        np.minimum.at(lo, keys, hosts)
        np.maximum.at(on, keys, hosts)
        cross = int((twice & (lo != on)).sum())
        where = np.isin(keys, np.flatnonzero(twice))
        if int(twice.sum()) > slack:
            bad_steps.append(steps_at[where])
        judge("planned_twice", int(twice.sum()), slack, streams_why,
              f"{int(twice.sum()):,} records are planned more often than {horizon} steps allow "
              f"({cross:,} of them on two or more hosts): the hosts' loaders do not read "
              "disjoint shares (sharded twice, per-host seeds, no sharding?)",
              records=int(twice.sum()), on_several_hosts=cross)

    added = max(0, int(np.maximum(after_judged - hi, 0).sum()) - excess0)
    num["repeats"] = added
    if added:
        again = np.flatnonzero(after_judged > hi)
        mask = np.isin(keys, again) & judged & (before[keys] > 0)
        if mask.any() and added > slack:
            bad_steps.append(steps_at[mask])
        judge("repeats", added, slack, streams_why,
              f"would add {added:,} exposures beyond the ideal ({hi} per record after "
              f"{c_judged:,} exposures of {n:,} records): records the run already saw as "
              "often as it should, planned again",
              exposures=added, records=int(len(again)))
    num["skipped"] = None
    if decided:
        # Only what the plan adds: a record already behind before the step (an earlier fault,
        # or a remainder dropped before) counts when the plan leaves it further behind.
        lo0 = c0 // n
        grown = np.maximum(lo1 - after_judged, 0) - np.maximum(lo0 - before, 0)
        skipped = int(np.maximum(grown, 0).sum())
        records = int((grown > 0).sum())
        num["skipped"] = skipped
        if skipped:
            end = num["epoch_end_step"]
            if end is None:
                end = int(steps_at.max()) if len(steps_at) else num["checkpoint_step"]
            allowed = slack + remainder * (lo1 - lo0)
            if skipped > allowed:
                bad_steps.append(np.array([num["checkpoint_step"], end]))
            where = (f"when its epoch ends, at step {end}" if epoch is not None else
                     f"when the plan reaches {c1:,} exposures by step {end}")
            judge("skips", skipped, allowed,
                  f"{streams_why}; an epoch may drop N mod hosts + N mod global batch = "
                  f"{remainder:,}",
                  f"would leave {records:,} records below {lo1} exposure(s) {where}: skipped",
                  records=records, exposures=skipped)
    else:
        add("INFO", "horizon_short",
            f"the {horizon}-step horizon ends before the next multiple of the corpus "
            f"({n:,} records): records skipped later are not checked")
    if bad_steps:
        allbad = np.concatenate(bad_steps)
        num["first_bad_step"], num["last_bad_step"] = int(allbad.min()), int(allbad.max())
    else:
        num["first_bad_step"] = num["last_bad_step"] = None


def _done(v: PreflightVerdict, t0: float) -> PreflightVerdict:
    sev = v.findings.severities()
    v.status = "unsafe" if "FAIL" in sev else "unknown" if "UNKNOWN" in sev else "safe"
    v.numbers["seconds"] = round(time.perf_counter() - t0, 3)
    return v


__all__ = ["run_loader_preflight"]
