"""Replay: the spool a run consumed, written from the loader's contract without running it.

`tally replay --loader MODULE:FUNCTION --hosts H --steps N --spool DIR --run RUN --manifest M`
calls FUNCTION(host, H) for each host (MODULE importable from the working directory or
PYTHONPATH, as `uvicorn module:app` finds its app), reads each loader's index contract
(`tally.pipeline.grain_attach.contract_of`), and writes every host's record keys for N steps as
spool
files, with content hashes from the manifest (or read from the data source with
`hashes="source"`). Where each host starts: at the loader's beginning, at the loader states a
run checkpointed (Grain's `process_<h>-of-<H>.json`, one per host, checked as Grain checks them:
the sampler's and the data source's repr), and `start_step` numbers the first step (a sampler
resumed by its own start offset).

Nothing of the loader's pipeline runs: positions are arithmetic, record keys come from the
sampler (vectorised for Grain's samplers where they allow it, one `sampler[i]` a record
otherwise), so a replay of 64 hosts takes seconds to minutes where the run took weeks. Hosts are
independent and run in worker processes (spawned) when the replay is large.

What replay cannot prove: it says what the loader's contract *would* have fed, not what the run
consumed. A restore that misbehaves inside the run (a state loaded into the wrong host, a
checkpoint from another step), an operation that drops records at run time, or a corpus changed
under the run only show in a live audit. Replayed files say so in their metadata
(`tally.replayed = 1`, writer_version `tally-replay/1`: tally.audit.hook.spool holds the rule), and
every answer about the run names it replayed (docs/DESIGN.md, "Replay").
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from tally.audit.core.errors import TallyError
from tally.audit.core.schema import MAX_STEP, SEGMENT_SCHEMA
from tally.audit.hook import spool as sp
from tally.audit.hook.writer import publish

# Grain (tally.pipeline.grain_attach imports it) only for a Grain loader: a torch or Streaming
# factory's replay and pre-flight run without it (tally.audit.extras).
if TYPE_CHECKING:
    from tally.pipeline.grain_attach import Contract, Cursor
    from tally.pipeline.manifest_file import ManifestHashes

# Rows a replayed file holds, the writer_version it says, what a host's replay did and the
# error that stops one: one home for every replay, Grain's and the PyTorch side's.
from tally.pipeline.loaders.replayed import (
    ROWS_PER_FILE,
    WRITER_VERSION,
    HostReplay,
    ReplayedHost,
    ReplayError,
)


@dataclass(frozen=True)
class ReplaySpec:
    loader: str  # MODULE:FUNCTION
    hosts: int
    steps: int
    spool: Path
    run_id: str
    manifest: Path | None = None
    hashes: str = "manifest"  # or "source": read every record back from the data source
    start_step: int = 0
    states: Path | None = None  # a directory of the loader's saved states (loader_kind's)
    fsync: bool = True
    ranks_per_node: int = 1  # Streaming's topology: --hosts ranks, this many a node



def load_factory(spec: str) -> Any:
    """FUNCTION of MODULE:FUNCTION, importable from the working directory or PYTHONPATH."""
    module, sep, func = spec.partition(":")
    if not sep or not module or not func:
        raise ReplayError(f"--loader {spec!r}: expected MODULE:FUNCTION (e.g. "
                          "my_job.data:make_loader)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        raise ReplayError(f"--loader {spec!r}: cannot import {module!r}: "
                          f"{type(exc).__name__}: {exc}") from None
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise ReplayError(f"--loader {spec!r}: module {module!r} has no function {func!r}")
    return fn


def make_loader(spec: str, host: int, hosts: int) -> Any:
    try:
        return load_factory(spec)(host, hosts)
    except TallyError:
        raise
    except Exception as exc:
        raise ReplayError(f"--loader {spec}: calling it for host {host} of {hosts} failed: "
                          f"{type(exc).__name__}: {exc}") from None


def state_path(states: Path, host: int, hosts: int) -> Path:
    return states / f"process_{host}-of-{hosts}.json"


def read_state(states: Path, host: int, hosts: int, loader: Any) -> dict[str, Any]:
    """Host `host`'s checkpointed loader state, checked against `loader` as Grain checks it."""
    from grain._src.python.data_loader import _source_repr

    from tally.pipeline.grain_attach import AttachError, contract_of

    path = state_path(states, host, hosts)
    if not path.is_file():
        have = sorted(p.name for p in states.glob("process_*-of-*.json"))[:4] \
            if states.is_dir() else []
        raise ReplayError(f"no loader state for host {host} of {hosts} at {path}"
                          + (f" (found {', '.join(have)})" if have else ""))
    try:
        state = json.loads(path.read_text())
        seen, workers = state["last_seen_indices"], int(state["worker_count"])
        int(state["last_worker_index"])
    except Exception as exc:
        raise ReplayError(f"{path}: not a Grain DataLoader state ({type(exc).__name__}: "
                          f"{exc})") from None
    if not isinstance(seen, dict):
        raise ReplayError(f"{path}: last_seen_indices is not a mapping")
    try:
        contract_of(loader).cursor(state)
    except AttachError as exc:
        raise ReplayError(f"{path}: {exc}") from None
    if "sampler" in state and state["sampler"] != repr(loader._sampler):
        raise ReplayError(f"{path}: saved for sampler {state['sampler']}, the loader's is "
                          f"{loader._sampler!r} (Grain would refuse this state too)")
    if "data_source" in state and state["data_source"] != _source_repr(loader._data_source):
        raise ReplayError(f"{path}: saved for data source {state['data_source']}, the "
                          f"loader's is {_source_repr(loader._data_source)} (Grain would "
                          "refuse this state too)")
    if workers != loader.multiprocessing_options.num_workers:
        raise ReplayError(f"{path}: saved with {workers} worker(s), the loader has "
                          f"{loader.multiprocessing_options.num_workers}")
    return state


def batches(contract: Contract, cursor: Cursor, steps: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sampler indices, ordinal of each index's batch, row within it) of the next `steps`
    batches from `cursor`. Vectorised while no stream runs out (an endless sampler: always);
    batch by batch near the end of a finite one."""
    w_n, b = contract.streams, contract.batch_size
    t = np.arange(steps, dtype=np.int64)
    stream = (cursor.next_stream + t) % w_n
    start = np.asarray(cursor.next, np.int64)[stream] + (t // w_n) * b
    lengths = np.array([contract.stream_length(w) for w in range(w_n)], np.int64)
    if steps == 0 or (start + b <= lengths[stream]).all():
        elem = start[:, None] + np.arange(b, dtype=np.int64)[None, :]
        idx = (stream[:, None] + elem * w_n) * contract.shard_count + contract.shard_index
        ordinal = (start // b) * w_n + stream
        rows = np.broadcast_to(np.arange(b, dtype=np.int32), idx.shape)
        return idx.reshape(-1), np.repeat(ordinal, b), rows.reshape(-1)
    out_i, out_o, out_r = [], [], []
    for _ in range(steps):
        nxt = contract.next_batch(cursor)
        if nxt is None:
            break
        idx, ordinal, cursor = nxt
        out_i.append(idx)
        out_o.append(np.full(len(idx), ordinal, np.int64))
        out_r.append(np.arange(len(idx), dtype=np.int32))
    if not out_i:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32)
    return np.concatenate(out_i), np.concatenate(out_o), np.concatenate(out_r)


def _torch_loader(loader: Any) -> bool:
    """A torch DataLoader (torch imported only when the factory already did)."""
    torch_data = sys.modules.get("torch.utils.data")
    return torch_data is not None and isinstance(loader, torch_data.DataLoader)


def loader_kind(loader: Any) -> str:
    """Whose contract plans the factory's loader: "streaming" (a torch DataLoader or
    StreamingDataLoader over a StreamingDataset), "torch" (any other torch DataLoader), else
    "grain"; "olmo" for an OLMo-core data loader (not a torch DataLoader); "litdata" for
    litdata's StreamingDataLoader; "hf_iterable" for a torch DataLoader over a Hugging Face
    datasets.IterableDataset. Nothing is imported that the factory did not import already."""
    olmo = sys.modules.get("olmo_core.data.data_loader")
    if olmo is not None and isinstance(loader, olmo.DataLoaderBase):
        return "olmo"
    if not _torch_loader(loader):
        return "grain"
    streaming = sys.modules.get("streaming.base.dataset")
    if streaming is not None and isinstance(loader.dataset, streaming.StreamingDataset):
        return "streaming"
    litdata = sys.modules.get("litdata.streaming.dataloader")  # a torch DataLoader subclass
    if litdata is not None and isinstance(loader, litdata.StreamingDataLoader):
        return "litdata"
    hf = sys.modules.get("datasets")
    if hf is not None and isinstance(loader.dataset, hf.IterableDataset):
        return "hf_iterable"
    return "torch"


def check_hf_keys(loader: Any, records: int) -> None:
    """AttachError (tally.pipeline.loaders) for a torch loader over a datasets.Dataset whose
    sampler indices are not the manifest's `records` keys (hf_datasets.check_marked); nothing
    for any other loader."""
    hf = sys.modules.get("datasets")
    if hf is not None and isinstance(getattr(loader, "dataset", None), hf.Dataset):
        from tally.pipeline.loaders.hf_datasets import check_marked

        check_marked(loader.dataset, records)


def replay_host(spec: ReplaySpec, host: int, hashes: ManifestHashes | None) -> HostReplay:
    """Write one host's replayed spool files; returns what was written."""
    t0 = time.perf_counter()
    loader = make_loader(spec.loader, host, spec.hosts)
    kind = loader_kind(loader)
    if kind == "streaming":  # streaming's own partition (tally.pipeline.loaders.mosaic)
        from tally.pipeline.loaders.mosaic import replay_spec_host

        return replay_spec_host(spec, host, hashes, loader)
    if kind == "litdata":  # litdata's plan (tally.pipeline.loaders.litdata_loader)
        from tally.pipeline.loaders.litdata_loader import replay_spec_host as replay_litdata_host

        return replay_litdata_host(spec, host, hashes, loader)
    if kind == "hf_iterable":  # the loader itself, over its key column (hf_datasets)
        from tally.pipeline.loaders.hf_datasets import replay_host as replay_hf_host

        return replay_hf_host(spec, host, hashes, loader)
    if kind == "torch":  # a torch DataLoader: its own contract (tally.pipeline.loaders)
        from tally.pipeline.loaders.torch_loader import replay_host as replay_torch_host

        return replay_torch_host(spec, host, hashes, loader)
    if kind == "olmo":  # OLMo-core's own order (tally.pipeline.loaders.olmo_core)
        from tally.pipeline.loaders.olmo_core import replay_spec_host as replay_olmo_host

        return replay_olmo_host(spec, host, hashes, loader)
    if grain_dataset(loader):
        return _replay_dataset_host(spec, host, hashes, loader)
    from tally.pipeline.grain_attach import (
        AttachError,
        Leaves,
        SamplerKeys,
        SourceHashes,
        contract_of,
        keyed_by_file,
    )

    try:
        contract = contract_of(loader)
    except AttachError as exc:
        raise ReplayError(f"--loader {spec.loader} (host {host}): {exc}") from None
    state = read_state(spec.states, host, spec.hosts, loader) if spec.states else None
    cursor = contract.cursor(state)
    keys = SamplerKeys(loader._sampler)
    source = SourceHashes(loader._data_source) if spec.hashes == "source" else None
    # A source that reads files is keyed by file, as the live attach keys it.
    lookup = keyed_by_file(hashes, Leaves((loader._data_source,), (0,)))
    directory = sp.host_dir(spec.spool, spec.run_id, 0, host)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"format_version": sp.FORMAT_VERSION, "run_id": spec.run_id, "attempt": "0",
            "host": str(host), "host_count": str(spec.hosts), "resumed_from_step": "",
            "writer_version": WRITER_VERSION,
            "manifest_fingerprint": hashes.fingerprint if hashes is not None else "",
            "records_per_epoch": str(len(hashes) if hashes is not None
                                     else len(loader._data_source)),
            "checkpoint_dir": "", "replayed": "1",
            # Hashes from the manifest are under its content basis (tally.pipeline.text).
            "content_basis": hashes.content_basis if hashes is not None else ""}
    per_file = max(1, ROWS_PER_FILE // max(1, contract.batch_size))
    rows = files = 0
    first = last = None
    seq = sp.next_seq(directory)
    done = 0
    while done < spec.steps:
        n = min(per_file, spec.steps - done)
        idx, ordinal, row = batches(contract, cursor, n)
        if not len(idx):
            break
        step = spec.start_step + ordinal
        if step[-1] >= MAX_STEP:
            raise ReplayError(f"step {int(step[-1])} is beyond the spool's {MAX_STEP - 1}")
        record_key = keys.keys(idx)
        epoch = keys.epochs(idx)
        if source is not None:
            seg = source.segments(record_key, epoch)
            content, n_tokens = seg.content_hash, seg.n_tokens
        elif lookup is not hashes:
            record_key, n_tokens, content = lookup.resolve(record_key, epoch)
        else:
            content, n_tokens = hashes.lookup(record_key)
        table = pa.Table.from_pydict({
            "step": step, "host": np.full(len(idx), host, np.int32), "row": row,
            "record_key": record_key, "offset": np.zeros(len(idx), np.int32),
            "n_tokens": n_tokens.astype(np.int32), "content_hash": content,
            "epoch": epoch.astype(np.int32)}, schema=SEGMENT_SCHEMA)
        lo, hi = int(step[0]), int(step[-1])
        publish(directory, "seg", table, {**meta, "kind": "seg", "rows": str(len(idx)),
                                          "first_step": str(lo), "last_step": str(hi)},
                lo, seq, fsync=spec.fsync)
        seq, files, rows = seq + 1, files + 1, rows + len(idx)
        first = lo if first is None else first
        last = hi
        batches_done = int(np.unique(ordinal).size)
        cursor = _advance(contract, cursor, batches_done)
        done += batches_done
        if batches_done < n:  # a finite loader ran out
            break
    return HostReplay(host, rows, files, first, last, time.perf_counter() - t0)


def grain_dataset(loader: Any) -> bool:
    """A Grain dataset pipeline (MapDataset or IterDataset; Grain imported only when the
    factory already did)."""
    grain = sys.modules.get("grain")
    return grain is not None and isinstance(loader, (grain.MapDataset, grain.IterDataset))


def _dataset_contract(spec: ReplaySpec, host: int, loader: Any) -> Any:
    from tally.pipeline.grain_attach import AttachError, dataset_contract

    try:
        return dataset_contract(loader)
    except AttachError as exc:
        raise ReplayError(f"--loader {spec.loader} (host {host}): {exc}") from None


def _dataset_state(spec: ReplaySpec, host: int, contract: Any) -> Any:
    """Host `host`'s saved iterator state (the JSON of `get_state()`, Grain's checkpoint
    handler's `process_<i>-of-<n>.json`), checked against its pipeline; None without --states."""
    from tally.pipeline.grain_attach import AttachError

    if spec.states is None:
        return None
    path = state_path(spec.states, host, spec.hosts)
    try:
        state = json.loads(path.read_text())
        contract.positions(state)
    except (OSError, ValueError) as exc:
        raise ReplayError(f"{path}: no iterator state of host {host} of {spec.hosts} "
                          f"({type(exc).__name__}: {exc})") from None
    except AttachError as exc:
        raise ReplayError(f"{path}: {exc}") from None
    return state


def _replay_dataset_host(spec: ReplaySpec, host: int, hashes: ManifestHashes | None,
                         loader: Any) -> HostReplay:
    """A Grain dataset pipeline's batches (tally.pipeline.grain_attach.DatasetContract): a
    MapDataset indexed by step, an IterDataset in one pass (its mp_prefetch workers in turn)."""
    from tally.pipeline.grain_attach import SourceHashes, keyed_by_file, leaves, source_indices

    contract = _dataset_contract(spec, host, loader)
    source = leaves(contract.elements)
    by_file = keyed_by_file(hashes, source)
    if spec.hashes == "source":
        reader = SourceHashes(source)

        def resolve(keys: np.ndarray, epochs: np.ndarray) -> tuple[Any, Any, Any]:
            seg = reader.segments(keys, epochs)
            return seg.record_key, seg.n_tokens, seg.content_hash
    elif by_file is not hashes:
        resolve = by_file.resolve
    else:
        def resolve(keys: np.ndarray, epochs: np.ndarray) -> tuple[Any, Any, Any]:
            h, n = hashes.lookup(keys)
            return keys, n, h
    out = ReplayedHost(spec.spool, spec.run_id, host, spec.hosts,
                       records_per_epoch=len(hashes) if hashes is not None else len(source),
                       resolve=resolve, fingerprint=hashes.fingerprint if hashes else "",
                       content_basis=hashes.content_basis if hashes else "", fsync=spec.fsync)
    state = _dataset_state(spec, host, contract)
    for k, idx in itertools.islice(contract.schedule(state), spec.steps):
        keys, epochs = source_indices(contract.elements, idx)
        out.add(spec.start_step + k, keys, epochs)
    out.flush()
    return HostReplay(host, out.rows, out.files, out.first, out.last, out.seconds())


def _advance(contract: Contract, cursor: Cursor, k: int) -> Cursor:
    """The cursor after k batches (closed form while no stream runs out)."""
    w_n = contract.streams
    nxt = list(cursor.next)
    for w in range(w_n):
        taken = len(range((w - cursor.next_stream) % w_n, k, w_n))
        nxt[w] += taken * contract.batch_size
    over = any(nxt[w] > contract.stream_length(w) for w in range(w_n))
    if not over:
        from tally.pipeline.grain_attach import Cursor

        return Cursor(nxt, (cursor.next_stream + k) % w_n)
    for _ in range(k):  # near the end of a finite loader: batch by batch
        step = contract.next_batch(cursor)
        if step is None:
            break
        cursor = step[2]
    return cursor


def _replay_hosts(args: tuple) -> list[HostReplay]:
    spec, hosts = args
    hashes = None
    if spec.hashes == "manifest":
        from tally.pipeline.manifest_file import ManifestHashes

        hashes = ManifestHashes(spec.manifest)
    return [replay_host(spec, h, hashes) for h in hosts]


def work_dir(spec: ReplaySpec) -> Path:
    """Where a replay writes before its run appears in the spool (a dot name: never listed)."""
    return spec.spool / f".replay-{spec.run_id}.tmp"


def replay(spec: ReplaySpec, *, workers: int | None = None) -> list[HostReplay]:
    """Replay every host; refuses a run that already has spool files in `spec.spool`.

    The files are written under `work_dir(spec)` and the attempt's directory is renamed into
    the spool at the end, so a replay that fails (a key beyond the manifest, a record that
    cannot be read, Ctrl-C) leaves no half-replayed run, and the same command can run again."""
    check(spec)
    run_dir = spec.spool / spec.run_id
    if (run_dir / "attempt=0").exists():
        raise ReplayError(f"run {spec.run_id} already has a spool at {run_dir}: replay into "
                          "another run id or spool directory")
    work = work_dir(spec)
    shutil.rmtree(work, ignore_errors=True)  # a replay killed before it could clean up
    into = dataclasses.replace(spec, spool=work)
    if workers is None:
        workers = 1 if spec.hosts * spec.steps < 200_000 else min(spec.hosts, os.cpu_count() or 1)
    jobs = [list(range(spec.hosts))[i::workers] for i in range(min(workers, spec.hosts))]
    try:
        if len(jobs) <= 1:
            out = _replay_hosts((into, list(range(spec.hosts))))
        else:
            with ProcessPoolExecutor(len(jobs),
                                     mp_context=multiprocessing.get_context("spawn")) as ex:
                out = [r for part in ex.map(_replay_hosts, [(into, j) for j in jobs])
                       for r in part]
        run_dir.mkdir(parents=True, exist_ok=True)
        os.rename(work / spec.run_id / "attempt=0", run_dir / "attempt=0")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return sorted(out, key=lambda r: r.host)


def check(spec: ReplaySpec) -> None:
    """Arguments a replay refuses before it writes anything."""
    try:
        sp.check_run_id(spec.run_id)
    except ValueError as exc:
        raise ReplayError(str(exc)) from None
    sp.check_topology(0, spec.hosts, ReplayError)
    if spec.steps < 1:
        raise ReplayError(f"--steps must be at least 1, got {spec.steps}")
    if not 0 <= spec.start_step < MAX_STEP:
        raise ReplayError(f"--start-step {spec.start_step} is outside 0..{MAX_STEP - 1}")
    if spec.hashes not in ("manifest", "source"):
        raise ReplayError(f"--hashes {spec.hashes!r}: manifest or source")
    if spec.hashes == "manifest" and spec.manifest is None:
        raise ReplayError("--manifest is needed for hashes from the manifest (or --hashes "
                          "source)")
    if spec.manifest is not None and not spec.manifest.is_file():
        raise ReplayError(f"no manifest at {spec.manifest}")
    if spec.states is not None and not spec.states.is_dir():
        raise ReplayError(f"--states {spec.states}: not a directory")
    # The factory once here (and every host's state), so that bad input fails in one line
    # before any worker starts or any file is written.
    if spec.ranks_per_node < 1:
        raise ReplayError(f"--ranks-per-node must be at least 1, got {spec.ranks_per_node}")
    loader = make_loader(spec.loader, 0, spec.hosts)
    kind = loader_kind(loader)
    if kind == "streaming":
        from tally.pipeline.loaders.mosaic import check_replay as check_streaming

        return check_streaming(spec, loader)
    if spec.ranks_per_node != 1:
        raise ReplayError("--ranks-per-node is for a Streaming loader (its partition follows "
                          f"the nodes); the factory's is a {kind} loader")
    if kind == "litdata":
        from tally.pipeline.loaders.litdata_loader import check_replay as check_litdata

        return check_litdata(spec, loader)
    if kind == "hf_iterable":
        from tally.pipeline.loaders.hf_datasets import check_replay as check_hf

        return check_hf(spec, loader)
    if kind == "torch":
        from tally.pipeline.loaders import AttachError
        from tally.pipeline.loaders.torch_loader import check_replay

        check_replay(spec, loader)
        if spec.manifest is not None:
            from tally.pipeline.manifest_file import manifest_info

            try:
                check_hf_keys(loader, int(manifest_info(spec.manifest)["train_records"]))
            except AttachError as exc:
                raise ReplayError(f"--loader {spec.loader}: {exc}") from None
        return None
    if kind == "olmo":
        from tally.pipeline.loaders.olmo_core import check_replay as check_olmo

        return check_olmo(spec, loader)
    if grain_dataset(loader):
        for h in range(spec.hosts):  # every host's pipeline and state, as the run has them
            _dataset_state(spec, h, _dataset_contract(
                spec, h, loader if h == 0 else make_loader(spec.loader, h, spec.hosts)))
        return None
    from tally.pipeline.grain_attach import AttachError, contract_of

    try:
        contract_of(loader)
    except AttachError as exc:
        raise ReplayError(f"--loader {spec.loader}: {exc}") from None
    if spec.states is not None:
        for h in range(spec.hosts):
            read_state(spec.states, h, spec.hosts,
                       loader if h == 0 else make_loader(spec.loader, h, spec.hosts))
