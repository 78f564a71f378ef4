"""Post-hoc audits, after a run: did two runs consume the same data (`diff`, a Beam job on the
bucket jobs' floor, tally.audit.buckets), and which runs consumed these documents (`exposure`)?
The answers the live API gives for one ledger are in `answers`.

What the rest of Tally may use: `diff` and `exposure` (the two audits, loaded on use), `sources`
(`SOURCE:RUN`), `diff_report` (its `summary`) and `answers`."""

from typing import Any

__all__ = ["answers", "diff", "diff_report", "exposure", "sources"]


def __getattr__(name: str) -> Any:  # lazy: the live answers load without Beam
    if name == "diff":
        from tally.audit.posthoc.diff import diff

        return diff
    if name == "exposure":
        from tally.audit.posthoc.exposure import exposure

        return exposure
    raise AttributeError(f"module 'tally.audit.posthoc' has no attribute {name!r}")
