"""Tally's audit: what a training run consumed, proven record by record.

Roles, each a sub-package:
- `audit.core`: the shared concepts (errors, the hash, the schemas, exposure semantics);
  imports nothing else of the project.
- `audit.hook`: what a training loop carries (segments, the spool contract, the writer); numpy,
  pyarrow and xxhash only.
- `audit.ledger`: the DuckDB ledger, exactly-once ingest, aggregates, the live engine and its
  answers.
- `audit.reconcile`: the Beam job against the manifest, and its report (`from
  audit.reconcile import reconcile`).
- `audit.preflight`: is a resume on another topology safe?
- `audit.posthoc`: after the fact, did two runs consume the same data (`tally diff`, a Beam
  job), and which documents did a run consume (`tally exposure`)?
- `audit.cli` and `audit.demo`: the only modules that reach across roles (and into `trainer`
  and `api`).

This module is the public face. Its names load lazily, so that `from audit import
LedgerWriter` on a training host pulls in neither DuckDB nor Beam.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "TallyError": "audit.core.errors",
    "NotFound": "audit.core.errors",
    "content_hash": "audit.core.hashing",
    "Segments": "audit.hook.segments",
    "segments_from_batch": "audit.hook.segments",
    "LedgerWriter": "audit.hook.writer",
    "WriterError": "audit.hook.writer",
    "Ledger": "audit.ledger.database",
    "ingest": "audit.ledger.ingest",
    "run_preflight": "audit.preflight.check",
    "record_verdict": "audit.preflight.check",
    "PreflightVerdict": "audit.preflight.verdict",
    "load_report": "audit.reconcile.load",
    "Report": "audit.reconcile.load",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'audit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
