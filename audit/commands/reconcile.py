"""`tally reconcile`: the Beam job auditing a run's consumption against the manifest."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tally.audit.commands.common import print_json, progress
from tally.audit.commands.options import (
    examples,
    http_url,
    non_negative_int,
    output_dir,
    positive_float,
    quiet_json,
    runner,
    runner_args,
)

# The process id of the `tally serve` that started a live reconcile: it stops when that goes.
FOLLOW_PARENT = "TALLY_FOLLOW_PARENT"


def _cmd_follow(args: argparse.Namespace) -> int:
    """The report kept current as the spool grows, round by round, until interrupted."""
    from tally.audit.core.errors import TallyError
    from tally.audit.reconcile.follow import Follower

    if args.spool is None or args.at_step is not None:
        raise TallyError("--follow reads a spool as it grows: give --spool, without --at-step")
    if not Path(args.spool).is_dir():
        raise TallyError(f"spool {args.spool} is not a directory")
    if not Path(args.manifest).exists():
        raise TallyError(f"no manifest at {args.manifest}")
    follower = Follower(Path(args.spool), args.manifest, args.run, Path(args.output),
                        memory_gb=args.memory_gb, api_url=args.api_url)
    if follower.set_aside:
        print(f"tally: live reconcile: the checkpoint in {follower.work} was set aside, "
              f"{follower.set_aside}; a full pass follows", file=sys.stderr, flush=True)
    # Started by `tally serve` (api/findings.py): it goes when the service does, even killed.
    parent = int(os.environ.get(FOLLOW_PARENT, "0") or 0)
    said = None
    while not parent or os.getppid() == parent:
        t0 = time.monotonic()
        try:
            report = follower.round()
            said = None
        except TallyError as exc:  # no segment file yet, or a spool the job refuses
            report = None
            follower.waiting(str(exc))
            if str(exc) != said:  # once a reason, the last report standing meanwhile
                print(f"tally: live reconcile waits: {exc}", file=sys.stderr, flush=True)
                said = str(exc)
        if report is not None and not args.quiet:
            line = {k: report.get(k) for k in ("run_id", "verdict", "first_bad_step")} | {
                "as_of_step": report["consumption"]["last_step"], "round": follower.rounds,
                "findings": [f["code"] for f in report["findings"]]}
            print(json.dumps(line) if args.json else
                  f"round {line['round']}: {line['verdict']} as of step {line['as_of_step']}"
                  f" ({', '.join(line['findings']) or 'no findings'})", flush=True)
        time.sleep(max(0.0, args.follow - (time.monotonic() - t0)))
    follower.checkpoint()  # the service that started it is gone: the next one resumes here
    return 0


def _cmd_reconcile(args: argparse.Namespace) -> int:
    from tally.audit.reconcile import reconcile
    from tally.audit.reconcile.report import summary

    if args.follow is not None:
        return _cmd_follow(args)

    report = reconcile(run_id=args.run, manifest=args.manifest, out=args.output,
                       spool=args.spool, ledger=args.ledger, at_step=args.at_step,
                       runner=runner(args), memory_gb=args.memory_gb,
                       progress=progress(args), api_url=args.api_url)
    out = Path(args.output)
    if args.json:
        print_json({k: report.get(k) for k in ("run_id", "verdict", "findings", "coverage",
                                                "first_bad_step")}
                   | {"report": str(out / "report.json"), "html": str(out / "report.html")})
    else:
        print(summary(report, out))
    return 0 if report["verdict"] != "FAIL" or not args.strict else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("reconcile", help="Beam job: a run's consumption vs the manifest, "
                                         "with a report")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--spool", help="spool directory (published segment files are read)")
    src.add_argument("--ledger", help="DuckDB ledger file (exported, then read)")
    s.add_argument("--manifest", required=True, help="manifest Parquet file")
    s.add_argument("--run", required=True, help="run id")
    s.add_argument("-o", "--output", required=True, type=output_dir, help="report directory")
    s.add_argument("--at-step", type=non_negative_int, help="audit as of this step")
    s.add_argument("--strict", action="store_true", help="exit 1 when the verdict is FAIL")
    s.add_argument("--follow", type=positive_float, metavar="SECONDS",
                   help="keep the report current as the spool grows: a round every SECONDS "
                        "folds in only the files published since (the live service's "
                        "findings), until interrupted; --spool only, no records/ table; "
                        "started again over the same output, it resumes from its checkpoint "
                        "in OUT/.follow/")
    s.add_argument("--memory-gb", type=positive_float, default=3.0,
                   help="memory budget: sizes the record-key buckets so that the buckets "
                        "in memory at once stay within it (default 3)")
    s.add_argument("--api-url", type=http_url,
                   help="the `tally serve` that report.html's evidence links open (e.g. "
                        "http://tally.internal:8000); without it they lead to the page's own "
                        "Evidence tables")
    quiet_json(s)
    runner_args(s)
    examples(s, "tally reconcile --spool spool --manifest manifest.parquet --run exp1 -o report",
             "tally reconcile --ledger ledger.duckdb --manifest manifest.parquet --run exp1 -o "
             "report --at-step 20 --strict -q --json",
             "tally reconcile --spool spool --manifest manifest.parquet --run exp1 -o live "
             "--follow 30")
    s.set_defaults(func=_cmd_reconcile)
