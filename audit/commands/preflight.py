"""`tally preflight`: before resuming on another topology, shadow-run the loader (Tally's keyed
loader from a checkpoint, or the user's own with --loader) and check the plan against the
ledger."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tally.audit.commands.common import progress
from tally.audit.commands.options import examples, non_negative_int, quiet_json
from tally.audit.core.errors import TallyError


def _cmd_preflight(args: argparse.Namespace) -> int:
    from tally.audit.ledger.database import Ledger
    from tally.audit.preflight import PreflightVerdict

    try:
        if args.loader:
            verdict = _loader_preflight(args)
            print(verdict.to_json() if args.json else verdict.summary())
            return verdict.exit_code
        if args.checkpoint is None:
            raise TallyError("give --checkpoint (a run of Tally's keyed loader) or --loader "
                             "MODULE:FUNCTION (your own Grain, torch or Streaming loader's "
                             "factory)")
        if args.states or args.at_step is not None or args.ranks_per_node != 1:
            raise TallyError("--states, --at-step and --ranks-per-node go with --loader")
        # The keyed loader's check imports Grain: only here, not for --loader.
        from tally.audit.preflight import record_verdict, run_preflight

        cfg = None
        if args.config:
            from tally.trainer.config import TrainConfig
            from tally.trainer.loop import loader_config

            cfg = loader_config(TrainConfig.load(args.config))
        call = dict(run_id=args.run, manifest=args.manifest, checkpoint=args.checkpoint,
                    new_hosts=args.hosts, loader_config=cfg, global_batch=args.global_batch,
                    horizon=args.horizon, workers=args.workers, progress=progress(args))
        if args.record:
            if not Path(args.ledger).is_file():
                raise TallyError(f"no ledger at {args.ledger}")
            with Ledger(args.ledger) as ledger:
                verdict = run_preflight(ledger, **call)
                record_verdict(ledger, verdict, requested_by="cli")
        else:
            verdict = run_preflight(args.ledger, **call)
    except TallyError as exc:
        if args.json:  # a machine reader still gets a verdict to parse
            bad = PreflightVerdict(args.run, "unknown")
            bad.findings.add("UNKNOWN", "bad_input", str(exc))
            print(bad.to_json())
        raise
    print(verdict.to_json() if args.json else verdict.summary())
    return verdict.exit_code


def _loader_preflight(args: argparse.Namespace) -> Any:
    from tally.audit.ledger.database import Ledger
    from tally.audit.preflight import run_loader_preflight

    if args.checkpoint or args.config:
        raise TallyError("--loader plans your own loader: --checkpoint and --config are for "
                         "Tally's keyed loader (give --states or --at-step)")
    call = dict(run_id=args.run, manifest=args.manifest, loader=args.loader,
                new_hosts=args.hosts, at_step=args.at_step, states=args.states,
                horizon=args.horizon, ranks_per_node=args.ranks_per_node)
    if not args.record:
        return run_loader_preflight(args.ledger, **call)
    from tally.audit.preflight import record_verdict  # the keyed check's module (imports Grain)

    if not Path(args.ledger).is_file():
        raise TallyError(f"no ledger at {args.ledger}")
    with Ledger(args.ledger) as ledger:
        verdict = run_loader_preflight(ledger, **call)
        record_verdict(ledger, verdict, requested_by="cli")
    return verdict


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("preflight", help="before resuming on another topology: shadow-run the "
                                         "loader and check the plan against the ledger "
                                         "(exit 0 safe, 1 unsafe, 2 cannot tell)")
    s.add_argument("--run", required=True, help="run id")
    s.add_argument("--ledger", required=True, help="DuckDB ledger file (opened read-only)")
    s.add_argument("--manifest", required=True, help="manifest Parquet file of the run's corpus")
    s.add_argument("--checkpoint",
                   help="checkpoint directory (latest step) or one step's directory, of a run "
                        "on Tally's keyed loader")
    s.add_argument("--hosts", type=int, required=True, help="host count to resume on")
    s.add_argument("--global-batch", type=int, help="global batch on the new topology "
                                                    "(default: the config's)")
    s.add_argument("--horizon", type=int, help="steps to plan (default: to the end of the "
                                               "current epoch, at most 1000)")
    s.add_argument("--config", help="training config JSON (default: the loader config saved "
                                    "in the checkpoint)")
    s.add_argument("--workers", type=int, help="processes for the shadow run (default: one "
                                               "per core for large plans)")
    s.add_argument("--record", action="store_true",
                   help="record the verdict in the ledger (opens it for writing)")
    g = s.add_argument_group("your own loader: Grain, torch DataLoader, MosaicML Streaming, "
                             "litdata, OLMo-core (instead of --checkpoint)")
    g.add_argument("--loader", help="MODULE:FUNCTION; FUNCTION(host, host_count) returns the "
                                    "relaunched job's loader for that host")
    g.add_argument("--states", help="directory of the loader states the run checkpointed "
                                    "(Grain's process_<i>-of-<n>.json, torch's "
                                    "dataloader_<i>-of-<n>.json|.pt: new host h restores old "
                                    "host h %% n's; Streaming's one streaming.json; "
                                    "litdata's litdata_<i>-of-<n>.json; OLMo-core's "
                                    "checkpoint step dir, train/rank<r>.pt)")
    g.add_argument("--ranks-per-node", type=int, default=1,
                   help="a Streaming loader's ranks a node on the new topology (default 1)")
    g.add_argument("--at-step", type=non_negative_int,
                   help="the step of the relaunched loaders' first "
                                               "batch (they start fresh: a sampler resumed "
                                               "by its own start offset)")
    quiet_json(s, json_="machine-readable verdict")
    examples(s, "tally preflight --run exp1 --ledger ledger.duckdb --manifest manifest.parquet "
                 "--checkpoint ckpt --hosts 1",
             "tally preflight --run exp1 --ledger ledger.duckdb --manifest manifest.parquet "
             "--checkpoint ckpt/6 --hosts 4 --global-batch 32 --record -q --json",
             "tally preflight --run olmo1 --ledger ledger.duckdb --manifest manifest.parquet "
             "--loader my_job.data:make_loader --hosts 4 --at-step 1200")
    s.set_defaults(func=_cmd_preflight)
