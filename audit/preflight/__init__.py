"""Pre-flight: is it safe to resume a run from a checkpoint on another topology? A shadow run of
the real loader, checked against the ledger (tally.audit.preflight.check)."""

from typing import Any

from tally.audit.preflight.verdict import STATUSES, PreflightVerdict

__all__ = ["STATUSES", "PreflightVerdict", "check_and_record", "load_checkpoint_meta",
           "record_verdict", "run_preflight"]
_CHECK = {"check_and_record", "load_checkpoint_meta", "record_verdict", "run_preflight"}


def __getattr__(name: str) -> Any:
    # The keyed-loader check imports Grain (tally.pipeline.loader); `preflight --loader` of a torch
    # or Streaming loader (tally.audit.preflight.loader_check) runs without it, so it loads on use.
    if name in _CHECK:
        from tally.audit.preflight import check

        return getattr(check, name)
    raise AttributeError(f"module 'tally.audit.preflight' has no attribute {name!r}")
