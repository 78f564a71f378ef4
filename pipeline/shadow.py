"""Shadow runs of the keyed loader: what each host *would* read, without reading the corpus.

`ShadowSource` stands in for the train split: item k is an all-zero token array as long as
record k (lengths from the manifest). The loader is the training builder itself
(`KeyedLoader`), so shuffling, slicing, packing (which decides only by lengths) and batching
make the same decisions as in training, and every planned record start is read from the
batch's carried `key` exactly as the ledger hook reads it.

Hosts are independent given their restored state, so a large shadow run is spread over worker
processes (spawned, not forked: the caller may be a trainer with JAX running).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tally.audit.core.errors import TallyError
from tally.pipeline.loader import KeyedLoader, LoaderConfig
from tally.pipeline.manifest_file import manifest_info


class ShadowSource:
    """Grain random-access source of zero token arrays with the train records' lengths."""

    def __init__(self, lengths: np.ndarray, fingerprint: str | None = None) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.fingerprint = fingerprint
        self._zeros: np.ndarray | None = None

    @classmethod
    def from_manifest(cls, path: str | Path) -> ShadowSource:
        info = manifest_info(path)
        table = pq.read_table(path, columns=["record_key", "n_tokens", "split"])
        train = table.filter(pc.equal(table["split"], "train"))
        keys = train["record_key"].to_numpy()
        if not np.array_equal(keys, np.arange(len(keys))):
            raise TallyError(f"manifest {path}: train record keys are not 0..{len(keys) - 1} in "
                             "order (the loader indexes the train split by record key)")
        return cls(train["n_tokens"].to_numpy(), info["manifest_fingerprint"])

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        if self._zeros is None:
            self._zeros = np.zeros(int(self.lengths.max(initial=1)), np.int32)
        # A read-only view: the loader copies what it keeps, and nothing writes to tokens.
        return self._zeros[: self.lengths[i]]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_zeros": None}

    def __repr__(self) -> str:  # Grain logs sources by repr
        return f"ShadowSource({len(self)} records)"


@dataclass
class HostPlan:
    """The record starts one host would read: `index[i]` (epoch * N + record key) at relative
    step `step[i]`."""

    host: int
    step: np.ndarray  # int32
    index: np.ndarray  # int64
    steps: int  # steps read
    passed: int | None  # first step wholly past `until_epoch` (the host's share of it is done)
    ended: bool = False  # the loader's stream ended (finite epochs)
    state: dict[str, Any] | None = None  # loader state after `steps`, to extend the plan


def record_starts(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Carried indices of the records that start in a batch (a record cut by concat-then-split
    starts where its position is 0; padding has segment id 0)."""
    starts = (batch["tokens_segment_ids"] != 0) & (batch["pos"] == 0)
    return batch["key"][starts]


class Cancelled(TallyError):
    """A shadow run stopped by its caller (a client gone, a time box spent)."""


def _plan_host(source, cfg: LoaderConfig, host: int, hosts: int, state: dict | None,
               steps: int, *, until_epoch: int | None, stop_when_passed: bool,
               keep_state: bool, cancel: threading.Event | None = None) -> HostPlan:
    loader = KeyedLoader(source, cfg, host, hosts)
    if state is not None:
        loader.set_state(state, force=True)
    n = len(source)
    idx, step_of, passed, ended, read = [], [], None, False, 0
    while read < steps:
        if cancel is not None and cancel.is_set():
            raise Cancelled("the pre-flight shadow run was cancelled")
        try:
            batch = next(loader)
        except StopIteration:
            ended = True
            break
        starts = record_starts(batch)
        idx.append(starts)
        step_of.append(np.full(len(starts), read, np.int32))
        if passed is None and until_epoch is not None and len(starts) and \
                int(starts.min()) // n > until_epoch:
            passed = read
        read += 1
        if passed is not None and stop_when_passed:
            break
    if ended and passed is None:
        passed = read
    return HostPlan(host, np.concatenate(step_of) if step_of else np.zeros(0, np.int32),
                    np.concatenate(idx).astype(np.int64) if idx else np.zeros(0, np.int64),
                    read, passed, ended, loader.get_state() if keep_state else None)


_WORKER_SOURCE = None


def _init_worker(source) -> None:
    global _WORKER_SOURCE
    _WORKER_SOURCE = source


def _plan_hosts(args: tuple) -> list[HostPlan]:
    cfg, hosts, jobs, kw = args
    return [_plan_host(_WORKER_SOURCE, cfg, h, hosts, st, n, **kw) for h, st, n in jobs]


def shadow_run(source, cfg: LoaderConfig, hosts: int, states: Sequence[dict | None], *,
               steps: int, until_epoch: int | None = None, to_epoch_end: bool = False,
               workers: int = 1, cancel: threading.Event | None = None
               ) -> tuple[list[HostPlan], int]:
    """Every host's plan from its restored state (`states[h]`, None: from the start).

    With `to_epoch_end`, the horizon ends at the first step where every host is wholly past
    `until_epoch` (at most `steps`); hosts move in lockstep, so a host that finished its share
    early is extended to that step. Returns (plans cut to the horizon, horizon in steps).
    """
    cfg = dataclasses.replace(cfg, read_threads=0, read_buffer=0, workers=0)
    cfg.check(hosts)
    kw = dict(until_epoch=until_epoch, stop_when_passed=to_epoch_end, keep_state=to_epoch_end)
    with _Pool(source, workers, len(states), cancel) as pool:
        plans = pool.run(cfg, hosts, [(h, st, steps) for h, st in enumerate(states)], kw)
        horizon = steps
        if to_epoch_end and all(p.passed is not None for p in plans):
            horizon = min(steps, max(p.passed for p in plans))
            short = [(p.host, p.state, horizon - p.steps) for p in plans
                     if p.steps < horizon and not p.ended]
            kw = dict(until_epoch=None, stop_when_passed=False, keep_state=False)
            for extra in pool.run(cfg, hosts, short, kw):
                base = plans[extra.host]
                plans[extra.host] = HostPlan(
                    base.host, np.concatenate([base.step, extra.step + base.steps]),
                    np.concatenate([base.index, extra.index]), base.steps + extra.steps,
                    base.passed, extra.ended)
    for p in plans:
        keep = p.step < horizon
        p.step, p.index, p.state = p.step[keep], p.index[keep], None
    return plans, horizon


class _Pool:
    """Runs host jobs in this process (workers <= 1) or in spawned worker processes."""

    def __init__(self, source, workers: int, jobs: int,
                 cancel: threading.Event | None = None) -> None:
        self.source, self.workers = source, max(1, min(workers, jobs))
        self.cancel = cancel  # honoured in this process, and between chunks of the workers
        self._ex: ProcessPoolExecutor | None = None

    def __enter__(self) -> _Pool:
        if self.workers > 1:
            self._ex = ProcessPoolExecutor(self.workers,
                                           mp_context=multiprocessing.get_context("spawn"),
                                           initializer=_init_worker, initargs=(self.source,))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ex is not None:
            self._ex.shutdown(cancel_futures=True)

    def run(self, cfg, hosts: int, jobs: list, kw: dict) -> list[HostPlan]:
        if self._ex is None:
            return [_plan_host(self.source, cfg, h, hosts, st, n, cancel=self.cancel, **kw)
                    for h, st, n in jobs]
        # Several chunks per worker so that an uneven chunk does not leave workers idle.
        n = min(len(jobs), self.workers * 4)
        chunks = [jobs[i::n] for i in range(n)]
        out = {}
        for part in self._ex.map(_plan_hosts, [(cfg, hosts, c, kw) for c in chunks]):
            if self.cancel is not None and self.cancel.is_set():
                raise Cancelled("the pre-flight shadow run was cancelled")
            out.update({p.host: p for p in part})
        return [out[h] for h, _, _ in jobs]


def default_workers(hosts: int, steps: int, rows_per_host: int) -> int:
    """Worker processes worth starting: none for small plans (spawning costs ~2 s each)."""
    if hosts * steps * rows_per_host < 100_000:
        return 1
    return max(1, min(hosts, os.cpu_count() or 1))
