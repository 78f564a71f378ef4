"""A live audited loader read for an epoch with its state saved after a cut, as a job
checkpoints it: what pre-flight tests of a relaunch start from."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_epoch_checkpointed(loader: Any, cut: int, state_file: Path,
                            truth: Callable[[Any], list[int]]) -> tuple[list[int], int]:
    """Read the audited `loader`'s epoch, saving its `state_dict()` as JSON to `state_file`
    after `cut` batches, and finish its writer: (the records read before the cut, from
    `truth(batch)`, and the batches the epoch held)."""
    before, k = [], -1
    for k, batch in enumerate(loader):
        if k < cut:
            before += truth(batch)
        if k + 1 == cut:
            state_file.write_text(json.dumps(loader.state_dict()))
    loader.writer.finish()
    return before, k + 1
