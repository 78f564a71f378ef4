"""Training config: a small dataclass, loadable from a JSON file, with key=value overrides.

Every value is checked when the config is made (pydantic, strict: `"30"` is not a step count),
so a bad file or override stops `tally train` with one line naming the key, the value and what
is allowed, before any host starts.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator
from pydantic.dataclasses import dataclass

from tally.audit.core.errors import TallyError
from tally.audit.core.schema import RUN_ID_PATTERN
from tally.pipeline.loader_config import FAULTS, PACKINGS

Positive = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]
Packing = Literal[PACKINGS]  # the loader's own lists, as types a config can check
Fault = Literal[("", *FAULTS)]


# allow_inf_nan=False: `learning_rate=inf` passed `gt=0` and trained until the loss was NaN.
@dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid", allow_inf_nan=False))
class TrainConfig:
    run_id: Annotated[str, Field(pattern=RUN_ID_PATTERN)] = "run"
    corpus: str = "corpus"
    manifest: str = ""  # the corpus manifest; its fingerprint goes into every spool file
    spool: str = "spool"
    # model
    vocab_size: Annotated[int, Field(ge=2)] = 4096  # token ids are folded (id % vocab_size)
    d_model: Positive = 64
    n_layers: Positive = 2
    n_heads: Positive = 4
    seq_len: Positive = 128
    # optimisation
    steps: Positive = 50
    learning_rate: Annotated[float, Field(gt=0)] = 3e-3
    weight_decay: Annotated[float, Field(ge=0)] = 0.01
    bf16_moments: bool = False  # AdamW first moment in bfloat16 instead of float32
    # data
    global_batch: Positive = 8
    packing: Packing = "first_fit"
    seed: NonNegative = 0
    elastic: bool = False  # Grain's elastic iterator (resumes on any host count; packing none)
    fault: Fault = ""  # a loader fault to reproduce (pipeline/loader_config.py FAULTS); demos only
    # audit
    flush_every: Positive = 10
    ledger: str = ""  # the ledger file, for the pre-flight check when resuming on a new topology
    api: str = ""  # or the URL of `tally serve` when it owns the ledger (token: $TALLY_API_TOKEN)
    # milestone evaluation on the held-out split (0: none; always at the last step otherwise)
    eval_every: NonNegative = 0
    eval_records: Positive = 64
    # checkpoints
    checkpoint_dir: str = "checkpoints"
    checkpoint_every: NonNegative = 0  # steps; 0: no checkpoints

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads "
                             f"{self.n_heads}")
        if self.elastic and self.packing != "none":
            raise ValueError("elastic=true batches records itself: packing must be 'none'")
        return self

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None
             ) -> TrainConfig:
        values: dict[str, Any] = {}
        where = "config"
        if path is not None:
            where = f"config {path}"
            try:
                values = json.loads(Path(path).read_text())
            except (OSError, ValueError) as exc:
                raise TallyError(f"cannot read config {path}: {exc}") from None
            if not isinstance(values, dict):
                raise TallyError(f"config {path}: expected a JSON object of TrainConfig fields")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            if not sep or key not in fields:
                raise TallyError(f"override {item!r}: expected key=value with key one of "
                                 f"{', '.join(fields)}")
            values[key] = _parse(key, raw, fields[key].type)
        return cls.make(values, where)

    @classmethod
    def make(cls, values: dict[str, Any], where: str = "config") -> TrainConfig:
        """The config of these values, or TallyError with one line on the first bad one."""
        try:
            return cls(**values)
        except ValidationError as exc:
            raise TallyError(f"{where}: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "unexpected_keyword_argument":
        return f"unknown key {key!r}"
    if not key:  # a rule across keys
        return err["msg"].removeprefix("Value error, ")
    return f"{key}={err['input']!r}: {err['msg'].removeprefix('Value error, ')}"


def _parse(key: str, raw: str, annotation: Any) -> Any:
    """An override's text as its field's type (the config then checks the value)."""
    kind = annotation
    if isinstance(kind, str):
        kind = typing.get_type_hints(TrainConfig, include_extras=True)[key]
    if typing.get_origin(kind) is Annotated:
        kind = typing.get_args(kind)[0]
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except ValueError:
        name = {bool: "true or false", int: "an integer", float: "a number"}[kind]
        raise TallyError(f"override {key}={raw!r}: expected {name}") from None
    return raw
