"""Pre-flight: is it safe to resume a run from a checkpoint on another topology? A shadow run of
the real loader, checked against the ledger: Tally's keyed loader from a checkpoint
(tally.audit.preflight.check), or the user's own loader (tally.audit.preflight.loader_check).

The public face (`__all__`): the verdict, the two checks, recording a verdict, and the check a
trainer runs before it resumes on another host count."""

import importlib
from typing import Any

from tally.audit.preflight.verdict import STATUSES, PreflightVerdict

__all__ = ["STATUSES", "PreflightVerdict", "check_and_record", "load_checkpoint_meta",
           "record_verdict", "run_loader_preflight", "run_preflight"]
# Loaded on use: the keyed-loader check imports Grain (tally.pipeline.loader), and
# `preflight --loader` of a torch or Streaming loader (loader_check) runs without it.
_LAZY = {"check_and_record": "check", "load_checkpoint_meta": "check",
         "record_verdict": "check", "run_preflight": "check",
         "run_loader_preflight": "loader_check"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tally.audit.preflight' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tally.audit.preflight.{module}"), name)
