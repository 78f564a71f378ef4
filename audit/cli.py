"""`tally`: the command line, thin over the audit core."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from audit.errors import TallyError


def _cmd_ingest(args: argparse.Namespace) -> int:
    from audit.ingest import ingest
    from audit.ledger import Ledger

    spool = Path(args.spool)
    if not spool.is_dir():
        raise TallyError(f"spool {spool} is not a directory")
    with Ledger(args.ledger) as ledger:
        result = ingest(spool, ledger, progress=not args.quiet)
    for rel, reason in result.quarantined:
        print(f"quarantined {rel}: {reason}", file=sys.stderr)
    print(result.summary())
    return 0


def _cmd_ledger(args: argparse.Namespace) -> int:
    from audit.ledger import Ledger

    with Ledger(args.path, read_only=True) as ledger:
        ov = ledger.overview()
    if args.json:
        print(json.dumps(ov, indent=2, default=str))
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
                         f"{a['segments']:,} segments{back}")
            for h in a["hosts"]:
                lines.append(f"    host {h['host']}: steps {h['first_step']}..{h['last_step']}, "
                             f"{h['files']} file(s), {h['segments']:,} segments, "
                             f"{h['tokens']:,} tokens")
    if ov["quarantine"]:
        lines.append(f"quarantined files ({len(ov['quarantine'])}):")
        lines += [f"  {q['path']}: {q['reason']}" for q in ov["quarantine"]]
    return "\n".join(lines)


def _cmd_demo(args: argparse.Namespace) -> int:
    from audit.demo import run_demo

    run_demo(Path(args.out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tally", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("ingest", help="ingest new spool files into a ledger, exactly once")
    s.add_argument("spool", help="spool directory the training hosts write to")
    s.add_argument("--ledger", required=True, help="DuckDB ledger file (created if missing)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=_cmd_ingest)

    s = sub.add_parser("ledger", help="show runs, attempts, hosts, step ranges and row counts")
    s.add_argument("path", help="DuckDB ledger file")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=_cmd_ledger)

    s = sub.add_parser("demo", help="a small end-to-end run on embedded defaults")
    s.add_argument("--out", default="tally-demo", help="working directory (default: tally-demo)")
    s.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TallyError as exc:
        print(f"tally: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
