"""A small JAX/Flax/optax language-model trainer on the keyed loader, audited by Tally.

The public face (`__all__`): `config` (TrainConfig), `launch` (the host processes), `loop` (the
training loop and its loader config) and `evaluate` (`tally compare`); the model, the step,
checkpoints and the hosts' set-up are the trainer's own."""

__all__ = ["config", "evaluate", "launch", "loop"]
