"""`tally`: the command line, thin over the audit core."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tally.audit.core.errors import TallyError


def _cmd_ingest(args: argparse.Namespace) -> int:
    from tally.audit.ledger.database import Ledger
    from tally.audit.ledger.ingest import ingest

    spool = Path(args.spool)
    if not spool.is_dir():
        raise TallyError(f"spool {spool} is not a directory")
    if args.batch_rows < 1:
        raise TallyError("--batch-rows must be >= 1")
    _log_to_stderr(logging.WARNING if args.quiet else logging.INFO, args.log_format)
    # Ctrl-C and SIGTERM end the ingest after the batch under way (one transaction): a
    # KeyboardInterrupt raised inside it interrupted DuckDB mid-statement, whose error, or the
    # ROLLBACK's "no transaction is active" after it, came out as a traceback and exit 1 (14
    # of 28 tries).
    stop = _SIGNALS.graceful(progress=_progress(args))
    with _ledger_errors(args.ledger), Ledger(args.ledger) as ledger:
        if stop.is_set():
            raise KeyboardInterrupt
        result = ingest(spool, ledger, progress=_progress(args), batch_rows=args.batch_rows,
                        final=True, stop=stop)
    if stop.is_set():
        raise KeyboardInterrupt
    if args.json:
        _print_json({"files": result.files, "rows": result.rows, "already": result.already,
                     "seconds": round(result.seconds, 3),
                     "quarantined": [{"path": p, "reason": r} for p, r in result.quarantined]})
        return 0
    for rel, reason in result.quarantined:
        print(f"quarantined {rel}: {reason}", file=sys.stderr)
    print(result.summary())
    return 0


@contextlib.contextmanager
def _ledger_errors(path: str | Path) -> Iterator[None]:
    """A ledger whose disk is full, or whose file is damaged (truncated, overwritten), said in
    one line naming the file (tally.audit.ledger.database.ledger_error), whether DuckDB finds out at
    open or only when a query reaches the bad block."""
    from tally.audit.ledger.database import ledger_error

    try:
        yield
    except TallyError:  # said already (Ledger's own, at open)
        raise
    except Exception as exc:
        said = ledger_error(path, exc)
        if said is None:
            raise
        raise said from None


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, default=str))


def _progress(args: argparse.Namespace) -> bool:
    """Whether a command shows its progress: never with -q or --json (tally.audit.core.logs and
    tally.pipeline.progress keep redraws to a terminal)."""
    return not getattr(args, "quiet", False) and not getattr(args, "json", False)


def _log_to_stderr(level: int, fmt: str = "text") -> None:
    """Tally's own log lines on stderr for the long-running commands (why a per-record state
    was rebuilt, quarantined files, snapshots written; the service's alerts and live
    reconciles), in `fmt` (tally.audit.core.logs: `tally: [level] ...` or JSON lines)."""
    from tally.audit.core import logs

    log = logging.getLogger("tally")
    for h in list(log.handlers):
        log.removeHandler(h)
    log.addHandler(logs.handler(fmt))
    log.setLevel(level)
    log.propagate = False


def _uvicorn_logs(fmt: str, level: int, access: bool) -> None:
    """uvicorn's own lines in Tally's format at `level` (they went out in uvicorn's, a third
    format in one stream), and its access log (one line a request) when asked."""
    from tally.audit.core import logs

    for name, at, on in (("uvicorn", level, True), ("uvicorn.access", logging.INFO, access)):
        log = logging.getLogger(name)
        for h in list(log.handlers):
            log.removeHandler(h)
        if on:
            log.addHandler(logs.handler(fmt, at))
        log.propagate = False


def _cmd_ledger(args: argparse.Namespace) -> int:
    from tally.audit.ledger.database import Ledger

    with _ledger_errors(args.path), Ledger(args.path, read_only=True) as ledger:
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


def _cmd_train(args: argparse.Namespace) -> int:
    from tally.trainer.config import TrainConfig
    from tally.trainer.launch import launch

    cfg = TrainConfig.load(args.config, args.overrides)
    return launch(cfg, args.hosts, resume=args.resume, force=args.force)


def _cmd_compare(args: argparse.Namespace) -> int:
    from tally.trainer.evaluate import compare

    out = compare(args.a, args.b, corpus=args.corpus, records=args.records,
                  progress=_progress(args))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"mean token-level KL(A || B) = {out['mean_kl']:.4f} nats over {out['tokens']:,} "
              f"held-out tokens ({out['records']} records); A: {out['a']} step {out['step_a']}, "
              f"B: {out['b']} step {out['step_b']}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from tally.audit.demo import run_demo

    run_demo(Path(args.out), records=args.records, keep_serving=args.keep_serving)
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from tally.pipeline.synth import synth_corpus

    desc = synth_corpus(args.out, records=args.records, seed=args.seed, shards=args.shards,
                        heldout_fraction=args.heldout_fraction,
                        duplicate_fraction=args.duplicate_fraction, max_len=args.max_len,
                        length_scale=args.length_scale)
    if args.json:
        _print_json(desc)
        return 0
    print(f"corpus {args.out}: {desc['records']:,} records ({desc['train_records']:,} train, "
          f"{desc['heldout_records']:,} held out, {desc['duplicates']:,} exact duplicates), "
          f"{desc['tokens']:,} tokens; train records per domain: "
          + ", ".join(f"{k} {v:,}" for k, v in desc["train_records_per_domain"].items()))
    return 0


def _cmd_manifest(args: argparse.Namespace) -> int:
    from tally.pipeline.formats import Fields
    from tally.pipeline.manifest import build_manifest

    named = {k: getattr(args, f"{k}_field") for k in ("text", "tokens", "id", "domain")}
    fields = Fields(**{k: v for k, v in named.items() if v is not None}) if any(
        v is not None for v in named.values()) else None
    summary = build_manifest(args.corpus, args.output, runner=_runner(args),
                             chunk_records=args.chunk_records, progress=_progress(args),
                             sequence_length=args.sequence_length, dtype=args.dtype,
                             fmt=args.format, fields=fields, tokenizer=args.tokenizer,
                             bos_id=args.bos_id, eos_id=args.eos_id,
                             special_tokens=args.special_tokens, max_tokens=args.max_tokens)
    if args.json:
        _print_json({"path": str(summary.path), "records": summary.records,
                     "train_records": summary.train_records, "tokens": summary.tokens,
                     "fingerprint": summary.fingerprint, "seconds": round(summary.seconds, 3),
                     "content_basis": json.loads(summary.basis.to_json())})
        return 0
    print(summary.line())
    return 0


def _cmd_reconcile(args: argparse.Namespace) -> int:
    from tally.audit.reconcile import reconcile
    from tally.audit.reconcile.report import summary

    report = reconcile(run_id=args.run, manifest=args.manifest, out=args.output,
                       spool=args.spool, ledger=args.ledger, at_step=args.at_step,
                       runner=_runner(args), memory_gb=args.memory_gb,
                       progress=_progress(args), api_url=args.api_url)
    out = Path(args.output)
    if args.json:
        _print_json({k: report.get(k) for k in ("run_id", "verdict", "findings", "coverage",
                                                "first_bad_step")}
                    | {"report": str(out / "report.json"), "html": str(out / "report.html")})
    else:
        print(summary(report, out))
    return 0 if report["verdict"] != "FAIL" or not args.strict else 1


def _cmd_diff(args: argparse.Namespace) -> int:
    from tally.audit.posthoc.diff import diff
    from tally.audit.posthoc.diff_report import summary
    from tally.audit.posthoc.sources import parse_run_source

    d = diff(a=parse_run_source(args.a, "--a"), b=parse_run_source(args.b, "--b"),
             manifest=args.manifest, out=args.output, at_step=args.at_step, window=args.window,
             runner=_runner(args), memory_gb=args.memory_gb)
    out = Path(args.output)
    if args.json:
        _print_json({k: d.get(k) for k in ("status", "verdict", "findings", "steps_compared",
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
        _print_json(result)
    else:
        print(summary(result, Path(args.output)))
    return 0


def _add_posthoc_parsers(sub: argparse._SubParsersAction) -> None:
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
    _quiet_json(s)
    _add_runner_args(s)
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
    _quiet_json(s)
    s.set_defaults(func=_cmd_exposure)


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tally.api.alerts import Thresholds
    from tally.api.app import check_settings, create_app
    from tally.audit.ledger.database import Ledger

    off = lambda v: None if v is not None and v < 0 else v  # noqa: E731
    th = Thresholds(epoch_duplicates=off(args.max_epoch_duplicates),
                    host_overlap=off(args.max_host_overlap),
                    ingest_lag_seconds=off(args.max_ingest_lag),
                    coverage_behind=off(args.max_coverage_behind))
    token = args.token or os.environ.get("TALLY_API_TOKEN") or None
    # Everything that can be checked is checked before the ledger is opened: a failed start
    # creates nothing.
    check_settings(spool=args.spool, manifest=args.manifest, records=args.records,
                   reports=args.reports, checkpoints=args.checkpoints, webhook=args.webhook)
    _check_port(args.host, args.port)
    from tally.pipeline.progress import Progress

    level = getattr(logging, args.log_level.upper(), 5)  # uvicorn's trace: below debug
    # Tally's own news (alerts starting and stopping, live reconciles finished, quarantined
    # files, slow rounds) at info, unless --log-level asks for less, or -q.
    _log_to_stderr(logging.WARNING if args.quiet else min(level, logging.INFO)
                   if level <= logging.WARNING else level, args.log_format)
    _uvicorn_logs(args.log_format, logging.ERROR if args.quiet else level, args.access_log)
    with _ledger_errors(args.ledger), Ledger(args.ledger) as ledger:
        with Progress("serve", _progress(args)) as bar:
            # The per-record state is loaded from the ledger first (seconds for millions of
            # records), before the first request.
            bar.stage(f"loading the state of {args.ledger}")
            app = create_app(ledger, spool=args.spool, manifest=args.manifest,
                             records=args.records, reports=args.reports, token=token,
                             thresholds=th, webhook=args.webhook, interval=args.interval,
                             checkpoints=args.checkpoints,
                             preflight_seconds=args.preflight_seconds,
                             max_round_seconds=args.max_round_seconds,
                             findings_every=args.findings_every,
                             metrics_hosts=args.metrics_hosts)
        print(f"tally serve: http://{args.host}:{args.port}/ (ledger {args.ledger}"
              + (f", ingesting {args.spool}" if args.spool else "") + ")", flush=True)
        logging.getLogger("tally.api").info(
            "serving http://%s:%s/", args.host, args.port,
            extra={"ledger": str(args.ledger), "spool": args.spool})
        # uvicorn takes SIGINT and SIGTERM while it runs, shuts down (the app's state snapshot
        # is saved then), gives them back and raises the one it got again: ours, which stops
        # this command as Ctrl-C does. SIGTERM (docker stop, systemd) ended the process there
        # before (status 143), the ledger unclosed, so its lookup index's runs in memory were
        # never written; uvicorn also swallowed SIGINT's KeyboardInterrupt (status 0).
        # log_config None: uvicorn's loggers keep the handlers set above; its level is the
        # lowest either log needs (each handler keeps its own).
        uvicorn.run(app, host=args.host, port=args.port, log_config=None,
                    access_log=args.access_log,
                    log_level=min(logging.ERROR if args.quiet else level,
                                  logging.INFO if args.access_log else logging.CRITICAL))
    return 0


def _check_port(host: str, port: int) -> None:
    import socket

    if not 0 <= port <= 65535:
        raise TallyError(f"--port {port} is outside 0..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise TallyError(f"--host {host}: {exc.strerror or exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            raise TallyError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


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
                    horizon=args.horizon, workers=args.workers, progress=_progress(args))
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
        _print_json(out)
    else:
        print(f"replayed run {args.run}: {rows:,} record keys of {len(hosts)} host(s), steps "
              f"{out['first_step']}..{out['last_step']}, into {args.spool} in {seconds:.1f} s "
              f"({out['keys_per_second'] or 0:,} keys/s; hashes from the {args.hashes})")
    return 0


def _add_replay_parser(sub: Any) -> None:
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
    _quiet_json(s, quiet=None)
    _examples(s, "tally replay --loader my_job.data:make_loader --hosts 64 --steps 10000 "
                 "--spool spool --run exp1-replay --manifest manifest.parquet",
              "tally replay --loader my_job.data:make_loader --hosts 8 --steps 500 --spool "
              "spool --run exp1-r2 --manifest m.parquet --states ckpt/1000/data_iter --json")
    s.set_defaults(func=_cmd_replay)


def _loader_preflight(args: argparse.Namespace) -> Any:
    from tally.audit.ledger.database import Ledger
    from tally.audit.preflight.loader_check import run_loader_preflight

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


def _add_runner_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Beam runner")
    g.add_argument("--runner", default="direct",
                   help="direct (FnApiRunner, default), dask, or a Beam runner name such as "
                        "DataflowRunner, FlinkRunner, SparkRunner")
    g.add_argument("--mode", default="in_memory", choices=["in_memory", "multi_processing"],
                   help="FnApiRunner mode (direct runner only)")
    g.add_argument("--workers", type=int, default=2,
                   help="worker processes (multi_processing, or a local Dask cluster)")
    g.add_argument("--dask-address", help="scheduler of a running dask.distributed cluster "
                                          "(default: start a local one)")
    # Beam's own options come after `--`; `parse` splits them off before argparse, which
    # cannot tell them from a positional argument's values.
    p.epilog = "Beam pipeline options go after '--', e.g. -- --flink_master=host:8081"
    p.set_defaults(beam_args=[])


def _runner(args: argparse.Namespace):
    from tally.pipeline.runners import RunnerSpec

    return RunnerSpec(name=args.runner, workers=args.workers, mode=args.mode,
                      dask_address=args.dask_address, beam_args=args.beam_args)


EXIT_CODES = """exit status:
  0    done (preflight: safe to resume)
  1    a check failed: reconcile --strict with a FAIL verdict, diff --strict with runs that
       differ or a FAIL verdict, preflight unsafe; train: the status of the host that failed
  2    bad input or a missing extra, said in one line on stderr (tally: error: ...);
       preflight: cannot tell
  130  interrupted (Ctrl-C, or SIGTERM); nothing half made is left behind
  141  the output's reader went away (`tally ledger L | head`): nothing more is printed"""


def _number(convert: type, ok: Any, what: str) -> Any:
    """An argparse type: `convert(text)`, refused unless `ok(value)`. A float must be finite
    too (argparse's own float takes "nan" and "inf"). `--interval 0` made the service's
    ingester scan the spool in a loop at 100% of a core; `--memory-gb 0` or `--at-step -5`
    went on into the job."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if (convert is float and not math.isfinite(value)) or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value
    parse.__name__ = what  # what argparse says of a value its type refused
    return parse


positive_float = _number(float, lambda v: v > 0, "a number > 0")
non_negative_float = _number(float, lambda v: v >= 0, "a number >= 0")
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def output_dir(text: str) -> str:
    """An argparse type: a path that can be a directory (-o of reconcile, diff, exposure),
    neither a file nor under one. `-o afile` failed in the job with a traceback."""
    from tally.audit.core.paths import unwritable_dir

    problem = unwritable_dir(text, probe=False)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def http_url(text: str) -> str:
    """An argparse type: an http(s) URL with a host (--api-url, which report.html's links
    open: anything else makes links that go nowhere)."""
    from urllib.parse import urlsplit

    u = urlsplit(text)
    if u.scheme not in ("http", "https") or not u.netloc or u.query or u.fragment:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http(s) URL of a service, such as http://tally.internal:8000")
    return text


def _examples(p: argparse.ArgumentParser, *lines: str) -> None:
    """An example or two at the top of the command's epilog (kept as written)."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "examples:\n" + "\n".join(f"  {x}" for x in lines) + (
        f"\n\n{p.epilog}" if p.epilog else "")


def _log_format(p: argparse.ArgumentParser) -> None:
    from tally.audit.core.logs import FORMATS

    p.add_argument("--log-format", default="text", choices=FORMATS,
                   help="log lines on stderr: text ('tally: [level] ...', default) or json "
                        "(one object a line: time, level, logger, message and fields)")


def _quiet_json(p: argparse.ArgumentParser, quiet: str | None = "no progress, no worker logs",
                json_: str | None = "machine-readable output") -> None:
    if quiet:
        p.add_argument("-q", "--quiet", action="store_true", help=quiet)
    if json_:
        p.add_argument("--json", action="store_true", help=json_)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tally", description=__doc__, epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from tally.audit.extras import version

    p.add_argument("--version", action="version", version=f"tally {version()}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("ingest", help="ingest new spool files into a ledger, exactly once")
    s.add_argument("spool", help="spool directory the training hosts write to")
    s.add_argument("--ledger", required=True, help="DuckDB ledger file (created if missing)")
    _quiet_json(s, quiet="no progress bar")
    s.add_argument("--batch-rows", type=int, default=1_000_000,
                   help="rows per transaction (files are never split; default 1,000,000)")
    _log_format(s)
    _examples(s, "tally ingest spool --ledger ledger.duckdb",
              "tally ingest /data/spool --ledger /data/ledger.duckdb -q --json")
    s.set_defaults(func=_cmd_ingest)

    s = sub.add_parser("ledger", help="show runs, attempts, hosts, step ranges and row counts")
    s.add_argument("path", help="DuckDB ledger file")
    _quiet_json(s, quiet=None)
    _examples(s, "tally ledger ledger.duckdb", "tally ledger ledger.duckdb --json")
    s.set_defaults(func=_cmd_ledger)

    s = sub.add_parser("corpus", help="corpus tools")
    _examples(s, "tally corpus synth corpus --records 1200")
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
    _quiet_json(s, quiet=None)
    _examples(s, "tally corpus synth corpus --records 1200 --length-scale 0.2 --max-len 512",
              "tally corpus synth /data/corpus --records 1000000 --seed 7 --json")
    s.set_defaults(func=_cmd_synth)

    s = sub.add_parser("manifest", help="Beam job: the corpus manifest with its fingerprint")
    s.add_argument("corpus", nargs="+",
                   help="corpus directory (Tally's *.array_record / *.parquet token shards, "
                        "or a text corpus: Dolma JSON lines (.jsonl/.json, .gz, .zst), Parquet "
                        "with a text column, a Hugging Face save_to_disk directory, ArrayRecord "
                        "files of tf.train.Example, MosaicML MDS shards), an OLMo numpy token "
                        "mix's index (*.json), or OLMo token files (several, or a directory of "
                        "*.npy) with --sequence-length and --dtype")
    s.add_argument("-o", "--output", required=True, help="manifest Parquet file to write")
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
    _quiet_json(s)
    _add_runner_args(s)
    _examples(s, "tally manifest corpus -o manifest.parquet",
              "tally manifest dolma/documents -o dolma.parquet --tokenizer tokenizer.json "
              "--eos-id 50279",
              "tally manifest data/ -o m.parquet --format parquet_text --tokens-field input_ids",
              "tally manifest /data/corpus -o /data/manifest.parquet --runner dask --workers 4 "
              "-q --json",
              "tally manifest /data/mix/index.json -o /data/mix-manifest.parquet",
              "tally manifest /data/mix/*.npy --sequence-length 8192 --dtype uint32 "
              "-o mix-manifest.parquet")
    s.set_defaults(func=_cmd_manifest)

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
    s.add_argument("--memory-gb", type=positive_float, default=3.0,
                   help="memory budget: sizes the record-key buckets so that the buckets "
                        "in memory at once stay within it (default 3)")
    s.add_argument("--api-url", type=http_url,
                   help="the `tally serve` that report.html's evidence links open (e.g. "
                        "http://tally.internal:8000); without it they lead to the page's own "
                        "Evidence tables")
    _quiet_json(s)
    _add_runner_args(s)
    _examples(s, "tally reconcile --spool spool --manifest manifest.parquet --run exp1 -o report",
              "tally reconcile --ledger ledger.duckdb --manifest manifest.parquet --run exp1 -o "
              "report --at-step 20 --strict -q --json")
    s.set_defaults(func=_cmd_reconcile)

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
    _examples(s, "tally train --config train.json --hosts 2 steps=12",
              "tally train --config train.json --hosts 2 --resume steps=16")
    s.set_defaults(func=_cmd_train)

    s = sub.add_parser("compare", help="mean token-level KL divergence between two "
                                       "checkpoints on the same held-out inputs")
    s.add_argument("a", help="checkpoint directory (latest step) or one step's directory")
    s.add_argument("b", help="checkpoint directory (latest step) or one step's directory")
    s.add_argument("--corpus", help="corpus for the held-out inputs (default: A's config)")
    s.add_argument("--records", type=int, help="held-out records (default: A's eval_records)")
    _quiet_json(s, quiet="no progress")
    _examples(s, "tally compare ckpt/6 ckpt/12", "tally compare ckpt-a ckpt-b --records 64 --json")
    s.set_defaults(func=_cmd_compare)

    s = sub.add_parser("serve", help="live API and dashboard; ingests the spool as it grows")
    s.add_argument("--ledger", required=True, help="DuckDB ledger file (owned by this process)")
    s.add_argument("--spool", help="spool directory to ingest from while serving")
    s.add_argument("--manifest", help="manifest Parquet file (domains; coverage denominator)")
    s.add_argument("--records", type=int,
                   help="train records N, the coverage denominator, when there is no manifest")
    s.add_argument("--reports", help="directory written by `tally reconcile -o DIR`")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--token", help="require this bearer token on every endpoint "
                                   "(default: $TALLY_API_TOKEN, else none)")
    s.add_argument("--webhook", help="URL to POST alert changes to")
    s.add_argument("--interval", type=positive_float, default=1.0,
                   help="seconds between spool scans (default 1)")
    s.add_argument("--max-epoch-duplicates", type=int, default=0,
                   help="alert above this many within-epoch duplicates (-1: off)")
    s.add_argument("--max-host-overlap", type=int, default=0,
                   help="alert above this many records seen by 2+ hosts in the first pass "
                        "(-1: off)")
    s.add_argument("--max-ingest-lag", type=float, default=300.0,
                   help="alert above this many seconds of ingest lag (-1: off)")
    s.add_argument("--max-coverage-behind", type=float, default=0.02,
                   help="alert when coverage is this far below the ideal (-1: off)")
    s.add_argument("--checkpoints", action="append", metavar="DIR",
                   help="a directory the pre-flight endpoint may read checkpoints from "
                        "(repeatable; default: the checkpoint directories the run's trainer "
                        "recorded in its spool files)")
    s.add_argument("--preflight-seconds", type=positive_float, default=120.0,
                   help="time box of one pre-flight request (default 120)")
    s.add_argument("--findings-every", type=non_negative_float, default=120.0,
                   help="re-run the reconcile job over the spool for each run that changed, at "
                        "most this often (seconds; needs --spool and --manifest; 0: never), so "
                        "that the summary names causes live (default 120)")
    s.add_argument("--metrics-hosts", type=non_negative_int, metavar="N",
                   help="per-host series in /metrics for the N hosts of each run with the most "
                        "repeats only (0: none; default: every host), for runs of thousands "
                        "of hosts")
    s.add_argument("--max-round-seconds", type=positive_float, default=60.0,
                   help="an ingest round longer than this turns /healthz degraded (default 60)")
    s.add_argument("--log-level", default="warning", type=str.lower, choices=LOG_LEVELS,
                   help="uvicorn's log level (default warning); Tally's own lines (alerts "
                        "starting and stopping, live reconciles, quarantined files, slow "
                        "ingest rounds) are logged at info unless this is error or critical")
    s.add_argument("--access-log", action="store_true",
                   help="log one line per request (method, path, status; a ?token= is "
                        "redacted)")
    _log_format(s)
    _quiet_json(s, quiet="no progress while starting, uvicorn's errors only", json_=None)
    _examples(s, "tally serve --ledger ledger.duckdb --spool spool --manifest manifest.parquet",
              "tally serve --ledger ledger.duckdb --spool spool --records 1176 --host 0.0.0.0 "
              "--token $TALLY_API_TOKEN --webhook http://alerts.internal/hook")
    s.set_defaults(func=_cmd_serve)

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
    _quiet_json(s, json_="machine-readable verdict")
    _examples(s, "tally preflight --run exp1 --ledger ledger.duckdb --manifest manifest.parquet "
                 "--checkpoint ckpt --hosts 1",
              "tally preflight --run exp1 --ledger ledger.duckdb --manifest manifest.parquet "
              "--checkpoint ckpt/6 --hosts 4 --global-batch 32 --record -q --json",
              "tally preflight --run olmo1 --ledger ledger.duckdb --manifest manifest.parquet "
              "--loader my_job.data:make_loader --hosts 4 --at-step 1200")
    s.set_defaults(func=_cmd_preflight)

    _add_posthoc_parsers(sub)
    _add_replay_parser(sub)

    s = sub.add_parser("demo", help="a small end-to-end run on embedded defaults")
    s.add_argument("--out", default="tally-demo", help="working directory (default: tally-demo)")
    s.add_argument("--records", type=int, default=2000, help="corpus size (default 2000)")
    s.add_argument("--keep-serving", action="store_true",
                   help="keep the API service and its dashboard up until Ctrl-C")
    _examples(s, "tally demo", "tally demo --out /tmp/tally-demo --records 640 --keep-serving")
    s.set_defaults(func=_cmd_demo)
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Command-line arguments; what follows `--` goes to Beam (commands that run a pipeline)."""
    argv = list(argv)
    beam = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = build_parser()
    args = parser.parse_args(argv[: len(argv) - len(beam) - 1] if "--" in argv else argv)
    if beam and not hasattr(args, "runner"):
        parser.error(f"'tally {args.command}' takes no Beam options after '--'")
    if beam:
        args.beam_args = beam
    return args


# Commands whose work runs in worker threads and processes (Beam, Grain workers, training
# hosts): a Ctrl-C that reached all of them printed a traceback from each (110-150 lines for a
# reconcile). They run as a child in a session of its own, so the terminal's Ctrl-C reaches
# only this process, which stops the child's whole process group and says so in one line.
SUPERVISED = {"reconcile", "manifest", "train", "demo", "preflight", "compare", "diff",
              "exposure", "replay"}
_CHILD = "TALLY_SUPERVISED"


def main(argv: Sequence[str] | None = None) -> int:
    kept = _logging_state()
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # while starting, before the command's own handling
        print("tally: interrupted", file=sys.stderr)
        return 130
    finally:
        # A command called in-process (a notebook, a test) leaves logging as it found it:
        # its quiet levels and handlers silenced the progress lines of what ran next.
        _restore_logging(kept)


_LOGGERS = ("", "tally")  # the loggers a command sets up


def _logging_state() -> list[tuple[logging.Logger, int, list[logging.Handler], bool]]:
    return [(log, log.level, list(log.handlers), log.propagate)
            for log in map(logging.getLogger, _LOGGERS)]


def _restore_logging(kept: list[tuple[logging.Logger, int, list[logging.Handler], bool]]
                     ) -> None:
    for log, level, handlers, propagate in kept:
        log.setLevel(level)
        log.handlers[:] = handlers
        log.propagate = propagate


def _main(argv: list[str]) -> int:
    from tally.audit import extras
    from tally.audit.core import allocator

    allocator.tune()  # before the work's first allocations, and inherited by its workers
    args = parse(argv)
    # Beam logs optional-dependency warnings at import; they are noise on a terminal.
    logging.getLogger().setLevel(logging.ERROR)
    try:
        extras.check(args.command)
    except extras.MissingExtra as exc:
        print(f"tally: error: {exc}", file=sys.stderr)
        return 2
    if args.command in SUPERVISED and not os.environ.get(_CHILD):
        return _supervise(argv, args)
    try:
        # A supervised child keeps the default SIGTERM: its supervisor stops it and says so.
        with _SIGNALS.installed(args.command not in SUPERVISED), \
                _workers_quiet(getattr(args, "quiet", False)):
            code = args.func(args)
        if _SIGNALS.received:
            raise KeyboardInterrupt
        return code
    except TallyError as exc:
        print(f"tally: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        need = extras.missing(args.command, exc)
        if need is None:
            raise
        print(f"tally: error: {need}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not os.environ.get(_CHILD):  # a supervised child's supervisor says it, once
            print("tally: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _output_gone()
        return 141
    except Exception:
        if not _SIGNALS.received:
            raise
        # What a signal broke on its way (a DuckDB statement it interrupted: "Query
        # interrupted") is the interrupt, not an error of its own.
        print("tally: interrupted", file=sys.stderr)
        return 130


def _output_gone() -> None:
    """The reader of this command's output went away (`tally ledger L | head`): it stops
    quietly, as a program killed by SIGPIPE does (status 141). Python leaves SIGPIPE ignored,
    so the write raised BrokenPipeError; what is left in the buffers is dropped, or the
    flush at exit would raise it again."""
    null = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            os.dup2(null, stream.fileno())
    os.close(null)


class _Signals:
    """Ctrl-C (SIGINT) and SIGTERM (docker stop, systemd, kill) alike for the commands that run
    in this process (ingest, ledger, corpus synth, serve): `tally: interrupted`, status 130.

    By default a signal raises KeyboardInterrupt where the command is. A command that stops
    better at a point of its own (`graceful`: ingest, between two transactions) gets an event
    set instead; a second signal then ends the process at once, as a kill does (what was
    committed stays; nothing half is in the ledger)."""

    def __init__(self) -> None:
        self.received = False
        self._stop: threading.Event | None = None
        self._bar = False

    def graceful(self, progress: bool) -> threading.Event:
        """The event a signal sets; `progress`: a progress bar may be mid-line on stderr."""
        self._stop, self._bar = threading.Event(), progress
        return self._stop

    def __call__(self, signum: int, frame: object) -> None:
        stop = self._stop
        if stop is not None and stop.is_set():
            os.write(2, b"\ntally: interrupted\n" if self._bar else b"tally: interrupted\n")
            os._exit(130)
        self.received = True
        if stop is not None:
            stop.set()
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self, terminate_too: bool = True) -> Iterator[None]:
        """The handler for SIGINT (and SIGTERM, with `terminate_too`) while the command runs,
        the previous ones after (a test may call `main` in its own process)."""
        import signal

        self.received, self._stop = False, None
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM) if terminate_too else (signal.SIGINT,)
        before = {sig: signal.signal(sig, self) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
            self._stop = None


_SIGNALS = _Signals()


@contextlib.contextmanager
def _workers_quiet(quiet: bool) -> Iterator[None]:
    """With -q, what worker processes print on stderr is dropped (Beam's SDK workers log 40
    INFO lines for a `--mode multi_processing` reconcile, and each says "apitools not found"),
    while Tally's own lines still reach the terminal: the processes this one starts inherit
    file descriptor 2, which points at /dev/null meanwhile; sys.stderr writes to the real one."""
    if not quiet:
        yield
        return
    sys.stderr.flush()
    real = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    before = sys.stderr
    sys.stderr = open(os.dup(real), "w", buffering=1, encoding=before.encoding,  # noqa: SIM115
                      errors="backslashreplace")
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stderr.close()
        sys.stderr = before
        os.dup2(real, 2)
        os.close(real)


def _supervise(argv: list[str], args: argparse.Namespace) -> int:
    """Run the command in a child process of its own session; on Ctrl-C (or SIGTERM) stop its
    process group, remove what it left half made, and print one line."""
    import signal

    leftovers = _half_made(args)
    child = subprocess.Popen([sys.executable, "-m", "tally.audit.cli", *argv],
                             env={**os.environ, _CHILD: "1"}, start_new_session=True)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return child.wait()
    except KeyboardInterrupt:
        _stop_group(child)
        for path in leftovers:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        print("tally: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_group(child: subprocess.Popen, grace_s: float = 5.0) -> None:
    import signal

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(wait)
            # Grandchildren in the group (Beam workers, training hosts) go with the signal.
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
        return


def _half_made(args: argparse.Namespace) -> list[Path]:
    """What the command would leave half made if it were stopped now: an output directory it
    creates (the whole of it), or the work files inside one that exists already."""
    if args.command in ("reconcile", "diff", "exposure"):
        out = Path(args.output)
        return [out / ".work"] if out.exists() else [out]
    if args.command == "replay":
        from tally.pipeline.replay import ReplaySpec, work_dir

        return [work_dir(ReplaySpec(loader="", hosts=1, steps=1, spool=Path(args.spool),
                                    run_id=args.run))]
    if args.command == "manifest":
        out = Path(args.output)
        return [out.with_name(f".{out.name}.parts"), out.with_name(f".{out.name}.tmp")]
    return []


if __name__ == "__main__":
    sys.exit(main())
