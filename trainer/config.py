"""Training config: a small dataclass, loadable from a JSON file, with key=value overrides."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from audit.core.errors import TallyError


@dataclass(frozen=True)
class TrainConfig:
    run_id: str = "run"
    corpus: str = "corpus"
    manifest: str = ""  # the corpus manifest; its fingerprint goes into every spool file
    spool: str = "spool"
    # model
    vocab_size: int = 4096  # token ids are folded into the vocabulary (id % vocab_size)
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 128
    # optimisation
    steps: int = 50
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    bf16_moments: bool = False  # AdamW first moment in bfloat16 instead of float32
    # data
    global_batch: int = 8
    packing: str = "first_fit"
    seed: int = 0
    elastic: bool = False  # Grain's elastic iterator (resumes on any host count; packing none)
    fault: str = ""  # a loader fault to reproduce (pipeline/loader.py FAULTS); demos only
    # audit
    flush_every: int = 10
    ledger: str = ""  # the ledger file, for the pre-flight check when resuming on a new topology
    api: str = ""  # or the URL of `tally serve` when it owns the ledger (token: $TALLY_API_TOKEN)
    # milestone evaluation on the held-out split (0: none; always at the last step otherwise)
    eval_every: int = 0
    eval_records: int = 64
    # checkpoints
    checkpoint_dir: str = "checkpoints"
    checkpoint_every: int = 0  # steps; 0: no checkpoints

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None
             ) -> TrainConfig:
        values: dict[str, Any] = {}
        if path is not None:
            try:
                values = json.loads(Path(path).read_text())
            except (OSError, ValueError) as exc:
                raise TallyError(f"cannot read config {path}: {exc}") from None
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            if not sep or key not in fields:
                raise TallyError(f"override {item!r}: expected key=value with key one of "
                                 f"{', '.join(fields)}")
            values[key] = _parse(raw, fields[key].type)
        unknown = set(values) - set(fields)
        if unknown:
            raise TallyError(f"unknown config keys: {', '.join(sorted(unknown))}")
        return cls(**values)


def _parse(raw: str, kind: Any) -> Any:
    kind = str(kind)
    if kind == "bool":
        if raw.lower() not in ("true", "false", "1", "0"):
            raise TallyError(f"expected true or false, got {raw!r}")
        return raw.lower() in ("true", "1")
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    return raw
