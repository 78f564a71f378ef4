"""Post-hoc audits, after a run: did two runs consume the same data (`diff`, a Beam job over
reconcile's record-key buckets), and which runs consumed these documents (`exposure`)?
The answers the live API gives for one ledger are in `answers`."""

from typing import Any

__all__ = ["diff", "exposure"]


def __getattr__(name: str) -> Any:  # lazy: the live answers load without Beam
    if name == "diff":
        from tally.audit.posthoc.diff import diff

        return diff
    if name == "exposure":
        from tally.audit.posthoc.exposure import exposure

        return exposure
    raise AttributeError(f"module 'tally.audit.posthoc' has no attribute {name!r}")
