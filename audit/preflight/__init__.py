"""Pre-flight: is it safe to resume a run from a checkpoint on another topology? A shadow run of
the real loader, checked against the ledger (audit.preflight.check)."""

from audit.preflight.check import (
    check_and_record,
    load_checkpoint_meta,
    record_verdict,
    run_preflight,
)
from audit.preflight.verdict import STATUSES, PreflightVerdict

__all__ = ["STATUSES", "PreflightVerdict", "check_and_record", "load_checkpoint_meta",
           "record_verdict", "run_preflight"]
