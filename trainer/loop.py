"""The training loop, readable top to bottom: keyed loader -> jitted step -> ledger writer."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np

from audit.errors import TallyError
from audit.writer import LedgerWriter
from pipeline.corpus import TokenSource
from pipeline.loader import KeyedLoader, LoaderConfig
from trainer import checkpoint
from trainer.config import TrainConfig
from trainer.step import init, make_train_step


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    steps: int = 0


def loader_config(cfg: TrainConfig) -> LoaderConfig:
    return LoaderConfig(seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                        packing=cfg.packing, seed=cfg.seed)


def train(cfg: TrainConfig, *, host: int = 0, host_count: int = 1,
          resume: bool = False) -> TrainResult:
    """Train `cfg.steps` steps in all; with `resume`, continue from the latest checkpoint as
    a new attempt (the spool records resumed_from_step, so the ledger rolls back the rest)."""
    source = TokenSource(cfg.corpus)
    loader = KeyedLoader(source, loader_config(cfg), host, host_count)
    model, params, opt_state, opt = init(cfg, jax.random.PRNGKey(cfg.seed))
    train_step = make_train_step(model, opt)
    mngr = checkpoint.manager(cfg.checkpoint_dir) if cfg.checkpoint_every else None
    start, attempt = 0, 0
    if resume:
        found = checkpoint.restore(mngr, params, opt_state) if mngr else None
        if found is None:
            raise TallyError(f"--resume: no checkpoint in {cfg.checkpoint_dir}")
        start, params, opt_state, meta = found
        loader.set_state(meta["loaders"][str(host)])
        attempt = meta["attempt"] + 1
    result = TrainResult()
    with LedgerWriter(cfg.spool, cfg.run_id, host=host, host_count=host_count,
                      attempt=attempt, resumed_from_step=start if attempt else None,
                      records_per_epoch=len(source), flush_every=cfg.flush_every) as writer:
        for step in range(start, cfg.steps):
            if mngr and step > start and step % cfg.checkpoint_every == 0:
                writer.flush()  # the ledger is never behind a checkpoint
                checkpoint.save(mngr, step, params, opt_state, {
                    "step": step, "attempt": attempt,
                    "loaders": {str(host): loader.get_state()}})
            batch = next(loader)
            params, opt_state, loss = train_step(params, opt_state, batch["tokens"],
                                                 batch["tokens_segment_ids"])
            # Exactly the batch this step consumed, not what the loader read ahead.
            writer.write_batch(step, batch)
            result.losses.append(loss)
        losses = [float(x) for x in jax.device_get(result.losses)]
        for step, value in enumerate(losses, start=start):
            writer.log_metric(step, "train_loss", value)
    result.losses, result.steps = losses, cfg.steps - start
    loader.close()
    if not np.isfinite(losses).all():
        raise TallyError("training diverged (non-finite loss)")
    return result
