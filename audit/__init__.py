"""Tally's audit: what a training run consumed, proven record by record.

Roles, each a sub-package:
- `tally.audit.core`: the shared concepts (errors, the hash, the schemas, exposure semantics);
  imports nothing else of the project.
- `tally.audit.hook`: what a training loop carries (segments, the spool contract, the writer);
numpy,
  pyarrow and xxhash only.
- `tally.audit.ledger`: the DuckDB ledger, exactly-once ingest, aggregates, the live engine and its
  answers.
- `tally.audit.reconcile`: the Beam job against the manifest, and its report (`from
  tally.audit.reconcile import reconcile`).
- `tally.audit.preflight`: is a resume on another topology safe?
- `tally.audit.posthoc`: after the fact, did two runs consume the same data (`tally diff`, a Beam
  job), and which documents did a run consume (`tally exposure`)?
- `tally.audit.cli` and `tally.audit.demo`: the only modules that reach across roles (and into
`trainer`
  and `api`).

This module is the public face. Its names load lazily, so that `from audit import
LedgerWriter` on a training host pulls in neither DuckDB nor Beam.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "TallyError": "tally.audit.core.errors",
    "NotFound": "tally.audit.core.errors",
    "content_hash": "tally.audit.core.hashing",
    "Segments": "tally.audit.hook.segments",
    "segments_from_batch": "tally.audit.hook.segments",
    "LedgerWriter": "tally.audit.hook.writer",
    "WriterError": "tally.audit.hook.writer",
    "Ledger": "tally.audit.ledger.database",
    "ingest": "tally.audit.ledger.ingest",
    "run_preflight": "tally.audit.preflight.check",
    "record_verdict": "tally.audit.preflight.check",
    "PreflightVerdict": "tally.audit.preflight.verdict",
    "load_report": "tally.audit.reconcile.load",
    "Report": "tally.audit.reconcile.load",
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
