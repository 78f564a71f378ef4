"""Docs, errors and monitoring of the live API on a real uvicorn server started with a token:
the schema and its pages open without the token and declare the bearer scheme, problem details
as RFC 9457 has them, each error status's own example, opaque runs cursors, meaningful
operation ids, request latency and process series in /metrics, per-host series bounded by
--metrics-hosts, and the Grafana dashboard and Prometheus rules over the series exported."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tally.api.app import create_app
from tally.api.errors import MEDIA_TYPE, Problem
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tests.support import ROOT
from tests.support.api import Server, free_port, poll, write_steps
from tests.support.browser import Browser, needs_chromium
from tests.support.cli import tally
from tests.test_api_live import N

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RUNS = ("alpha", "bravo", "charlie", "delta")
# Keys drawn per host of run "h": host 3 draws from 4 records (the most repeats), host 1 from 8.
HOST_RANGE = {0: N, 1: 8, 2: N, 3: 4}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Five runs (one of four hosts with unequal repeats), a pre-flight verdict, served with a
    token, ingesting the spool, with a webhook (so that its series exist)."""
    from tally.audit.preflight import PreflightVerdict, record_verdict

    tmp = tmp_path_factory.mktemp("docs")
    spool = tmp / "spool"
    for i, run in enumerate(RUNS):
        write_steps(spool, run, host=0, hosts=1, steps=range(3), n=N, seed=i)
    for h, n in HOST_RANGE.items():
        write_steps(spool, "h", host=h, hosts=4, steps=range(6), n=n, seed=10 + h)
    with Ledger(tmp / "l.duckdb") as ledger:
        ingest(spool, ledger)
        record_verdict(ledger, PreflightVerdict("alpha", "safe", numbers={
            "checkpoint_step": 2, "old_hosts": 1, "new_hosts": 1}))
        app = create_app(ledger, spool=spool, records=N, token=TOKEN, interval=0.2,
                         webhook=f"http://127.0.0.1:{free_port()}/hook")
        with Server(app) as srv:
            yield srv, ledger


def get(srv: Server, path: str) -> httpx.Response:
    return srv.get(path, headers=AUTH)


def operations(schema: dict):
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            yield path, method, op


# ---- docs and auth ---------------------------------------------------------------------------

@pytest.mark.slow
def test_the_schema_and_its_pages_answer_without_the_token_and_declare_the_bearer_scheme(
        served):
    srv, _ = served
    for path in ("/docs", "/redoc", "/openapi.json", "/favicon.ico"):
        r = srv.get(path)
        assert r.status_code == 200, (path, r.text[:200])
    assert srv.get("/favicon.ico").headers["content-type"] == "image/png"
    for path in ("/v1/runs", "/metrics", "/healthz", "/"):  # the API itself still needs it
        assert srv.get(path).status_code == 401, path

    schema = srv.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": schema["components"][
            "securitySchemes"]["bearer"]["description"]}
    ops = list(operations(schema))
    assert len(ops) >= 17
    for path, method, op in ops:
        assert op["security"] == [{"bearer": []}], (method, path)
        unauthorized = op["responses"]["401"]["content"]
        for media in (MEDIA_TYPE, "application/json"):
            assert unauthorized[media]["schema"] == {"$ref": "#/components/schemas/Problem"}
            assert unauthorized[media]["example"]["status"] == 401, (method, path)


def test_redoc_references_no_other_host(served):
    srv, _ = served
    html = srv.get("/redoc").text
    refs = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert refs and all(r.startswith("/") and not r.startswith("//") for r in refs), refs
    assert "://" not in html
    scripts = [r for r in refs if r.endswith(".js")]
    assert scripts
    for s in scripts:  # ReDoc's own script asked a CDN for Redocly's logo
        body = srv.get(s)
        assert body.status_code == 200 and "redoc" in body.text.lower()
        assert "cdn.redoc.ly" not in body.text, s


@needs_chromium
def test_swagger_ui_offers_authorize_in_headless_chromium(served):
    srv, _ = served
    with Browser() as browser:
        page = browser.open(srv.url + "/docs", ready="!!document.querySelector('.opblock')",
                            timeout=60)
        assert page.eval("!!document.querySelector('.auth-wrapper .authorize')")
        assert page.eval("document.querySelectorAll('.opblock .authorization__btn').length") \
            >= 17


# ---- errors as RFC 9457 says -----------------------------------------------------------------

def test_problem_details_name_their_type_and_instance_and_errors_only_on_422(served):
    srv, _ = served
    answers = {
        "/v1/runs/nope": get(srv, "/v1/runs/nope"),
        "/v1/runs/alpha/domains": get(srv, "/v1/runs/alpha/domains"),
        "/v1/runs/alpha/coverage": get(srv, "/v1/runs/alpha/coverage?step=-1"),
        "/no/such/path": get(srv, "/no/such/path"),
        "/v1/runs": srv.get("/v1/runs"),
    }
    assert [r.status_code for r in answers.values()] == [404, 409, 422, 404, 401]
    for path, r in answers.items():
        assert r.headers["content-type"] == MEDIA_TYPE, path
        body = r.json()
        Problem.model_validate(body)
        assert body["type"] == "about:blank" and body["instance"] == path, body
        assert ("errors" in body) == (r.status_code == 422), body
    assert answers["/v1/runs/alpha/coverage"].json()["errors"][0]["loc"] == ["query", "step"]


def test_each_error_status_has_its_own_example_in_the_schema(served):
    srv, _ = served
    schema = srv.get("/openapi.json").json()
    seen = set()
    for path, method, op in operations(schema):
        for code, res in op["responses"].items():
            if code.startswith("2"):
                continue
            for media in (MEDIA_TYPE, "application/json"):
                ex = res["content"][media]["example"]
                Problem.model_validate(ex)
                assert ex["status"] == int(code), (method, path, code, ex)
                assert ("errors" in ex) == (code == "422"), (method, path, code)
            seen.add(code)
    assert {"401", "403", "404", "409", "413", "422", "503"} <= seen


@pytest.mark.parametrize("path", ["/v1/runs/alpha/steps", "/v1/runs/h/hosts/1/steps"])
def test_start_after_end_is_422(served, path):
    srv, _ = served
    r = get(srv, f"{path}?start=5&end=2")
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["loc"] == ["query", "end"]
    assert get(srv, f"{path}?start=2&end=2").status_code == 200


def test_timestamps_carry_their_time_zone(served):
    srv, _ = served
    now = dt.datetime.now(dt.UTC)
    stamps = [get(srv, "/v1/runs/alpha").json()["last_ingested_at"],
              get(srv, "/v1/runs/alpha/preflight").json()[0]["checked_at"]]
    for s in stamps:
        t = dt.datetime.fromisoformat(s)
        assert t.utcoffset() == dt.timedelta(0), s
        assert abs(t - now) < dt.timedelta(minutes=10), (s, now)  # UTC, not local time
    schema = json.dumps(srv.get("/openapi.json").json())
    assert not re.search(r'"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?"', schema)  # examples too


def test_runs_pages_take_an_opaque_cursor(served):
    srv, _ = served
    seen, url, cursors = [], srv.url + "/v1/runs?limit=2", []
    while url:
        r = httpx.get(url, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        seen += [x["run_id"] for x in r.json()]
        url = r.links.get("next", {}).get("url")
        if url:
            cursors += parse_qs(urlsplit(url).query)["cursor"]
    assert seen == sorted([*RUNS, "h"]) and len(cursors) == 2
    for c in cursors:
        assert c not in seen and not any(run in c for run in seen), c
    for bad in ("alpha", "bravo", "zz", "!!"):  # a run id is no cursor (it was, before)
        r = get(srv, f"/v1/runs?cursor={bad}")
        assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["query", "cursor"]


def test_operation_ids_are_meaningful(served):
    srv, _ = served
    ids = [op["operationId"] for _, _, op in operations(srv.get("/openapi.json").json())]
    assert len(ids) == len(set(ids))
    for i in ids:
        assert re.fullmatch(r"[a-z]+(?:[A-Z][a-z]+)*", i), i  # listRuns, not runs_v1_runs_get
    assert {"listRuns", "runSummary", "runSteps", "scrapeMetrics", "checkPreflight"} <= set(ids)


# ---- monitoring kit --------------------------------------------------------------------------

def scrape(srv: Server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(get(srv, "/metrics").text)}


def test_metrics_have_process_series_and_latency_per_route(served):
    srv, _ = served
    get(srv, "/v1/runs/alpha")
    get(srv, "/v1/runs/bravo")
    get(srv, "/v1/runs/nope")
    get(srv, "/no/such/path")
    families = scrape(srv)
    for name in ("process_resident_memory_bytes", "process_cpu_seconds",
                 "process_open_fds", "process_start_time_seconds"):
        assert name in families, name
    lat = families["tally_http_request_duration_seconds"]
    assert lat.type == "histogram"
    counts = {(s.labels["route"], s.labels["status"]): s.value for s in lat.samples
              if s.name.endswith("_count")}
    assert counts[("/v1/runs/{run_id}", "200")] >= 2  # one series for every run's summary
    assert counts[("/v1/runs/{run_id}", "404")] >= 1
    assert counts[("unrouted", "404")] >= 1
    assert not any("/v1/runs/alpha" in route for route, _ in counts), counts  # never a raw path
    buckets = [s for s in lat.samples if s.name.endswith("_bucket")]
    assert {s.labels["le"] for s in buckets} >= {"0.01", "1.0", "+Inf"}


def _hosts_exported(families: dict, run: str) -> list[int]:
    fam = families.get("tally_host_exposures")
    return sorted(int(s.labels["host"]) for s in fam.samples if s.labels["run"] == run) \
        if fam else []


@pytest.mark.slow
def test_metrics_hosts_bounds_the_per_host_series(served, tmp_path):
    srv, _ = served
    hs = get(srv, "/v1/runs/h/hosts").json()["per_host"]
    repeats = {h["host"]: h["exposures"] - h["unique"] for h in hs}
    top2 = sorted(sorted(repeats, key=lambda h: (-repeats[h], h))[:2])
    assert top2 == [1, 3], repeats  # the hosts that drew from few records
    assert _hosts_exported(scrape(srv), "h") == [0, 1, 2, 3]  # default: every host

    # The real command line: `tally serve --metrics-hosts N`.
    ledger_path = tmp_path / "l.duckdb"
    spool = tmp_path / "spool"
    for h, n in HOST_RANGE.items():
        write_steps(spool, "h", host=h, hosts=4, steps=range(6), n=n, seed=10 + h)
    for n, want in (("2", top2), ("0", [])):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tally.audit.cli", "serve", "--ledger", str(ledger_path),
             "--spool", str(spool), "--port", str(port), "--records", str(N), "-q",
             "--metrics-hosts", n], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            def ready(url=url, proc=proc):
                try:
                    return httpx.get(url + "/v1/runs/h", timeout=2).status_code == 200
                except httpx.TransportError:
                    return proc.poll() is not None
            assert poll(ready, timeout=60) and proc.poll() is None
            families = {f.name: f for f in text_string_to_metric_families(
                httpx.get(url + "/metrics", timeout=10).text)}
            assert _hosts_exported(families, "h") == want, n
            if not want:
                assert not [f for f in families if f.startswith("tally_host_")]
            assert "tally_coverage_ratio" in families  # the run's own series stay
        finally:
            proc.terminate()
            proc.communicate(timeout=30)
    bad = tally("serve", "--ledger", ledger_path, "--metrics-hosts", "-1", timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--metrics-hosts" in bad.stderr.strip().splitlines()[-1]


DEPLOY = ROOT / "deploy"
SERIES = re.compile(r"\b(?:tally|process)_[a-z0-9_]+")


def _expressions() -> list[tuple[str, str]]:
    """(where, expression) of every PromQL expression in the Grafana dashboard and the
    Prometheus rules."""
    dash = json.loads((DEPLOY / "grafana" / "tally-dashboard.json").read_text())
    out = []
    for p in dash["panels"]:
        out += [(f"panel {p['title']}", t["expr"]) for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            out.append((f"variable {v['name']}", v["query"]["query"]))
    rules = yaml.safe_load((DEPLOY / "prometheus" / "tally-rules.yml").read_text())
    for g in rules["groups"]:
        for r in g["rules"]:
            assert r["alert"] and r["annotations"]["summary"], r
            out.append((f"rule {r['alert']}", r["expr"]))
    assert len(out) >= 20
    yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    return out


def test_grafana_dashboard_and_prometheus_rules_use_series_the_service_exports(served):
    srv, _ = served
    httpx.get(srv.url + "/v1/runs/alpha", headers=AUTH)
    text = get(srv, "/metrics").text
    # Every sample name (a histogram's _bucket, _count, _sum; a counter's _total), and the
    # family names, which PromQL's functions over them name too.
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    exported |= {f.name for f in text_string_to_metric_families(text)}
    routes = {getattr(r, "path", None) for r in srv.server.config.app.routes}
    for where, expr in _expressions():
        names = SERIES.findall(expr)
        assert names, (where, expr)
        for name in names:
            assert name in exported, (where, name)
        for route in re.findall(r'route!?=~?"([^"]+)"', expr):
            assert route in routes, (where, route)
        for label in re.findall(r"by \(([^)]*)\)", expr):
            for lab in (x.strip() for x in label.split(",")):
                assert lab in {"le", "route", "status", "method", "run", "host", "alert"}, lab
