"""The trainer's commands: `tally train` (the keyed loader's audited run) and `tally compare`
(two checkpoints on the same held-out inputs)."""

from __future__ import annotations

import argparse

from tally.audit.commands.common import print_json, progress
from tally.audit.commands.options import examples, quiet_json


def _cmd_train(args: argparse.Namespace) -> int:
    from tally.trainer.config import TrainConfig
    from tally.trainer.launch import launch

    cfg = TrainConfig.load(args.config, args.overrides)
    return launch(cfg, args.hosts, resume=args.resume, force=args.force)


def _cmd_compare(args: argparse.Namespace) -> int:
    from tally.trainer.evaluate import compare

    out = compare(args.a, args.b, corpus=args.corpus, records=args.records,
                  progress=progress(args))
    if args.json:
        print_json(out)
    else:
        print(f"mean token-level KL(A || B) = {out['mean_kl']:.4f} nats over {out['tokens']:,} "
              f"held-out tokens ({out['records']} records); A: {out['a']} step {out['step_a']}, "
              f"B: {out['b']} step {out['step_b']}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("train", help="train on the keyed loader, audited: H host processes, "
                                     "data parallel")
    s.add_argument("--config", help="JSON file of TrainConfig fields (trainer/config.py)")
    s.add_argument("--hosts", type=int, default=1, help="host processes (default 1)")
    s.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint as a new attempt")
    s.add_argument("--force", action="store_true",
                   help="resume on another host count even if the pre-flight check fails "
                        "(recorded in the ledger)")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    examples(s, "tally train --config train.json --hosts 2 steps=12",
             "tally train --config train.json --hosts 2 --resume steps=16")
    s.set_defaults(func=_cmd_train)

    s = sub.add_parser("compare", help="mean token-level KL divergence between two "
                                       "checkpoints on the same held-out inputs")
    s.add_argument("a", help="checkpoint directory (latest step) or one step's directory")
    s.add_argument("b", help="checkpoint directory (latest step) or one step's directory")
    s.add_argument("--corpus", help="corpus for the held-out inputs (default: A's config)")
    s.add_argument("--records", type=int, help="held-out records (default: A's eval_records)")
    quiet_json(s, quiet="no progress")
    examples(s, "tally compare ckpt/6 ckpt/12", "tally compare ckpt-a ckpt-b --records 64 --json")
    s.set_defaults(func=_cmd_compare)
