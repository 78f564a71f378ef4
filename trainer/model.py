"""A small decoder-only transformer (Flax linen) that respects packed segments."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tally.trainer.config import TrainConfig


class Block(nn.Module):
    cfg: TrainConfig

    @nn.compact
    def __call__(self, x, mask):
        c = self.cfg
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=c.n_heads, qkv_features=c.d_model)(
            h, h, mask=mask)
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * c.d_model)(h)
        h = nn.gelu(h)
        return x + nn.Dense(c.d_model)(h)


class LM(nn.Module):
    cfg: TrainConfig

    @nn.compact
    def __call__(self, tokens, segment_ids):
        c = self.cfg
        length = tokens.shape[-1]
        x = nn.Embed(c.vocab_size, c.d_model)(tokens % c.vocab_size)
        x = x + nn.Embed(c.seq_len, c.d_model)(jnp.arange(length))[None]
        # Causal, and only within one packed segment: packed documents never see each other.
        causal = jnp.tril(jnp.ones((length, length), bool))
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = (causal[None] & same & (segment_ids[:, :, None] != 0))[:, None]
        for _ in range(c.n_layers):
            x = Block(c)(x, mask)
        return nn.Dense(c.vocab_size)(nn.LayerNorm()(x))
