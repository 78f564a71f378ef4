"""`tally ledger`: a ledger's runs, attempts, hosts, step ranges and row counts."""

from __future__ import annotations

import argparse
from pathlib import Path

from tally.audit.commands.common import ledger_errors, print_json
from tally.audit.commands.options import examples, quiet_json


def _cmd_ledger(args: argparse.Namespace) -> int:
    from tally.audit.ledger.database import Ledger

    with ledger_errors(args.path), Ledger(args.path, read_only=True) as ledger:
        ov = ledger.overview()
    if args.json:
        print_json(ov)
        return 0
    print(format_overview(ov, args.path))
    return 0


def format_overview(ov: dict, path: str | Path) -> str:
    lines = [f"ledger {path}: {len(ov['runs'])} run(s)"]
    for r in ov["runs"]:
        lines.append(f"run {r['run_id']}  manifest {r['manifest_fingerprint'] or '-'}")
        for a in r["attempts"]:
            start = ("fresh start" if a["resumed_from_step"] is None
                     else f"resumed from step {a['resumed_from_step']}")
            back = ("" if a["rolled_back_from_step"] is None else
                    f", steps >= {a['rolled_back_from_step']} rolled back "
                    f"({a['rolled_back_segments']:,} segments)")
            lines.append(f"  attempt {a['attempt']}: {start}, {a['host_count']} host(s), "
                         f"{a['segments']:,} segments{back}"
                         + (", replayed (written by tally replay, not by the run)"
                            if a.get("replayed") else ""))
            for h in a["hosts"]:
                lines.append(f"    host {h['host']}: steps {h['first_step']}..{h['last_step']}, "
                             f"{h['files']} file(s), {h['segments']:,} segments, "
                             f"{h['tokens']:,} tokens")
    if ov["quarantine"]:
        lines.append(f"quarantined files ({len(ov['quarantine'])}):")
        lines += [f"  {q['path']}: {q['reason']}" for q in ov["quarantine"]]
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("ledger", help="show runs, attempts, hosts, step ranges and row counts")
    s.add_argument("path", help="DuckDB ledger file")
    quiet_json(s, quiet=None)
    examples(s, "tally ledger ledger.duckdb", "tally ledger ledger.duckdb --json")
    s.set_defaults(func=_cmd_ledger)
