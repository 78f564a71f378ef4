"""Loss, optimizer and the jitted train step."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from tally.trainer.config import TrainConfig
from tally.trainer.model import LM


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    # bf16 first moments halve optimizer memory but cost quality (the reference reproduction
    # lost 0.93 loss within 1000 steps); float32 is the default.
    return optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay,
                       mu_dtype=jnp.bfloat16 if cfg.bf16_moments else None)


def predicted(seg: jax.Array) -> jax.Array:
    """Positions whose next token is predicted: the target is in the same, non-padding
    segment (packed documents never predict each other)."""
    return (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)


def position_losses(params: Any, model: LM, tokens: jax.Array, seg: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
    """Per position p < L - 1: the cross-entropy of predicting token p + 1 (0 where that
    target is in another segment or padding), and whether it counts. [B, L - 1] each."""
    logits = model.apply(params, tokens[:, :-1], seg[:, :-1])
    targets = tokens[:, 1:] % model.cfg.vocab_size
    valid = predicted(seg)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return ce * valid, valid


def token_losses(params: Any, model: LM, tokens: jax.Array, seg: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """Per row: summed next-token cross-entropy over positions whose target is in the same
    segment, and the number of such positions."""
    ce, valid = position_losses(params, model, tokens, seg)
    return jnp.sum(ce, axis=1), jnp.sum(valid, axis=1)


def loss_fn(params: Any, model: LM, tokens: jax.Array, seg: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
    """Mean next-token cross-entropy per predicted token of the whole (global) batch, and the
    per-position losses it averages (for the ledger: each segment's own loss)."""
    ce, valid = position_losses(params, model, tokens, seg)
    return jnp.sum(ce) / jnp.maximum(1, jnp.sum(valid)), ce


def init(cfg: TrainConfig, rng: jax.Array, replicated: jax.sharding.Sharding | None = None
         ) -> tuple[LM, Any, Any, optax.GradientTransformation]:
    """Model, parameters, optimizer state and optimizer; with `replicated`, the parameters and
    optimizer state are laid out identically on every host."""
    model, opt = LM(cfg), optimizer(cfg)
    dummy = jnp.zeros((1, cfg.seq_len - 1), jnp.int32)
    place = (lambda f: f) if replicated is None else partial(jax.jit, out_shardings=replicated)
    params = place(model.init)(rng, dummy, dummy + 1)
    return model, params, place(opt.init)(params), opt


def make_train_step(model: LM, opt: optax.GradientTransformation,
                    replicated: jax.sharding.Sharding, by_row: jax.sharding.Sharding):
    """One optimizer step on the global batch. With rows split across hosts, the mean loss
    makes XLA all-reduce the gradients, so every host applies the same update. It also returns
    the per-position losses, split by rows like the batch: each host keeps its own rows'."""

    @partial(jax.jit, out_shardings=(replicated, replicated, replicated, by_row))
    def train_step(params, opt_state, tokens, seg):
        (loss, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, model, tokens,
                                                                        seg)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, ce

    return train_step
