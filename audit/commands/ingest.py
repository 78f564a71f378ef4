"""`tally ingest`: new spool files into a ledger, exactly once."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tally.audit.commands.common import SIGNALS, ledger_errors, log_to_stderr, print_json, progress
from tally.audit.commands.options import examples, log_format, quiet_json
from tally.audit.core.errors import TallyError


def _cmd_ingest(args: argparse.Namespace) -> int:
    from tally.audit.ledger.database import Ledger
    from tally.audit.ledger.ingest import ingest
    from tally.audit.ledger.integrity import IngestIntegrity
    from tally.pipeline.manifest_file import ManifestKeyIndex

    spool = Path(args.spool)
    if not spool.is_dir():
        raise TallyError(f"spool {spool} is not a directory")
    if args.batch_rows < 1:
        raise TallyError("--batch-rows must be >= 1")
    log_to_stderr(logging.WARNING if args.quiet else logging.INFO, args.log_format)
    # Ctrl-C and SIGTERM end the ingest after the batch under way (one transaction): a
    # KeyboardInterrupt raised inside it interrupted DuckDB mid-statement, whose error, or the
    # ROLLBACK's "no transaction is active" after it, came out as a traceback and exit 1 (14
    # of 28 tries).
    stop = SIGNALS.graceful(progress=progress(args))
    with ledger_errors(args.ledger), Ledger(args.ledger) as ledger:
        integrity = None
        if args.manifest:  # opened now: a manifest that cannot be read is said before ingest
            index = ManifestKeyIndex(args.manifest, Path(f"{args.ledger}.integrity"))
            integrity = IngestIntegrity(lambda: index)
        if stop.is_set():
            raise KeyboardInterrupt
        result = ingest(spool, ledger, progress=progress(args), batch_rows=args.batch_rows,
                        final=True, stop=stop, integrity=integrity)
        checked = {} if integrity is None else _integrity(ledger, index.fingerprint)
    if stop.is_set():
        raise KeyboardInterrupt
    if args.json:
        print_json({"files": result.files, "rows": result.rows, "already": result.already,
                     "seconds": round(result.seconds, 3),
                     "quarantined": [{"path": p, "reason": r} for p, r in result.quarantined],
                     **({"integrity": checked} if integrity is not None else {})})
        return 0
    for rel, reason in result.quarantined:
        print(f"quarantined {rel}: {reason}", file=sys.stderr)
    print(result.summary())
    for run_id, t in checked.items():
        print(f"integrity of {run_id}: " + _said(t))
    return 0


def _integrity(ledger, fingerprint: str) -> dict[str, dict]:
    from tally.audit.ledger.integrity import totals

    cur = ledger.cursor()
    try:
        return {run_id: totals(cur, run, fingerprint) for run, run_id in cur.execute(
            "SELECT run, run_id FROM runs ORDER BY run_id").fetchall()}
    finally:
        cur.close()


def _said(t: dict) -> str:
    """A run's integrity at ingest in words (one line)."""
    if t["skipped"]:
        return f"not checked: {t['skipped']}"
    from tally.audit.core.words import plural

    more = "at least " if t["keys_at_least"] else ""
    parts = [f"{plural(t['hash_mismatches'], 'hash mismatch', 'hash mismatches')} of "
             f"{t['hash_checked']:,} records checked" if t["hashes_skipped"] is None else
             f"hashes not compared ({t['hashes_skipped']})",
             more + plural(t["unknown_keys"], "unknown key"),
             more + plural(t["heldout_consumed_records"], "held-out record") + " trained on"]
    return "; ".join(parts) + f" ({t['files_checked']:,} of {t['files']:,} files checked)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("ingest", help="ingest new spool files into a ledger, exactly once")
    s.add_argument("spool", help="spool directory the training hosts write to")
    s.add_argument("--ledger", required=True, help="DuckDB ledger file (created if missing)")
    quiet_json(s, quiet="no progress bar")
    s.add_argument("--batch-rows", type=int, default=2_000_000,  # ledger.ingest.BATCH_ROWS
                   help="rows per transaction (files are never split; default 2,000,000)")
    s.add_argument("--manifest", help="manifest Parquet file: check each file's rows against it "
                   "as they are ingested (hash mismatches, unknown keys, held-out records)")
    log_format(s)
    examples(s, "tally ingest spool --ledger ledger.duckdb",
             "tally ingest spool --ledger ledger.duckdb --manifest manifest.parquet",
             "tally ingest /data/spool --ledger /data/ledger.duckdb -q --json")
    s.set_defaults(func=_cmd_ingest)
