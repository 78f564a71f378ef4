"""Checkpoints (orbax): parameters, optimizer state, and a JSON part with the step, the attempt,
the training config and every host's loader state. The ledger writer is flushed before each
save, so the ledger is never behind a checkpoint. Saves are collective: every host calls
`save`; orbax writes the replicated arrays and the JSON part once."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from tally.audit.core.errors import TallyError


def manager(directory: str | Path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(Path(directory).resolve(),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=3))


def save(mngr: ocp.CheckpointManager, step: int, params: Any, opt_state: Any,
         meta: dict[str, Any]) -> None:
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        meta=ocp.args.JsonSave(meta)))
    mngr.wait_until_finished()


def restore(mngr: ocp.CheckpointManager, params: Any, opt_state: Any, step: int | None = None
            ) -> tuple[int, Any, Any, dict[str, Any]] | None:
    """(step, params, opt_state, meta) of `step` (default: the latest), or None when there is
    none. `params` and `opt_state` give the structure, dtypes and shardings to restore into."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        return None
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct,
                                      {"params": params, "opt_state": opt_state})
    got = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return step, got["state"]["params"], got["state"]["opt_state"], got["meta"]


def locate(path: str | Path) -> tuple[Path, int]:
    """A checkpoint directory (its latest step) or one step's directory -> (directory, step)."""
    path = Path(path)
    if path.name.isdigit() and (path / "meta").exists():
        return path.parent, int(path.name)
    if not path.is_dir():
        raise TallyError(f"checkpoint {path} does not exist")
    step = manager(path).latest_step()
    if step is None:
        raise TallyError(f"{path} holds no finished checkpoint")
    return path, step


def read_meta(path: str | Path) -> tuple[int, dict[str, Any]]:
    """(step, meta) of a checkpoint, without loading any array."""
    directory, step = locate(path)
    meta = manager(directory).restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]
    return step, meta


def load_params(path: str | Path):
    """(config, params, step) of a checkpoint, on this process alone (for offline tools)."""
    from tally.trainer.config import TrainConfig
    from tally.trainer.step import init

    directory, step = locate(path)
    _, meta = read_meta(path)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in meta.get("config", {}).items() if k in known})
    # The structure to restore into, abstract: made for real, the model's init ran op by op,
    # compiling each op (3.2 s a checkpoint, half of what `tally compare` took).
    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params, opt_state = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here),
        jax.eval_shape(lambda: init(cfg, jax.random.PRNGKey(0))[1:3]))
    _, params, _, _ = restore(manager(directory), params, opt_state, step)
    return cfg, params, step
