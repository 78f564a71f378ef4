"""Checkpoints (orbax): parameters, optimizer state, and a JSON part with the step, the attempt
and every host's loader state. The ledger writer is flushed before each save, so the ledger is
never behind a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def manager(directory: str | Path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(Path(directory).resolve(),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=3))


def save(mngr: ocp.CheckpointManager, step: int, params: Any, opt_state: Any,
         meta: dict[str, Any]) -> None:
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        meta=ocp.args.JsonSave(meta)))
    mngr.wait_until_finished()


def restore(mngr: ocp.CheckpointManager, params: Any, opt_state: Any
            ) -> tuple[int, Any, Any, dict[str, Any]] | None:
    """(step, params, opt_state, meta) of the latest checkpoint, or None when there is none."""
    step = mngr.latest_step()
    if step is None:
        return None
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct,
                                      {"params": params, "opt_state": opt_state})
    got = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return step, got["state"]["params"], got["state"]["opt_state"], got["meta"]
