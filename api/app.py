"""The live API (FastAPI): one process owns the ledger, a background thread ingests the spool,
request handlers read with their own cursors, each request inside one snapshot transaction (so
a query never sees half a segment file). Thin over api/queries.py."""

from __future__ import annotations

import contextlib
import hmac
import json
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import pyarrow.parquet as pq
from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.encoders import jsonable_encoder
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from api import queries as q
from api.alerts import Thresholds, Webhook, evaluate, status
from api.ingest_loop import IngestLoop
from api.preflight_routes import add_routes as add_preflight_routes
from audit.aggregates import Aggregates, Records, for_ledger
from audit.errors import TallyError
from audit.ledger import Ledger, one

DASHBOARD = Path(__file__).with_name("dashboard.html")
RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # audit.spool's run id rule
MAX_STEP = 2**62
SWITCH_INTERVAL = 0.0005  # seconds; see lifespan()

RunId = Annotated[str, PathParam(pattern=RUN_ID, description="run id")]
Step = Annotated[int | None, Query(ge=0, le=MAX_STEP)]
Bucket = Annotated[int | None, Query(ge=1, le=MAX_STEP, description="steps per bucket")]
Points = Annotated[int, Query(ge=1, le=q.MAX_POINTS,
                              description="about this many buckets when bucket is not given")]
ERRORS = {404: {"description": "unknown run, host or record"},
          409: {"description": "needs something the service was not given (a manifest)"}}


@dataclass
class Manifest:
    path: str
    fingerprint: str
    records: int
    train_records: int
    domain_codes: np.ndarray  # int32 per record key
    domain_names: list[str]

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        from pipeline.manifest_file import manifest_info

        info = manifest_info(path)
        t = pq.read_table(path, columns=["record_key", "domain", "split"])
        n = int(info["train_records"])
        keys = t["record_key"].to_numpy()
        split = t["split"].to_numpy(zero_copy_only=False)
        if not np.array_equal(keys, np.arange(len(keys))) or not (
                (split[:n] == "train").all() and (split[n:] != "train").all()):
            raise TallyError(f"manifest {path}: record keys are not 0..N-1 with the train split "
                             "first (rebuild it with `tally manifest`)")
        dom = t["domain"].dictionary_encode().combine_chunks()
        return cls(str(path), info["manifest_fingerprint"], len(keys), n,
                   dom.indices.to_numpy(zero_copy_only=False).astype(np.int32),
                   dom.dictionary.to_pylist())


@dataclass
class Snap:
    """What a request reads: one snapshot transaction of the ledger."""

    cur: Any
    run: int | None
    gen: int  # the newest file id in the snapshot: its version, for cached answers
    uni: q.Universe
    outside: Records | None = None  # state of the keys outside the universe, when asked
    state: Any = None  # what `read(locked=...)` read from the per-record state


class Service:
    """What the handlers share: the ledger, its aggregates, the ingest loop, the settings, and
    answers already computed for the current version of the ledger."""

    ANSWERS = 512  # cached answers kept (all runs and parameters together)
    HOT, HOT_S = 32, 60.0  # answers recomputed after each ingest round: asked for lately

    def __init__(self, ledger: Ledger, *, spool: Path | None, manifest: Manifest | None,
                 records: int | None, reports: Path | None, thresholds: Thresholds,
                 webhook: str | None, interval: float) -> None:
        self.ledger = ledger
        self.agg: Aggregates = for_ledger(ledger)
        self.manifest = manifest
        if manifest is not None:
            self.uni = q.Universe(manifest.train_records, "manifest")
        elif records is not None:
            self.uni = q.Universe(records, "records option")
        else:
            self.uni = q.Universe(None, "unknown")
        self.reports = reports
        self.thresholds = thresholds
        self.webhook = Webhook(webhook)
        self.loop = (IngestLoop(ledger, spool, interval=interval, after_round=self.after_round)
                     if spool is not None else None)
        self._local = threading.local()
        self._cursor_lock = threading.Lock()
        self._answers: OrderedDict[tuple, Any] = OrderedDict()
        self._answers_lock = threading.Lock()
        self._hot: OrderedDict[tuple, tuple] = OrderedDict()
        self._warm_gen = -1

    def _cursor(self):
        cur = getattr(self._local, "cur", None)
        if cur is None:
            with self._cursor_lock:
                cur = self._local.cur = self.ledger.cursor()
        return cur

    def universe(self, cur, run: int | None) -> q.Universe:
        """The manifest's train split or --records; else what the run's writers said."""
        if self.uni.n is not None or run is None:
            return self.uni
        row = one(cur, """SELECT records_per_epoch FROM attempts WHERE run = ?
                          AND records_per_epoch IS NOT NULL ORDER BY attempt DESC LIMIT 1""",
                  [run])
        return self.uni if row is None else q.Universe(int(row[0]), "writer metadata")

    def _pin(self, cur, run_id: str | None) -> Snap:
        gen = one(cur, "SELECT coalesce(max(file_id), 0) FROM segments")[0]  # pins the snapshot
        run = None if run_id is None else q.run_of(cur, run_id)
        return Snap(cur, run, gen, self.universe(cur, run))

    @contextlib.contextmanager
    def read(self, run_id: str | None = None, *, outside: bool = False,
             locked: Callable[[int], Any] | None = None) -> Iterator[Snap]:
        """One snapshot transaction. With `outside`, also the per-record state of the keys
        outside the universe; `locked(run)` reads something else from the per-record state
        (its result in `snap.state`). That state must match the snapshot: the ingester holds
        Aggregates.lock across its COMMIT and the state update, so such a snapshot is pinned
        under the lock. A run whose keys all fall inside the universe (the normal case) has
        no outside state to read, which the state's key bound says without the lock."""
        cur = self._cursor()
        cur.execute("BEGIN TRANSACTION")
        try:
            snap = self._pin(cur, run_id)
            if locked is not None or (outside and self._has_outside(snap)):
                snap = self._pin_locked(snap, run_id, locked)
            yield snap
        finally:
            cur.execute("ROLLBACK")

    def _has_outside(self, snap: Snap) -> bool:
        # `top` only grows and is raised before the COMMIT that adds keys: below the universe
        # now means below it in any snapshot taken before now.
        st = self.agg.runs.get(snap.run)
        return st is not None and snap.uni.n is not None and st.top >= snap.uni.n

    def _pin_locked(self, snap: Snap, run_id: str | None,
                    locked: Callable[[int], Any] | None) -> Snap:
        snap.cur.execute("ROLLBACK")
        snap.cur.execute("BEGIN TRANSACTION")
        with self.agg.lock:
            snap = self._pin(snap.cur, run_id)
            st = self.agg.runs.get(snap.run)
            if locked is not None:
                snap.state = locked(snap.run)
            elif st is not None and snap.uni.n is not None:
                snap.outside = st.beyond(snap.uni.n)
        return snap

    def answer(self, key: tuple, run_id: str | None, compute: Callable[[Snap], Any], *,
               outside: bool = False) -> Any:
        """compute(snap), or what it gave for the same ledger version: between two ingested
        batches, a repeated request costs one small query."""
        with self.read(run_id) as snap:
            hit = self._cached((snap.gen, *key))
            if hit is not None:
                return hit
            if outside and self._has_outside(snap):
                snap = self._pin_locked(snap, run_id, None)
            value = compute(snap)
        with self._answers_lock:
            self._answers[(snap.gen, *key)] = value
            while len(self._answers) > self.ANSWERS:
                self._answers.popitem(last=False)
            self._hot[key] = (run_id, compute, outside, time.monotonic())
            self._hot.move_to_end(key)
            while len(self._hot) > self.HOT:
                self._hot.popitem(last=False)
        return value

    def warm(self) -> None:
        """Compute the answers asked for lately for the ledger's new version, so that the
        requests after an ingest find them (run by the ingester after each round)."""
        with self.read() as snap:
            if snap.gen == self._warm_gen:
                return
            self._warm_gen = snap.gen
        with self._answers_lock:
            hot = [(k, v) for k, v in self._hot.items() if time.monotonic() - v[3] < self.HOT_S]
        for key, (run_id, compute, outside, _) in hot:
            try:
                self.answer(key, run_id, compute, outside=outside)
            except TallyError:  # e.g. a host that no longer exists after a restart
                continue

    def _cached(self, key: tuple) -> Any:
        with self._answers_lock:
            hit = self._answers.get(key)
            if hit is not None:
                self._answers.move_to_end(key)
            return hit

    def json(self, key: tuple, run_id: str | None, compute: Callable[[Snap], Any], *,
             outside: bool = False) -> Response:
        """A cached answer as a JSON response (encoded once per ledger version)."""
        body = self.answer(key, run_id, lambda snap: _encode(compute(snap)), outside=outside)
        return Response(body, media_type="application/json")

    def facts(self, run_id: str) -> dict[str, Any]:
        """A run's totals and coverage (what the summary and alerts need), cached."""
        def compute(snap: Snap) -> dict[str, Any]:
            return {"totals": q.totals(snap.cur, snap.run),
                    "coverage": q.coverage(snap.cur, snap.run, snap.uni, None, snap.outside)}
        return self.answer(("facts", run_id), run_id, compute, outside=True)

    def summary(self, run_id: str) -> dict[str, Any]:
        f = self.facts(run_id)
        t, cov = f["totals"], f["coverage"]
        n = cov["train_records"]
        first_pass = n is None or cov["exposures"] <= n
        lag = self.loop.lag_seconds() if self.loop is not None else 0.0
        alerts = evaluate(self.thresholds, epoch_duplicates=t["epoch_duplicates"],
                          multi_host_records=t["multi_host_records"], first_pass=first_pass,
                          lag_seconds=lag, behind=cov.get("behind_ideal"))
        return {"run_id": run_id, "status": status(alerts), "alerts": alerts,
                "last_step": cov["latest_step"], **t, "coverage": cov,
                "ingest_lag_seconds": lag}

    def hosts(self, run_id: str) -> dict[str, Any]:
        return self.answer(("hosts", run_id), run_id, lambda snap: q.hosts(snap.cur, snap.run))

    def hosts_json(self, run_id: str) -> Response:
        return self.json(("hosts.json", run_id), run_id,
                         lambda snap: q.hosts(snap.cur, snap.run))

    def host_rows(self, run_id: str) -> dict[int, int]:
        return self.answer(("host_rows", run_id), run_id, lambda snap: dict(snap.cur.execute(
            "SELECT host, sum(n_rows) FROM segments WHERE run = ? AND kind = 'seg' "
            "GROUP BY host", [snap.run]).fetchall()))

    def run_ids(self) -> list[str]:
        return self.answer(("run_ids",), None, lambda snap: [r[0] for r in snap.cur.execute(
            "SELECT run_id FROM runs ORDER BY run_id").fetchall()])

    def after_round(self) -> None:
        self.check_alerts()
        self.warm()

    def check_alerts(self) -> None:
        for run_id in self.run_ids():
            self.webhook.update(run_id, self.summary(run_id)["alerts"])


def _encode(value: Any) -> bytes:
    return JSONResponse(jsonable_encoder(value)).body


def create_app(ledger: Ledger, *, spool: str | Path | None = None,
               manifest: str | Path | None = None, records: int | None = None,
               reports: str | Path | None = None, token: str | None = None,
               thresholds: Thresholds | None = None, webhook: str | None = None,
               interval: float = 1.0) -> FastAPI:
    """The app over an open, writable ledger; with `spool`, it ingests while it serves."""
    if spool is not None and not Path(spool).is_dir():
        raise TallyError(f"spool {spool} is not a directory")
    if records is not None and records < 1:
        raise TallyError("--records must be >= 1")
    svc = Service(ledger, spool=None if spool is None else Path(spool),
                  manifest=None if manifest is None else Manifest.load(manifest),
                  records=records, reports=None if reports is None else Path(reports),
                  thresholds=thresholds or Thresholds(), webhook=webhook, interval=interval)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # A request hands the GIL back and forth a few dozen times (event loop, worker thread,
        # each DuckDB call); with the default 5 ms switch interval each hand-back can wait that
        # long behind the ingester's Python work, which made the p99 latency 5-10x the p50.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)
        if svc.loop is not None:
            svc.loop.start()
        try:
            yield
        finally:
            if svc.loop is not None:
                svc.loop.stop()
            sys.setswitchinterval(switch)

    app = FastAPI(title="Tally live API", version="1",
                  description="What a training run has consumed, while it runs: coverage and "
                              "duplication per step and per host, record lookups, alerts.",
                  lifespan=lifespan)
    app.state.service = svc

    @app.middleware("http")
    async def bearer(request: Request, call_next):
        if token is not None:
            got = request.headers.get("authorization", "")
            given = got[7:] if got.lower().startswith("bearer ") else \
                request.query_params.get("token", "")
            if not hmac.compare_digest(given.encode(), token.encode()):
                return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    add_preflight_routes(app, svc, RunId, ERRORS)

    @app.exception_handler(q.NotFound)
    async def not_found(request: Request, exc: q.NotFound):
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(q.Unavailable)
    async def unavailable(request: Request, exc: q.Unavailable):
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def dashboard() -> HTMLResponse:
        return HTMLResponse(DASHBOARD.read_text())

    @app.get("/healthz", tags=["service"])
    def healthz() -> dict[str, Any]:
        """Liveness, and how the ingester is doing."""
        loop = svc.loop
        with svc.read() as snap:
            files = one(snap.cur, "SELECT count(*) FROM segments")[0]
        ok = loop is None or (loop.alive and loop.last_error is None)
        return {"status": "ok" if ok else "degraded", "ledger": str(ledger.path),
                "files_in_ledger": files, "ingesting": loop is not None,
                "ingest": None if loop is None else {
                    "alive": loop.alive, "rounds": loop.rounds, "files": loop.files,
                    "rows": loop.rows, "quarantined": loop.quarantined,
                    "last_error": loop.last_error, "lag_seconds": loop.lag_seconds()},
                "universe": {"train_records": svc.uni.n, "source": svc.uni.source},
                "thresholds": svc.thresholds.as_dict(),
                "webhook": {"configured": svc.webhook.url is not None,
                            "sent": svc.webhook.sent, "failures": svc.webhook.failures}}

    @app.get("/v1/runs", tags=["runs"])
    def list_runs() -> list[dict[str, Any]]:
        """Every run in the ledger with its size and latest step."""
        return svc.json(("runs",), None, lambda snap: q.runs(snap.cur))

    @app.get("/v1/runs/{run_id}", tags=["runs"], responses=ERRORS)
    def run_summary(run_id: RunId) -> dict[str, Any]:
        """Coverage, duplicates, hosts, restarts and the alert status of one run."""
        return svc.summary(run_id)

    @app.get("/v1/runs/{run_id}/coverage", tags=["coverage"], responses=ERRORS)
    def run_coverage(run_id: RunId, step: Step = None) -> dict[str, Any]:
        """Coverage, exposure histogram (0, 1, 2, 3+) and the ideal, as of a step (default:
        the latest)."""
        return svc.json(("coverage", run_id, step), run_id, lambda snap: q.coverage(
            snap.cur, snap.run, snap.uni, step, snap.outside), outside=True)

    @app.get("/v1/runs/{run_id}/steps", tags=["coverage"], responses=ERRORS)
    def run_steps(run_id: RunId, start: Step = None, end: Step = None, bucket: Bucket = None,
                  points: Points = 500) -> dict[str, Any]:
        """Per step, bucketed: consumed, new unique, repeats, cumulative coverage, ideal."""
        return svc.json(("steps", run_id, start, end, bucket, points), run_id,
                        lambda snap: q.steps(snap.cur, snap.run, snap.uni, start, end, bucket,
                                             points))

    @app.get("/v1/runs/{run_id}/hosts", tags=["hosts"], responses=ERRORS)
    def run_hosts(run_id: RunId) -> dict[str, Any]:
        """Per-host stats and the host x host overlap matrix."""
        return svc.hosts_json(run_id)

    @app.get("/v1/runs/{run_id}/hosts/{host}/steps", tags=["hosts"], responses=ERRORS)
    def run_host_steps(run_id: RunId, host: Annotated[int, PathParam(ge=0, le=2**31 - 1)],
                       start: Step = None, end: Step = None, bucket: Bucket = None,
                       points: Points = 500) -> dict[str, Any]:
        """One host's per-step series, bucketed."""
        return svc.json(("host_steps", run_id, host, start, end, bucket, points), run_id,
                        lambda snap: q.host_steps(snap.cur, snap.run, host, start, end, bucket,
                                                  points))

    @app.get("/v1/runs/{run_id}/records/{record_key}", tags=["records"], responses=ERRORS)
    def run_record(run_id: RunId,
                   record_key: Annotated[int, PathParam(ge=0, le=2**63 - 1)]) -> dict[str, Any]:
        """Every consumption of one record: step, host, attempt, epoch, rolled back or not."""
        with svc.read(run_id) as snap:
            return q.record(snap.cur, snap.run, record_key=record_key)

    @app.get("/v1/runs/{run_id}/records", tags=["records"], responses=ERRORS)
    def run_record_by_hash(
            run_id: RunId,
            content_hash: Annotated[str, Query(pattern=r"^(0x[0-9a-fA-F]{1,16}|[0-9]{1,20})$",
                                               description="xxh3_64, decimal or 0x-hex")],
    ) -> dict[str, Any]:
        """Every consumption of the records with this content hash."""
        h = int(content_hash, 0) if content_hash.startswith("0x") else int(content_hash)
        with svc.read(run_id) as snap:
            if h >= 2**64:  # a well-formed number, but no xxh3_64 value: no record has it
                raise q.NotFound(f"no record has content hash {content_hash} (xxh3_64 values "
                                 "are below 2**64)")
            return q.record(snap.cur, snap.run, content_hash=h)

    @app.get("/v1/runs/{run_id}/domains", tags=["coverage"], responses=ERRORS)
    def run_domains(run_id: RunId) -> list[dict[str, Any]]:
        """Per domain (from the manifest): planned vs actual share of exposures, coverage."""
        m = svc.manifest
        if m is None:
            raise q.Unavailable("per-domain exposure needs the manifest: start the service "
                                "with --manifest")

        def per_domain(run: int) -> list[dict[str, Any]]:
            st = svc.agg.runs.get(run)
            return q.domains(np.zeros(0, np.int64) if st is None else st.exposures[: st.size], m)

        with svc.read(run_id, locked=per_domain) as snap:
            return snap.state

    @app.get("/v1/runs/{run_id}/metrics", tags=["metrics"], responses=ERRORS)
    def run_metrics(run_id: RunId, points: Points = 500) -> dict[str, Any]:
        """Milestones (held-out loss, per-domain perplexity) against train loss."""
        return svc.json(("metrics", run_id, points), run_id,
                        lambda snap: q.metrics(snap.cur, snap.run, points))

    @app.get("/v1/runs/{run_id}/report", tags=["runs"], responses=ERRORS)
    def run_report(run_id: RunId) -> dict[str, Any]:
        """The latest reconcile report (report.json) of this run under --reports."""
        if svc.reports is None:
            raise q.Unavailable("no reports directory: start the service with --reports DIR "
                                "(where `tally reconcile -o DIR` writes)")
        best = None
        for p in [svc.reports / "report.json", *svc.reports.glob("*/report.json")]:
            try:
                rep = json.loads(p.read_text())
                mtime = p.stat().st_mtime
            except (OSError, ValueError):
                continue
            if isinstance(rep, dict) and rep.get("run_id") == run_id and (
                    best is None or mtime > best[0]):
                best = (mtime, rep)
        if best is None:
            raise q.NotFound(f"no reconcile report for run {run_id!r} under {svc.reports}")
        return best[1]

    @app.get("/metrics", response_class=PlainTextResponse, tags=["service"])
    def prometheus() -> PlainTextResponse:
        """Prometheus text format: coverage, duplicate fractions, ingest lag, rows, per host."""
        return PlainTextResponse(_prometheus(svc),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _prometheus(svc: Service) -> str:
    out: dict[str, tuple[str, list[str]]] = {}

    def add(name: str, help_: str, value: float | None, **labels: Any) -> None:
        if value is None:
            return
        lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
        out.setdefault(name, (help_, []))[1].append(
            f"{name}{{{lab}}} {float(value):.10g}" if lab else f"{name} {float(value):.10g}")

    lag = svc.loop.lag_seconds() if svc.loop is not None else 0.0
    add("tally_ingest_lag_seconds", "Age of the oldest spool file waiting for ingest", lag)
    if svc.loop is not None:
        add("tally_ingest_rounds_total", "Ingest rounds of this process", svc.loop.rounds)
        add("tally_quarantined_files_total", "Files quarantined by this process",
            svc.loop.quarantined)
    for run_id in svc.run_ids():
        s, hs, host_rows = svc.summary(run_id), svc.hosts(run_id), svc.host_rows(run_id)
        c = s["coverage"]
        add("tally_coverage", "Share of train records seen at least once", c["coverage"],
            run=run_id)
        add("tally_ideal_coverage", "Coverage a perfect loader would have now",
            c.get("ideal", {}).get("coverage"), run=run_id)
        add("tally_exposures", "Effective record exposures", c["exposures"], run=run_id)
        add("tally_records_seen", "Distinct records seen", s["records_seen"], run=run_id)
        ex = max(1, s["exposures"])
        add("tally_repeat_fraction", "Share of exposures that repeat a record already seen",
            (s["exposures"] - s["records_seen"]) / ex, run=run_id)
        add("tally_epoch_duplicate_fraction",
            "Share of exposures that repeat a record within one epoch",
            s["epoch_duplicates"] / ex, run=run_id)
        add("tally_epoch_duplicates", "Exposures beyond the first of a record in one epoch",
            s["epoch_duplicates"], run=run_id)
        add("tally_multi_host_records", "Records seen by two or more hosts",
            s["multi_host_records"], run=run_id)
        add("tally_rows_ingested_total", "Segment rows in the ledger", s["rows_ingested"],
            run=run_id)
        add("tally_last_step", "Latest effective step", s["last_step"], run=run_id)
        for a in s["alerts"]:
            add("tally_alert", "1 when the alert fires", int(a["firing"]), run=run_id,
                alert=a["name"])
        for h in hs["per_host"]:
            lab = {"run": run_id, "host": h["host"]}
            add("tally_host_rows_ingested_total", "Segment rows in the ledger, per host",
                host_rows.get(h["host"], 0), **lab)
            add("tally_host_exposures", "Effective exposures per host", h["exposures"], **lab)
            add("tally_host_unique_records", "Distinct records per host", h["unique"], **lab)
            add("tally_host_shared_records", "Records a host saw that another host saw too",
                h["overlap_with_others"], **lab)
            add("tally_host_last_step", "Latest effective step per host", h["last_step"], **lab)
    lines = []
    for name, (help_, samples) in out.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", *samples]
    return "\n".join(lines) + "\n"
