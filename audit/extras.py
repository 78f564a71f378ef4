"""What each command needs beyond the base install, and the one line that says which extra to
install when it is missing.

The base install (numpy, pyarrow, xxhash, duckdb, pydantic, tqdm) is what a training host that
only writes the spool, and the ledger, need; the roles' packages come with extras (pyproject's
`beam`, `train`, `api`, `text`, and `all`)."""

from __future__ import annotations

import importlib.util
from importlib import metadata

# The top-level module -> the extra that installs it.
MODULE_EXTRA = {
    "apache_beam": "beam", "dask": "beam", "distributed": "beam", "array_record": "beam",
    "jax": "train", "jaxlib": "train", "flax": "train", "optax": "train", "grain": "train",
    "orbax": "train",
    "fastapi": "api", "starlette": "api", "uvicorn": "api", "fastapi_offline": "api",
    "prometheus_client": "api",
    "tokenizers": "text", "zstandard": "text",
    "datasets": "hf",
    "torch": "torch", "torchdata": "torch",
    "olmo_core": "olmo",
    "litdata": "litdata", "streaming": "streaming",
}
# What a command imports first, by extra (checked before it starts, so that nothing runs half).
COMMAND_NEEDS = {
    "corpus": ("array_record",),
    "manifest": ("apache_beam", "array_record"),
    "reconcile": ("apache_beam",),
    "diff": ("apache_beam",),
    "train": ("jax", "flax", "optax", "grain", "orbax"),
    "compare": ("jax", "flax", "orbax"),
    # preflight and replay: what the user's loader needs (Grain, torch, streaming) is imported
    # by its factory or on use, and a missing one is named then (`missing`).
    "preflight": (),
    "replay": (),
    "serve": ("fastapi", "uvicorn", "fastapi_offline", "prometheus_client"),
    "demo": ("apache_beam", "jax", "flax", "grain", "fastapi", "uvicorn", "fastapi_offline"),
}
COMMAND_EXTRA = {"demo": "all"}  # commands that need more than one role

class MissingExtra(Exception):
    def __init__(self, command: str, module: str) -> None:
        self.extra = COMMAND_EXTRA.get(command) or MODULE_EXTRA.get(module.split(".")[0], "all")
        super().__init__(f"'tally {command}' needs the {self.extra} extra ({module} is not "
                         f"installed): pip install 'tally-audit[{self.extra}]'")


def check(command: str) -> None:
    """MissingExtra for the first module `command` needs that is not installed."""
    for module in COMMAND_NEEDS.get(command, ()):
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(command, module)


def missing(command: str, exc: ModuleNotFoundError) -> MissingExtra | None:
    """The extra an import error inside `command` asks for (None: not a package of ours)."""
    name = (exc.name or "").split(".")[0]
    return MissingExtra(command, name) if name in MODULE_EXTRA else None


def version() -> str:
    try:
        return metadata.version("tally-audit")
    except metadata.PackageNotFoundError:  # a source tree that is not installed
        return "unknown"
