"""Reconcile: a run's consumption against the corpus manifest, as a Beam job (job), over a plan
of inputs and key buckets (plan), with typed partial results (partials), and the report it
writes (report, html, verdict)."""

from typing import Any

__all__ = ["reconcile"]


def __getattr__(name: str) -> Any:  # lazy: the report and bucket maths load without Beam
    if name == "reconcile":
        from tally.audit.reconcile.job import reconcile

        return reconcile
    raise AttributeError(f"module 'tally.audit.reconcile' has no attribute {name!r}")
