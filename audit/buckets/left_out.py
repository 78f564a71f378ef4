"""The input files a job left out, counted by kind (`files_left_out`): the one rule reconcile,
diff and exposure report alike."""

from __future__ import annotations

from typing import Any

from tally.audit.buckets.partials import EXAMPLES


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
