"""`tally demo`: a small end-to-end run on embedded defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

from tally.audit.commands.options import examples


def _cmd_demo(args: argparse.Namespace) -> int:
    from tally.audit.demo import run_demo

    run_demo(Path(args.out), records=args.records, keep_serving=args.keep_serving)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("demo", help="a small end-to-end run on embedded defaults")
    s.add_argument("--out", default="tally-demo", help="working directory (default: tally-demo)")
    s.add_argument("--records", type=int, default=2000, help="corpus size (default 2000)")
    s.add_argument("--keep-serving", action="store_true",
                   help="keep the API service and its dashboard up until Ctrl-C")
    examples(s, "tally demo", "tally demo --out /tmp/tally-demo --records 640 --keep-serving")
    s.set_defaults(func=_cmd_demo)
