"""The post-hoc audits: `tally diff` (did two runs consume the same records, step by step?) and
`tally exposure` (which documents did these runs train on?)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tally.audit.commands.common import print_json
from tally.audit.commands.options import (
    non_negative_int,
    output_dir,
    positive_float,
    quiet_json,
    runner,
    runner_args,
)


def _cmd_diff(args: argparse.Namespace) -> int:
    from tally.audit.posthoc.diff import diff
    from tally.audit.posthoc.diff_report import summary
    from tally.audit.posthoc.sources import parse_run_source

    d = diff(a=parse_run_source(args.a, "--a"), b=parse_run_source(args.b, "--b"),
             manifest=args.manifest, out=args.output, at_step=args.at_step, window=args.window,
             runner=runner(args), memory_gb=args.memory_gb)
    out = Path(args.output)
    if args.json:
        print_json({k: d.get(k) for k in ("status", "verdict", "findings", "steps_compared",
                                           "identical_steps", "first_divergent_step")}
                   | {"diff": str(out / "diff.json"), "html": str(out / "diff.html")})
    else:
        print(summary(d, out))
    return 1 if args.strict and (d["status"] != "identical" or d["verdict"] == "FAIL") else 0


def _cmd_exposure(args: argparse.Namespace) -> int:
    from tally.audit.posthoc.exposure import exposure, summary

    result = exposure(manifest=args.manifest, docs=args.docs, runs=args.run, out=args.output,
                      spool=args.spool, ledger=args.ledger, eos_token_id=args.eos_token_id,
                      text_field=args.text_field, id_field=args.id_field,
                      tokenizer=args.tokenizer)
    if args.json:
        print_json(result)
    else:
        print(summary(result, Path(args.output)))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "diff", help="Beam job: did two runs consume the same records, step by step?",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compare two runs over one manifest: per step (identical or not, the first "
                    "divergent step, Jaccard similarity), per record (exposures in A vs B), "
                    "per epoch, window and domain. Writes OUT/diff.json, Parquet tables and "
                    "OUT/diff.html.")
    s.add_argument("--manifest", required=True, help="manifest Parquet file")
    s.add_argument("-o", "--output", required=True, type=output_dir, help="diff directory")
    s.add_argument("--a", required=True, metavar="SOURCE:RUN",
                   help="run A: a spool directory or a ledger file, ':', the run id")
    s.add_argument("--b", required=True, metavar="SOURCE:RUN", help="run B, likewise")
    s.add_argument("--at-step", type=non_negative_int,
                   help="compare both runs as of this step")
    s.add_argument("--window", type=int,
                   help="steps per window for the mix and order comparisons (default: about "
                        "20 windows)")
    s.add_argument("--strict", action="store_true",
                   help="exit 1 unless the runs are identical")
    s.add_argument("--memory-gb", type=positive_float, default=3.0,
                   help="memory budget for the record-key buckets (default 3)")
    quiet_json(s)
    runner_args(s)
    s.epilog = ("examples:\n"
                "  tally diff --manifest m.parquet -o diff --a spool:exp1 --b ledger.duckdb:exp2\n"
                "  tally diff --manifest m.parquet -o diff --a spool-jax:run --b "
                "spool-torch:run --strict --runner dask --workers 2 -q --json\n\n" + s.epilog)
    s.set_defaults(func=_cmd_diff)

    s = sub.add_parser(
        "exposure", help="which documents did these runs train on? (exact content match)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Match documents to corpus records by exact content hash (every duplicate "
                    "record counts) and report how often each run consumed them, at which "
                    "steps, on which hosts, in which epochs. Writes OUT/exposure.parquet and "
                    "OUT/exposure.json.",
        epilog="examples:\n"
               "  tally exposure --manifest m.parquet --spool spool --run exp1 --docs evalset "
               "-o exposure\n"
               "  tally exposure --manifest m.parquet --ledger ledger.duckdb --run exp1 --run "
               "exp2 --docs hashes.parquet -o exposure\n"
               "  tally exposure --manifest mix.parquet --spool spool --run exp1 --docs "
               "evalset.parquet --eos-token-id 100257 -o exposure\n"
               "  tally exposure --manifest m.parquet --spool spool --run exp1 --docs "
               "evalset.jsonl.zst --tokenizer tokenizer.json -o exposure")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--spool", help="spool directory the runs were written to")
    src.add_argument("--ledger", help="DuckDB ledger file (opened read-only)")
    s.add_argument("--manifest", required=True, help="manifest Parquet file of the corpus")
    s.add_argument("--run", required=True, action="append",
                   help="run id (repeat for several runs)")
    s.add_argument("--docs", required=True,
                   help="the documents: a corpus directory in Tally's formats, a Parquet file "
                        "with a content_hash, record_key or tokens column, or text: JSON lines "
                        "(.jsonl, .json; .gz, .zst) or Parquet with a text column, hashed as "
                        "the manifest hashes its documents")
    s.add_argument("--text-field", default="text",
                   help="documents given as text: the field that holds it (default text)")
    s.add_argument("--id-field", default="id",
                   help="documents given as text: the field of each one's own id (default id)")
    s.add_argument("--tokenizer",
                   help="documents given as text, against a manifest that hashes token ids "
                        "of a tokenizer: that tokenizer (a tokenizer.json; its settings are "
                        "read from the manifest)")
    s.add_argument("--eos-token-id", type=int,
                   help="an OLMo mix's manifest: look for each document inside the mix, as "
                        "the tokens between two EOS tokens, and match it to the instances that "
                        "hold them")
    s.add_argument("-o", "--output", required=True, type=output_dir, help="output directory")
    quiet_json(s)
    s.set_defaults(func=_cmd_exposure)
