"""The live API (FastAPI): one process owns the ledger, a background thread ingests the spool,
request handlers read with their own cursors, each request inside one snapshot transaction (so
a query never sees half a segment file). Thin over api/queries.py."""

from __future__ import annotations

import contextlib
import hmac
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import pyarrow.parquet as pq
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from api import queries as q
from api.alerts import Thresholds, Webhook, evaluate, status
from api.ingest_loop import IngestLoop
from audit.aggregates import Aggregates, for_ledger
from audit.errors import TallyError
from audit.ledger import Ledger, one

DASHBOARD = Path(__file__).with_name("dashboard.html")
RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # audit.spool's run id rule
MAX_STEP = 2**62

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
        from pipeline.manifest import manifest_info

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


class Service:
    """What the handlers share: the ledger, its aggregates, the ingest loop, the settings."""

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
        self.loop = (IngestLoop(ledger, spool, interval=interval, after_round=self.check_alerts)
                     if spool is not None else None)
        self._local = threading.local()
        self._cursor_lock = threading.Lock()

    def _cursor(self):
        cur = getattr(self._local, "cur", None)
        if cur is None:
            with self._cursor_lock:
                cur = self._local.cur = self.ledger.cursor()
        return cur

    @contextlib.contextmanager
    def read(self, run_id: str | None = None,
             state: Callable[[int], Any] | None = None) -> Iterator[tuple[Any, int | None, Any]]:
        """(cursor, run, state(run)) inside one snapshot transaction. `state` reads the
        per-record arrays; it runs under the aggregates' lock, which the ingester holds
        across each COMMIT, so the arrays match the snapshot."""
        cur = self._cursor()
        try:
            cur.execute("BEGIN TRANSACTION")
            lock = self.agg.lock if state is not None else contextlib.nullcontext()
            with lock:
                # The first read pins the snapshot.
                if run_id is None:
                    run = None
                    one(cur, "SELECT count(*) FROM runs")
                else:
                    run = q.run_of(cur, run_id)
                extra = state(run) if state is not None else None
            yield cur, run, extra
        finally:
            cur.execute("ROLLBACK")

    def outside(self, run: int) -> Any:
        st = self.agg.runs.get(run)
        if st is None or self.uni.n is None:
            return None
        return st.beyond(self.uni.n)

    def summary(self, cur, run: int, run_id: str, outside: Any) -> dict[str, Any]:
        t = q.totals(cur, run)
        cov = q.coverage(cur, run, self.uni, None, outside)
        first_pass = self.uni.n is None or cov["exposures"] <= self.uni.n
        lag = self.loop.lag_seconds() if self.loop is not None else 0.0
        alerts = evaluate(self.thresholds, epoch_duplicates=t["epoch_duplicates"],
                          multi_host_records=t["multi_host_records"], first_pass=first_pass,
                          lag_seconds=lag, behind=cov.get("behind_ideal"))
        return {"run_id": run_id, "status": status(alerts), "alerts": alerts,
                "last_step": cov["latest_step"], **t, "coverage": cov,
                "ingest_lag_seconds": lag}

    def run_ids(self) -> list[str]:
        with self.read() as (cur, _, _):
            return [r[0] for r in cur.execute("SELECT run_id FROM runs ORDER BY run_id")
                    .fetchall()]

    def check_alerts(self) -> None:
        for run_id in self.run_ids():
            with self.read(run_id, self.outside) as (cur, run, outside):
                s = self.summary(cur, run, run_id, outside)
            self.webhook.update(run_id, s["alerts"])


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
        if svc.loop is not None:
            svc.loop.start()
        try:
            yield
        finally:
            if svc.loop is not None:
                svc.loop.stop()

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
        with svc.read() as (cur, _, _):
            files = one(cur, "SELECT count(*) FROM segments")[0]
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
        with svc.read() as (cur, _, _):
            return q.runs(cur)

    @app.get("/v1/runs/{run_id}", tags=["runs"], responses=ERRORS)
    def run_summary(run_id: RunId) -> dict[str, Any]:
        """Coverage, duplicates, hosts, restarts and the alert status of one run."""
        with svc.read(run_id, svc.outside) as (cur, run, outside):
            return svc.summary(cur, run, run_id, outside)

    @app.get("/v1/runs/{run_id}/coverage", tags=["coverage"], responses=ERRORS)
    def run_coverage(run_id: RunId, step: Step = None) -> dict[str, Any]:
        """Coverage, exposure histogram (0, 1, 2, 3+) and the ideal, as of a step (default:
        the latest)."""
        with svc.read(run_id, svc.outside) as (cur, run, outside):
            return q.coverage(cur, run, svc.uni, step, outside)

    @app.get("/v1/runs/{run_id}/steps", tags=["coverage"], responses=ERRORS)
    def run_steps(run_id: RunId, start: Step = None, end: Step = None, bucket: Bucket = None,
                  points: Points = 500) -> dict[str, Any]:
        """Per step, bucketed: consumed, new unique, repeats, cumulative coverage, ideal."""
        with svc.read(run_id) as (cur, run, _):
            return q.steps(cur, run, svc.uni, start, end, bucket, points)

    @app.get("/v1/runs/{run_id}/hosts", tags=["hosts"], responses=ERRORS)
    def run_hosts(run_id: RunId) -> dict[str, Any]:
        """Per-host stats and the host x host overlap matrix."""
        with svc.read(run_id) as (cur, run, _):
            return q.hosts(cur, run)

    @app.get("/v1/runs/{run_id}/hosts/{host}/steps", tags=["hosts"], responses=ERRORS)
    def run_host_steps(run_id: RunId, host: Annotated[int, PathParam(ge=0, le=2**31 - 1)],
                       start: Step = None, end: Step = None, bucket: Bucket = None,
                       points: Points = 500) -> dict[str, Any]:
        """One host's per-step series, bucketed."""
        with svc.read(run_id) as (cur, run, _):
            return q.host_steps(cur, run, host, start, end, bucket, points)

    @app.get("/v1/runs/{run_id}/records/{record_key}", tags=["records"], responses=ERRORS)
    def run_record(run_id: RunId,
                   record_key: Annotated[int, PathParam(ge=0, le=2**63 - 1)]) -> dict[str, Any]:
        """Every consumption of one record: step, host, attempt, epoch, rolled back or not."""
        with svc.read(run_id) as (cur, run, _):
            return q.record(cur, run, record_key=record_key)

    @app.get("/v1/runs/{run_id}/records", tags=["records"], responses=ERRORS)
    def run_record_by_hash(
            run_id: RunId,
            content_hash: Annotated[str, Query(pattern=r"^(0x[0-9a-fA-F]{1,16}|[0-9]{1,20})$",
                                               description="xxh3_64, decimal or 0x-hex")],
    ) -> dict[str, Any]:
        """Every consumption of the records with this content hash."""
        h = int(content_hash, 0) if content_hash.startswith("0x") else int(content_hash)
        if h >= 2**64:
            raise HTTPException(422, "content_hash must be below 2**64")
        with svc.read(run_id) as (cur, run, _):
            return q.record(cur, run, content_hash=h)

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

        with svc.read(run_id, per_domain) as (_, _, out):
            return out

    @app.get("/v1/runs/{run_id}/metrics", tags=["metrics"], responses=ERRORS)
    def run_metrics(run_id: RunId, points: Points = 500) -> dict[str, Any]:
        """Milestones (held-out loss, per-domain perplexity) against train loss."""
        with svc.read(run_id) as (cur, run, _):
            return q.metrics(cur, run, points)

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
        with svc.read(run_id, svc.outside) as (cur, run, outside):
            s = svc.summary(cur, run, run_id, outside)
            hs = q.hosts(cur, run)
            host_rows = dict(cur.execute("SELECT host, sum(n_rows) FROM segments WHERE run = ? "
                                         "AND kind = 'seg' GROUP BY host", [run]).fetchall())
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
