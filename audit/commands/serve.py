"""`tally serve`: the live API and dashboard over a ledger, ingesting the spool as it grows."""

from __future__ import annotations

import argparse
import logging
import os

from tally.audit.commands.common import ledger_errors, log_to_stderr, progress
from tally.audit.commands.options import (
    LOG_LEVELS,
    examples,
    log_format,
    non_negative_float,
    non_negative_int,
    positive_float,
    quiet_json,
)
from tally.audit.core.errors import TallyError


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


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tally.api.alerts import Thresholds
    from tally.api.app import create_app
    from tally.api.settings import ServeSettings
    from tally.audit.ledger.database import Ledger

    off = lambda v: None if v is not None and v < 0 else v  # noqa: E731
    th = Thresholds(epoch_duplicates=off(args.max_epoch_duplicates),
                    host_overlap=off(args.max_host_overlap),
                    ingest_lag_seconds=off(args.max_ingest_lag),
                    coverage_behind=off(args.max_coverage_behind))
    # Everything that can be checked is checked before the ledger is opened (the settings
    # check themselves as they are made): a failed start creates nothing.
    settings = ServeSettings(
        spool=args.spool, manifest=args.manifest, records=args.records, reports=args.reports,
        token=args.token or os.environ.get("TALLY_API_TOKEN") or None, thresholds=th,
        webhook=args.webhook, interval=args.interval, checkpoints=tuple(args.checkpoints or ()),
        preflight_seconds=args.preflight_seconds, max_round_seconds=args.max_round_seconds,
        findings_every=args.findings_every, metrics_hosts=args.metrics_hosts)
    _check_port(args.host, args.port)
    from tally.pipeline.progress import Progress

    level = getattr(logging, args.log_level.upper(), 5)  # uvicorn's trace: below debug
    # Tally's own news (alerts starting and stopping, live reconciles finished, quarantined
    # files, slow rounds) at info, unless --log-level asks for less, or -q.
    log_to_stderr(logging.WARNING if args.quiet else min(level, logging.INFO)
                  if level <= logging.WARNING else level, args.log_format)
    _uvicorn_logs(args.log_format, logging.ERROR if args.quiet else level, args.access_log)
    with ledger_errors(args.ledger), Ledger(args.ledger) as ledger:
        with Progress("serve", progress(args)) as bar:
            # The per-record state is loaded from the ledger first (seconds for millions of
            # records), before the first request.
            bar.stage(f"loading the state of {args.ledger}")
            app = create_app(ledger, settings)
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


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    s.add_argument("--findings-every", type=non_negative_float, default=10.0,
                   help="a live reconcile of each run folds in the spool's new files this "
                        "often (seconds; needs --spool and --manifest; 0: never), so that the "
                        "summary names causes live (default 10)")
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
    log_format(s)
    quiet_json(s, quiet="no progress while starting, uvicorn's errors only", json_=None)
    examples(s, "tally serve --ledger ledger.duckdb --spool spool --manifest manifest.parquet",
             "tally serve --ledger ledger.duckdb --spool spool --records 1176 --host 0.0.0.0 "
             "--token $TALLY_API_TOKEN --webhook http://alerts.internal/hook")
    s.set_defaults(func=_cmd_serve)
