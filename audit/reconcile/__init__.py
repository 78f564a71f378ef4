"""Reconcile: a run's consumption against the corpus manifest, as a Beam job (job) on the bucket
jobs' floor (tally.audit.buckets: plan, bucket files, typed partials, the shared stages), with
the per-bucket statistics (bucket_stats) and the report it writes (report, html, verdict,
evidence, loss).

What the rest of Tally may use: `reconcile` (the job, loaded on use), `report` (its `summary`),
`html` (`served`: report.html as the service serves it), `load` (a report read back) and
`follow` (the live reconcile, `tally reconcile --follow`)."""

from typing import Any

__all__ = ["follow", "html", "load", "reconcile", "report"]


def __getattr__(name: str) -> Any:  # lazy: the report and bucket maths load without Beam
    if name == "reconcile":
        from tally.audit.reconcile.job import reconcile

        return reconcile
    raise AttributeError(f"module 'tally.audit.reconcile' has no attribute {name!r}")
