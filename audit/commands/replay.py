"""`tally replay`: the spool a run's loader fed, written from the loader's own contract without
running the run."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tally.audit.commands.common import print_json
from tally.audit.commands.options import examples, quiet_json


def _cmd_replay(args: argparse.Namespace) -> int:
    from tally.pipeline.replay import ReplaySpec, replay

    spec = ReplaySpec(loader=args.loader, hosts=args.hosts, steps=args.steps,
                      spool=Path(args.spool), run_id=args.run,
                      manifest=Path(args.manifest) if args.manifest else None,
                      hashes=args.hashes, start_step=args.start_step,
                      states=Path(args.states) if args.states else None,
                      ranks_per_node=args.ranks_per_node)
    t0 = time.perf_counter()
    hosts = replay(spec, workers=args.workers)
    seconds = time.perf_counter() - t0
    rows = sum(h.rows for h in hosts)
    steps = [h.last_step for h in hosts if h.last_step is not None]
    out = {"run": args.run, "spool": args.spool, "hosts": len(hosts), "rows": rows,
           "files": sum(h.files for h in hosts),
           "first_step": min((h.first_step for h in hosts if h.first_step is not None),
                             default=None),
           "last_step": max(steps, default=None), "seconds": round(seconds, 3),
           "keys_per_second": round(rows / seconds) if seconds > 0 else None,
           "hashes": args.hashes, "replayed": True}
    if args.json:
        print_json(out)
    else:
        print(f"replayed run {args.run}: {rows:,} record keys of {len(hosts)} host(s), steps "
              f"{out['first_step']}..{out['last_step']}, into {args.spool} in {seconds:.1f} s "
              f"({out['keys_per_second'] or 0:,} keys/s; hashes from the {args.hashes})")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("replay", help="write the spool a run's loader fed (Grain, torch "
                                      "DataLoader, MosaicML Streaming), from the loader's own "
                                      "contract, without running the run")
    s.add_argument("--loader", required=True,
                   help="MODULE:FUNCTION; FUNCTION(host, host_count) returns that host's "
                        "grain.DataLoader, torch DataLoader / StatefulDataLoader, "
                        "(Streaming)DataLoader over a StreamingDataset, litdata "
                        "StreamingDataLoader, or OLMo-core data loader (MODULE importable "
                        "from here or PYTHONPATH)")
    s.add_argument("--hosts", type=int, required=True, help="host count of the run")
    s.add_argument("--steps", type=int, required=True, help="steps to replay on every host")
    s.add_argument("--spool", required=True, help="spool directory to write")
    s.add_argument("--run", required=True, help="run id of the replayed spool")
    s.add_argument("--manifest", help="manifest Parquet file: content hashes and lengths")
    s.add_argument("--hashes", choices=("manifest", "source"), default="manifest",
                   help="take hashes from the manifest (default) or read every record from "
                        "the loader's data source and hash it")
    s.add_argument("--start-step", type=int, default=0,
                   help="the step of each host's first replayed batch when the loader starts "
                        "fresh (a sampler resumed by its own start offset)")
    s.add_argument("--states", help="directory of the loader states a run checkpointed "
                                    "(Grain's process_<h>-of-<H>.json, torch's "
                                    "dataloader_<h>-of-<H>.json|.pt, Streaming's one "
                                    "streaming.json, litdata's litdata_<h>-of-<H>.json, "
                                    "OLMo-core's checkpoint step dir (train/rank<r>.pt)): "
                                    "replay from there")
    s.add_argument("--ranks-per-node", type=int, default=1,
                   help="a Streaming loader's ranks a node: its partition follows the nodes "
                        "(--hosts ranks in all; default 1)")
    s.add_argument("--workers", type=int, help="processes (default: one per core for large "
                                               "replays)")
    quiet_json(s, quiet=None)
    examples(s, "tally replay --loader my_job.data:make_loader --hosts 64 --steps 10000 "
                 "--spool spool --run exp1-replay --manifest manifest.parquet",
             "tally replay --loader my_job.data:make_loader --hosts 8 --steps 500 --spool "
             "spool --run exp1-r2 --manifest m.parquet --states ckpt/1000/data_iter --json")
    s.set_defaults(func=_cmd_replay)
