"""`tally corpus synth`: a realistic synthetic corpus."""

from __future__ import annotations

import argparse

from tally.audit.commands.common import print_json
from tally.audit.commands.options import examples, quiet_json


def _cmd_synth(args: argparse.Namespace) -> int:
    from tally.pipeline.synth import synth_corpus

    desc = synth_corpus(args.out, records=args.records, seed=args.seed, shards=args.shards,
                        heldout_fraction=args.heldout_fraction,
                        duplicate_fraction=args.duplicate_fraction, max_len=args.max_len,
                        length_scale=args.length_scale)
    if args.json:
        print_json(desc)
        return 0
    print(f"corpus {args.out}: {desc['records']:,} records ({desc['train_records']:,} train, "
          f"{desc['heldout_records']:,} held out, {desc['duplicates']:,} exact duplicates), "
          f"{desc['tokens']:,} tokens; train records per domain: "
          + ", ".join(f"{k} {v:,}" for k, v in desc["train_records_per_domain"].items()))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("corpus", help="corpus tools")
    examples(s, "tally corpus synth corpus --records 1200")
    corpus = s.add_subparsers(dest="corpus_command", required=True)
    s = corpus.add_parser("synth", help="write a realistic synthetic corpus (ArrayRecord)")
    s.add_argument("out", help="output directory")
    s.add_argument("--records", type=int, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--shards", type=int, default=4, help="train shards (default 4)")
    s.add_argument("--heldout-fraction", type=float, default=0.02)
    s.add_argument("--duplicate-fraction", type=float, default=0.01,
                   help="share of documents that exactly repeat an earlier one")
    s.add_argument("--max-len", type=int, default=8192, help="longest document, tokens")
    s.add_argument("--length-scale", type=float, default=1.0,
                   help="scale every domain's median document length")
    quiet_json(s, quiet=None)
    examples(s, "tally corpus synth corpus --records 1200 --length-scale 0.2 --max-len 512",
             "tally corpus synth /data/corpus --records 1000000 --seed 7 --json")
    s.set_defaults(func=_cmd_synth)
