"""The input files a job left out, counted by kind (`files_left_out`) and said as findings
(`left_out_findings`): the one rule reconcile, diff and exposure report alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tally.audit.buckets.partials import EXAMPLES
from tally.audit.core.words import plural, were


def files_left_out(left_out: list[tuple[str, str]], skipped_files: list[tuple[str, str]],
                   skipped: int) -> dict[str, Any]:
    """Files a job reading a spool did not count, by kind: unreadable ones (their rows may be
    missing), duplicates of files it counted (their rows are counted once, from the other file)
    and files of another training under the run's id (quarantined by ingest:
    tally.audit.ledger.ingest.is_reuse). `left_out` are the files planning set aside
    (tally.audit.buckets.plan.Inputs), with why; `skipped` the files the workers could not read,
    `skipped_files` examples of them. The one rule reconcile, diff and exposure report alike."""
    from tally.audit.ledger.ingest import is_reuse

    left = left_out + skipped_files
    duplicates = sum(1 for _, why in left_out if why.startswith("duplicate:"))
    reused = sum(1 for _, why in left_out if is_reuse(why))
    unreadable = len(left_out) - duplicates - reused + skipped
    return {"skipped_files": [f"{path}: {why}" for path, why in left[:EXAMPLES]],
            "unreadable_files": unreadable, "duplicate_files": duplicates,
            "reused_files": reused}


def left_out_findings(cons: dict[str, Any], add: Callable[..., Any], *, whose: str = "this run",
                      missing_from: str = "every number of this report",
                      **numbers: Any) -> None:
    """FAIL files_unreadable, FAIL run_id_reused and WARN duplicate_files from what
    files_left_out counted: how reconcile, diff and exposure say it."""
    from tally.audit.ledger.ingest import is_reuse

    def first(kind: str) -> str:
        said = [s if len(s) < 240 else s[:237] + "..." for s in cons["skipped_files"]
                if _left_out_kind(s, is_reuse) == kind]
        return "; ".join(said[:3])

    bad, dups = cons.get("unreadable_files", 0), cons.get("duplicate_files", 0)
    reused = cons.get("reused_files", 0)
    if bad:
        add("FAIL", "files_unreadable",
            f"{plural(bad, 'spool file')} of {whose} could not be read and {were(bad)} left "
            f"out: the rows they hold are missing from {missing_from}. {first('unreadable')}",
            files=bad, **numbers)
    if reused:
        add("FAIL", "run_id_reused",
            f"{plural(reused, 'spool file')} under the id of {whose} "
            f"{'comes' if reused == 1 else 'come'} from another training (its run id reused "
            f"after the spool was removed) and {were(reused)} left out: the rows of that "
            f"training are in none of {missing_from}; give it its own run id. "
            f"{first('reused')}", files=reused, **numbers)
    if dups:
        add("WARN", "duplicate_files",
            f"{plural(dups, 'spool file')} of {whose} {'repeats' if dups == 1 else 'repeat'} "
            f"host-steps already read from another file "
            f"(a copy of a file, or a writer restarted within its attempt); each host-step was "
            f"counted once. {first('duplicate')}", files=dups, **numbers)


def _left_out_kind(said: str, is_reuse: Callable[[str], bool]) -> str:
    """'duplicate', 'reused' or 'unreadable', from one "path: why" example."""
    why = said.split(": ", 1)[-1]
    return "duplicate" if why.startswith("duplicate:") else \
        "reused" if is_reuse(why) else "unreadable"
