"""`tally manifest`: the Beam job writing a corpus' manifest with its fingerprint."""

from __future__ import annotations

import argparse
import json

from tally.audit.commands.common import print_json, progress
from tally.audit.commands.options import examples, quiet_json, runner, runner_args


def _cmd_manifest(args: argparse.Namespace) -> int:
    from tally.pipeline.formats import Fields
    from tally.pipeline.manifest import build_manifest

    named = {k: getattr(args, f"{k}_field") for k in ("text", "tokens", "id", "domain")}
    fields = Fields(**{k: v for k, v in named.items() if v is not None}) if any(
        v is not None for v in named.values()) else None
    summary = build_manifest(args.corpus, args.output, runner=runner(args),
                             chunk_records=args.chunk_records, progress=progress(args),
                             sequence_length=args.sequence_length, dtype=args.dtype,
                             fmt=args.format, fields=fields, tokenizer=args.tokenizer,
                             bos_id=args.bos_id, eos_id=args.eos_id,
                             special_tokens=args.special_tokens, max_tokens=args.max_tokens,
                             domains=args.domain)
    if args.json:
        print_json({"path": str(summary.path), "records": summary.records,
                     "train_records": summary.train_records, "tokens": summary.tokens,
                     "fingerprint": summary.fingerprint, "seconds": round(summary.seconds, 3),
                     "content_basis": json.loads(summary.basis.to_json())})
        return 0
    print(summary.line())
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("manifest", help="Beam job: the corpus manifest with its fingerprint")
    s.add_argument("corpus", nargs="+",
                   help="corpus directory (Tally's *.array_record / *.parquet token shards, "
                        "or a text corpus: Dolma JSON lines (.jsonl/.json, .gz, .zst), Parquet "
                        "with a text column, a Hugging Face save_to_disk directory, ArrayRecord "
                        "files of tf.train.Example, MosaicML MDS shards), an OLMo numpy token "
                        "mix's index (*.json), or OLMo token files (several, or a directory of "
                        "*.npy) with --sequence-length and --dtype")
    s.add_argument("-o", "--output", required=True, help="manifest Parquet file to write")
    s.add_argument("--domain", action="append", metavar="NAME=GLOB",
                   help="every record of the files matching GLOB (their path under the corpus "
                        "directory, or whole) is in domain NAME; repeat it for each component "
                        "of a mixture (MaxText's grain_train_files patterns), the first match "
                        "wins")
    s.add_argument("--chunk-records", type=int, default=20_000,
                   help="records per pipeline element (default 20000)")
    g = s.add_argument_group("OLMo token files without an index")
    g.add_argument("--sequence-length", type=int,
                   help="tokens per instance: each file holds n_tokens // L instances")
    g.add_argument("--dtype", help="the files' token dtype, little-endian: uint16 or uint32 "
                                   "(also uint8, int32)")
    from tally.pipeline.formats import FORMATS

    g = s.add_argument_group(
        "text corpora (Dolma JSON lines, Parquet, Hugging Face datasets, ...)",
        "Each document is hashed over the token ids the run's tokenizer makes of it, with the "
        "run's settings, or over its UTF-8 bytes without --tokenizer; a token field is hashed "
        "as it is.")
    g.add_argument("--format", choices=FORMATS,
                   help="the files' format (default: found by their names or layout)")
    g.add_argument("--tokenizer", help="the run's tokenizer: a tokenizer.json file, a directory "
                                       "holding one, or a name in the local Hugging Face cache "
                                       "(never downloaded)")
    g.add_argument("--text-field", help="the field holding each document's text (default text)")
    g.add_argument("--tokens-field", help="a field holding token ids instead (e.g. input_ids)")
    g.add_argument("--id-field", help="the field holding the document's id, kept as doc_id "
                                      "(default id; absent: null)")
    g.add_argument("--domain-field", help="the field holding the domain (default: domain, else "
                                          "Dolma's source, else 'default')")
    g.add_argument("--bos-id", type=int, help="token id the loader puts before each document")
    g.add_argument("--eos-id", type=int, help="token id the loader puts after each document")
    g.add_argument("--special-tokens", action="store_true",
                   help="encode with the tokenizer's own special tokens "
                        "(add_special_tokens=True)")
    g.add_argument("--max-tokens", type=int,
                   help="keep each document's first N token ids, as a loader that truncates")
    quiet_json(s)
    runner_args(s)
    examples(s, "tally manifest corpus -o manifest.parquet",
             "tally manifest dolma/documents -o dolma.parquet --tokenizer tokenizer.json "
             "--eos-id 50279",
             "tally manifest data/ -o m.parquet --format parquet_text --tokens-field input_ids",
             "tally manifest /data/corpus -o /data/manifest.parquet --runner dask --workers 4 "
             "-q --json",
             "tally manifest /data/mix/index.json -o /data/mix-manifest.parquet",
             "tally manifest /data/mix/*.npy --sequence-length 8192 --dtype uint32 "
             "-o mix-manifest.parquet")
    s.set_defaults(func=_cmd_manifest)
