"""A small JAX/Flax/optax language-model trainer on the keyed loader, audited by Tally."""
