"""The training loop, readable top to bottom: keyed loader -> jitted step -> ledger writer.

One call of `train` is one host. With several hosts (`tally train --hosts H`, trainer/launch.py)
each process runs this same loop on its own slice of every global batch; the step itself is
global (trainer/distributed.py).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import jax
import numpy as np

from tally.audit.core.errors import TallyError
from tally.audit.hook.writer import LedgerWriter
from tally.pipeline.corpus import TokenSource
from tally.pipeline.loader import KeyedLoader, LoaderConfig, state_for_host
from tally.pipeline.manifest_file import manifest_info
from tally.trainer import checkpoint
from tally.trainer.config import TrainConfig
from tally.trainer.distributed import Topology, barrier, gather_json
from tally.trainer.evaluate import HeldOut, milestone_metrics
from tally.trainer.step import init, make_train_step, token_losses


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # per step of this attempt
    evals: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> metrics
    steps: int = 0
    seconds: float = 0.0  # wall time of the steps (compilation included)
    step_ends: list[float] = field(default_factory=list)  # perf_counter after each dispatch
    finished: float = 0.0  # perf_counter once the last step's results are ready
    writer_blocked_s: float = 0.0  # training-thread time inside the ledger writer's calls
    writer_background_s: float = 0.0  # the writer thread's time hashing and publishing


def loader_config(cfg: TrainConfig) -> LoaderConfig:
    return LoaderConfig(seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                        packing=cfg.packing, seed=cfg.seed, elastic=cfg.elastic,
                        fault=cfg.fault or None)


def train(cfg: TrainConfig, *, host: int = 0, host_count: int = 1, resume: bool = False,
          force: bool = False, audit: bool = True, log=None) -> TrainResult:
    """Train to step `cfg.steps`; with `resume`, continue from the latest checkpoint as a new
    attempt (the spool records resumed_from_step, so the ledger rolls back the rest);
    `force` restores loader states saved on another host count (the launcher's pre-flight
    check has run and its verdict is in the ledger). `audit=False` leaves the ledger writer
    out: only for measuring what it costs."""
    # The ledger writer's thread hashes beside this one; a short GIL switch interval keeps
    # the step's dispatch from waiting up to Python's default 5 ms behind it.
    sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
    topo = Topology.create()
    source = TokenSource(cfg.corpus)
    loader = KeyedLoader(source, loader_config(cfg), host, host_count)
    model, params, opt_state, opt = init(cfg, jax.random.PRNGKey(cfg.seed), topo.replicated)
    train_step = make_train_step(model, opt, topo.replicated, topo.by_row)
    evaluate = jax.jit(lambda p, t, s: token_losses(p, model, t, s),
                       out_shardings=topo.replicated)
    held = (HeldOut.load(cfg.corpus, cfg.eval_records, cfg.seq_len, host_count)
            if cfg.eval_every else None)
    mngr = checkpoint.manager(cfg.checkpoint_dir) if cfg.checkpoint_every or resume else None
    start, attempt = 0, 0
    if resume:
        found = checkpoint.restore(mngr, params, opt_state)
        if found is None:
            raise TallyError(f"--resume: no checkpoint in {cfg.checkpoint_dir}")
        start, params, opt_state, meta = found
        loader.set_state(state_for_host(meta["loaders"], host), force=force)
        attempt = meta["attempt"] + 1

    result = TrainResult()
    fingerprint = manifest_info(cfg.manifest)["manifest_fingerprint"] if cfg.manifest else None
    writer = (LedgerWriter(cfg.spool, cfg.run_id, host=host, host_count=host_count,
                           attempt=attempt, resumed_from_step=start if attempt else None,
                           records_per_epoch=len(source), flush_every=cfg.flush_every,
                           checkpoint_dir=cfg.checkpoint_dir if mngr is not None else None,
                           manifest_fingerprint=fingerprint)
              if audit else nullcontext())
    pending: list[tuple[int, jax.Array]] = []  # losses not yet fetched (keeps dispatch async)

    def log_losses() -> None:
        values = [float(v) for v in jax.device_get([loss for _, loss in pending])]
        result.losses += values
        if audit and host == 0:
            writer.log_metrics([(step, "train_loss", v) for (step, _), v
                                in zip(pending, values, strict=True)])
        pending.clear()

    def save(step: int) -> None:
        """Collective: every host flushes, then all hosts' loader states go in one checkpoint."""
        if audit:
            writer.flush()  # the ledger is never behind a checkpoint
        states = gather_json(loader.get_state())
        checkpoint.save(mngr, step, params, opt_state, {
            "step": step, "attempt": attempt, "host_count": host_count,
            "config": dataclasses.asdict(cfg),
            "loaders": {str(h): s for h, s in enumerate(states)}})

    if held is not None:
        rows = len(held.domains) // host_count
        mine = slice(host * rows, (host + 1) * rows)
        held_tokens, held_segments = (topo.rows(held.tokens[mine]),
                                      topo.rows(held.segments[mine]))
        evaluate = evaluate.lower(params, held_tokens, held_segments).compile()
    t0 = time.perf_counter()
    with writer:
        for step in range(start, cfg.steps):
            if cfg.checkpoint_every and step > start and step % cfg.checkpoint_every == 0:
                save(step)
            batch = next(loader)
            tokens, segments = (topo.rows(batch["tokens"]),
                                topo.rows(batch["tokens_segment_ids"]))
            if step == start:  # compile ahead of time, then start the hosts together
                train_step = train_step.lower(params, opt_state, tokens, segments).compile()
                barrier("tally-first-step")
            params, opt_state, loss, position_loss = train_step(params, opt_state, tokens,
                                                                segments)
            if audit:
                # Exactly the batch this step consumed, not what the loader read ahead, with
                # this host's rows' per-position losses (the writer's thread waits for them).
                writer.write_batch(step, batch, loss=position_loss.addressable_data(0))
            pending.append((step, loss))
            result.step_ends.append(time.perf_counter())
            if len(pending) >= cfg.flush_every:
                log_losses()
                if log and host == 0:
                    rate = (step + 1 - start) / (time.perf_counter() - t0)
                    log(f"step {step} (last {cfg.steps - 1})  loss {result.losses[-1]:.3f}  "
                        f"{rate:.1f} steps/s")
            if held is not None and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                sums, counts = jax.device_get(evaluate(params, held_tokens, held_segments))
                result.evals[step] = milestone_metrics(sums, counts, held.domains)
                if audit and host == 0:
                    writer.log_metrics([(step, k, v) for k, v in result.evals[step].items()])
                if log and host == 0:
                    log(f"step {step}: held-out loss "
                        f"{result.evals[step]['heldout_loss']:.3f}")
        log_losses()
        if cfg.checkpoint_every and cfg.steps > start:
            save(cfg.steps)  # the final state too, so a longer run can continue from it
        if audit and cfg.steps > start:
            writer.finish()  # this host's share of the run ended at its last step
    jax.block_until_ready(params)
    result.finished = time.perf_counter()
    if audit:
        result.writer_blocked_s = writer.blocked_seconds
        result.writer_background_s = writer.background_seconds
    result.seconds = result.finished - t0
    result.steps = cfg.steps - start
    loader.close()
    if not np.isfinite(result.losses).all():
        raise TallyError("training diverged (non-finite loss)")
    return result
