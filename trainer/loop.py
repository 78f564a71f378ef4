"""The training loop, readable top to bottom: keyed loader -> jitted step -> ledger writer."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np

from audit.writer import LedgerWriter
from pipeline.corpus import TokenSource
from pipeline.loader import KeyedLoader, LoaderConfig
from trainer.config import TrainConfig
from trainer.step import init, make_train_step


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    opt_state: object = None


def loader_config(cfg: TrainConfig) -> LoaderConfig:
    return LoaderConfig(seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                        packing=cfg.packing, seed=cfg.seed)


def train(cfg: TrainConfig, *, host: int = 0, host_count: int = 1) -> TrainResult:
    source = TokenSource(cfg.corpus)
    loader = KeyedLoader(source, loader_config(cfg), host, host_count)
    model, params, opt_state, opt = init(cfg, jax.random.PRNGKey(cfg.seed))
    train_step = make_train_step(model, opt)
    result = TrainResult()
    with LedgerWriter(cfg.spool, cfg.run_id, host=host, host_count=host_count,
                      records_per_epoch=len(source), flush_every=cfg.flush_every) as writer:
        for step in range(cfg.steps):
            batch = next(loader)
            params, opt_state, loss = train_step(params, opt_state, batch["tokens"],
                                                 batch["tokens_segment_ids"])
            # Exactly the batch this step consumed, not what the loader read ahead.
            writer.write_batch(step, batch)
            result.losses.append(loss)
        losses = [float(x) for x in jax.device_get(result.losses)]
        for step, value in enumerate(losses):
            writer.log_metric(step, "train_loss", value)
    result.losses, result.steps, result.opt_state = losses, cfg.steps, opt_state
    loader.close()
    assert np.isfinite(losses).all(), "training diverged"
    return result
