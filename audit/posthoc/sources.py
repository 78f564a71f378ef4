"""Where a post-hoc audit reads a run: `SOURCE:RUN`, SOURCE a spool directory or a ledger file.

The inputs themselves are reconcile's (tally.audit.buckets.plan): the run's published spool
segment
files, or an export of its rows from the ledger, with its attempts and their rollback cutoffs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tally.audit.buckets.plan import Inputs, ledger_inputs, spool_inputs
from tally.audit.core.errors import TallyError
from tally.audit.core.schema import RUN_ID_PATTERN


@dataclass(frozen=True)
class RunSource:
    """One run in one place: a spool directory or a ledger file."""

    path: Path
    run_id: str
    kind: str  # "spool" | "ledger"

    def __str__(self) -> str:
        return f"{self.path}:{self.run_id}"

    def to_dict(self) -> dict[str, str]:
        return {"source": str(self.path), "kind": self.kind, "run_id": self.run_id}


def run_source(path: str | Path, run_id: str, what: str = "source") -> RunSource:
    """The run `run_id` in `path`: a directory is a spool, a file a ledger."""
    if not re.match(RUN_ID_PATTERN, run_id):
        raise TallyError(f"{what}: {run_id!r} is not a run id (letters, digits, '.', '_', '-')")
    p = Path(path).absolute()  # workers elsewhere do not share this process's directory
    if p.is_dir():
        return RunSource(p, run_id, "spool")
    if p.is_file():
        return RunSource(p, run_id, "ledger")
    raise TallyError(f"{what}: {p} is neither a spool directory nor a ledger file")


def parse_run_source(text: str, what: str = "source") -> RunSource:
    """`SOURCE:RUN` (the last ':' splits them, so a path may hold one)."""
    path, sep, run_id = text.rpartition(":")
    if not sep or not path or not run_id:
        raise TallyError(f"{what} {text!r}: expected SOURCE:RUN, a spool directory or a ledger "
                         "file, a colon, then the run id")
    return run_source(path, run_id, what)


def inputs(src: RunSource, workdir: Path, folder: str = "export") -> Inputs:
    """The run's input files, attempts and manifest fingerprint, and the files left out (a
    ledger's rows are exported under `workdir / folder`)."""
    if src.kind == "spool":
        return spool_inputs(src.path, src.run_id)
    return ledger_inputs(src.path, src.run_id, workdir, folder)
