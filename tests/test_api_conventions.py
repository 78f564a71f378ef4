"""The API's conventions on a real uvicorn server: /docs and /redoc offline in headless
Chromium, typed answers with examples and one error shape in the schema, pages that reach
every row, /metrics through prometheus_client, and an alert webhook that retries off the
ingest thread."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tally.api import models
from tally.api.alerts import Thresholds
from tally.api.app import create_app
from tally.api.errors import Problem
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tests.support.api import Server, free_port, poll, write_steps
from tests.support.browser import chromium, needs_chromium
from tests.support.manifest import content_hash_of
from tests.test_api_live import N, write_manifest


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Five runs (one with many consumptions of few records), a manifest, pre-flight verdicts."""
    from tally.audit.preflight import PreflightVerdict, record_verdict

    tmp = tmp_path_factory.mktemp("conv")
    spool = tmp / "spool"
    for i, run in enumerate(("a", "b", "c", "d", "e")):
        write_steps(spool, run, host=0, hosts=1, steps=range(3), n=N, seed=i)
    for h in (0, 1):  # three records, consumed ~130 times each
        write_steps(spool, "few", host=h, hosts=2, steps=range(25), n=3, seed=h, flush_every=6)
    with Ledger(tmp / "l.duckdb") as ledger:
        ingest(spool, ledger)
        for i in range(7):
            record_verdict(ledger, PreflightVerdict("few", "safe", numbers={
                "checkpoint_step": i, "old_hosts": 2, "new_hosts": 1}))
        with Server(create_app(ledger, manifest=write_manifest(tmp / "m.parquet"))) as srv:
            yield srv, ledger


def _pages(srv: Server, path: str) -> tuple[list, list[int]]:
    """Every page from `path` on, following the Link header: the rows, and each page's size."""
    rows, sizes, url = [], [], srv.url + path
    while url:
        r = httpx.get(url, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        page = body if isinstance(body, list) else body["segments"]
        rows += page
        sizes.append(len(page))
        url = r.links.get("next", {}).get("url")
        if not isinstance(body, list):
            assert (body["next_cursor"] is None) == (url is None)
    return rows, sizes


@pytest.mark.slow
def test_pages_reach_every_row_and_are_bounded(served):
    srv, ledger = served
    runs, sizes = _pages(srv, "/v1/runs?limit=2")
    assert [r["run_id"] for r in runs] == ["a", "b", "c", "d", "e", "few"]
    assert sizes == [2, 2, 2]
    verdicts, sizes = _pages(srv, "/v1/runs/few/preflight?limit=3")
    assert [v["checkpoint_step"] for v in verdicts] == [6, 5, 4, 3, 2, 1, 0]  # newest first
    assert sizes == [3, 3, 1]
    want = ledger.query("""SELECT count(*) AS n FROM consumption JOIN runs USING (run)
                           WHERE run_id = 'few' AND record_key = 1""")[0]["n"]
    assert want > 100
    whole = srv.get("/v1/runs/few/records/1?limit=10000").json()
    assert whole["next_cursor"] is None and len(whole["segments"]) == whole["segments_total"]
    segs, sizes = _pages(srv, "/v1/runs/few/records/1?limit=17")
    assert segs == whole["segments"] and len(segs) == want
    assert max(sizes) == 17 and len(sizes) == -(-want // 17)
    # Every page repeats the totals over all pages.
    first = srv.get("/v1/runs/few/records/1?limit=17").json()
    assert (first["exposures"], first["segments_total"]) == (whole["exposures"], want)
    h = int(content_hash_of([1])[0])
    by_hash, _ = _pages(srv, f"/v1/runs/few/records?content_hash={h:#x}&limit=50")
    assert by_hash == segs and {s["content_hash"] for s in segs} == {f"{h:#018x}"}
    for bad in ("/v1/runs?limit=0", "/v1/runs?limit=1001", "/v1/runs/few/records/1?limit=10001",
                "/v1/runs/few/records/1?cursor=x", "/v1/runs/few/preflight?cursor=0"):
        assert srv.get(bad).status_code == 422, bad


def test_one_error_shape_and_typed_answers_with_examples_in_the_schema(served, tmp_path):
    srv, ledger = served
    answers = [srv.get("/v1/runs/nope"), srv.get("/v1/runs/a/records/999999"),
               srv.get("/v1/runs/a/coverage?step=-1"), srv.get("/v1/runs/a/report"),
               srv.get("/no/such/path"),
               httpx.post(srv.url + "/v1/runs/a/exposure", json={"content_hashes": []}),
               httpx.post(srv.url + "/v1/runs/a/preflight", json={"checkpoint": "/", "hosts": 1})]
    with Server(create_app(ledger, token="t")) as guarded:
        answers.append(guarded.get("/v1/runs"))
    assert [r.status_code for r in answers] == [404, 404, 422, 409, 404, 422, 403, 401]
    for r in answers:
        p = Problem.model_validate(r.json())
        assert p.status == r.status_code and p.detail and "\n" not in p.detail
    assert answers[2].json()["errors"][0]["loc"] == ["query", "step"]
    assert "greater than or equal to 0" in answers[2].json()["detail"]

    schema = srv.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            ok = op["responses"]["200"]["content"]
            body = ok.get("application/json", {}).get("schema") or ok["text/plain"]["schema"]
            assert body != {}, (method, path)  # typed, not an untyped object
            ref = body.get("$ref") or body.get("items", {}).get("$ref")
            if ref:  # the answer's model has an example
                assert components[ref.rsplit("/", 1)[1]].get("examples"), (method, path)
            else:
                assert ok["text/plain"].get("example"), (method, path)
            for code, res in op["responses"].items():
                if code != "200":
                    assert res["content"]["application/json"]["schema"] == {
                        "$ref": "#/components/schemas/Problem"}, (method, path, code)
    # Each example is itself a valid answer of its model.
    for name in dir(models):
        model = getattr(models, name)
        if isinstance(model, type) and issubclass(model, models.BaseModel):
            for example in (model.model_config.get("json_schema_extra") or {}).get(
                    "examples", []):
                model.model_validate(example)


def test_metrics_are_typed_by_prometheus_client(served):
    srv, _ = served
    text = srv.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (build,) = families["tally_build_info"].samples
    assert build.name == "tally_build_info" and build.labels["version"]
    for f in families.values():
        names = {s.name for s in f.samples}
        assert names, f.name  # no family without a sample (tally_integrity needs findings)
        assert all(n.endswith("_total") for n in names) == (f.type == "counter"), f.name
        if f.name.endswith("_ratio"):
            assert all(0 <= s.value <= 1 for s in f.samples), f.name
    assert {"tally_coverage_ratio", "tally_repeat_ratio", "tally_epoch_duplicate_ratio",
            "tally_rows_ingested", "tally_host_rows_ingested"} <= set(families)
    rows = {s.labels["run"]: s.value for s in families["tally_rows_ingested"].samples}
    assert rows["few"] == 2 * 25 * 8
    om = srv.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF")


class _FlakyHook(BaseHTTPRequestHandler):
    """The first try hangs 2 s, then fails; the second fails; later ones are taken."""

    tries: list[float] = []
    taken: list[dict] = []
    first_done = threading.Event()

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = len(self.tries)
        self.tries.append(time.monotonic())
        if n == 0:
            time.sleep(2.0)
            self.first_done.set()
        self.send_response(500 if n < 2 else 204)
        self.end_headers()
        if n >= 2:
            self.taken.append(body)

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_a_failed_webhook_is_retried_with_backoff_off_the_ingest_thread(tmp_path):
    hook = ThreadingHTTPServer(("127.0.0.1", free_port()), _FlakyHook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    spool = tmp_path / "spool"
    spool.mkdir()
    try:
        ledger = Ledger(tmp_path / "l.duckdb")
        app = create_app(ledger, spool=spool, records=N, interval=0.05,
                         thresholds=Thresholds(host_overlap=None, coverage_behind=None),
                         webhook=f"http://127.0.0.1:{hook.server_port}/hook")
        app.state.service.webhook.first_retry = 0.2
        with ledger, Server(app) as srv:
            write_steps(spool, "w", host=0, hosts=1, steps=range(10), n=N, seed=3)
            assert poll(lambda: _FlakyHook.tries), "no webhook try"
            # While the receiver hangs on the first try, ingest goes on.
            write_steps(spool, "w", host=0, hosts=1, steps=range(10, 20), n=N, seed=4)
            assert poll(lambda: srv.get("/v1/runs/w").json()["last_step"] == 19, timeout=10)
            assert not _FlakyHook.first_done.is_set()
            assert poll(lambda: _FlakyHook.taken, timeout=20), "the alert was never delivered"
            (body,) = _FlakyHook.taken
            assert body["started"] == ["epoch_duplicates"] and body["status"] == "alert"
            t = _FlakyHook.tries
            assert len(t) == 3 and t[2] - t[1] >= 0.3  # backed off: 0.2 s, then 0.4 s
            hook_health = srv.get("/healthz").json()["webhook"]
            assert (hook_health["sent"], hook_health["failures"], hook_health["pending"]) == (
                1, 2, 0)
    finally:
        hook.shutdown()


def _page_requests(netlog: Path) -> set[str]:
    """The URLs the page asked for, from Chromium's net log: requests on behalf of a frame
    of 127.0.0.1 (the browser's own, such as its update checks, carry another site)."""
    log = json.loads(netlog.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    params = [e.get("params", {}) for e in log["events"] if e["type"] == start]
    return {p["url"] for p in params
            if "url" in p and "127.0.0.1" in p.get("network_isolation_key", "")}


@needs_chromium
@pytest.mark.parametrize("page", ["docs", "redoc"])
def test_docs_render_with_the_network_blocked_in_headless_chromium(served, page, tmp_path):
    srv, _ = served
    netlog = tmp_path / "net.json"
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={profile}",
             "--no-default-browser-check", "--disable-domain-reliability", "--no-pings",
             "--disable-client-side-phishing-detection", "--disable-default-apps",
             "--disable-features=Translate,OptimizationHints,AutofillServerCommunication,"
             "MediaRouter,SpareRendererForSitePerProcess",
             # No name resolves: only 127.0.0.1 can be reached.
             "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
             f"--log-net-log={netlog}", "--virtual-time-budget=15000", "--dump-dom",
             f"{srv.url}/{page}"], capture_output=True, text=True, timeout=120)
    dom = out.stdout
    paths = ["/v1/runs/{run_id}/coverage", "/v1/runs/{run_id}/records/{record_key}", "/healthz"]
    if page == "docs":  # Swagger UI: one block per operation, with its path
        shown = set(re.findall(r'data-path="([^"]+)"', dom))
        assert "Unable to render" not in dom and len(shown) >= 14, dom[-2000:]
    else:  # ReDoc: one section per operation, with its path in the request sample
        shown = set(re.findall(r'(/v1/[a-z_{}/]+|/healthz)', dom))
        assert 'id="operation/' in dom, dom[-2000:]
    assert set(paths) <= shown, shown
    asked = _page_requests(netlog)
    assert f"{srv.url}/openapi.json" in asked
    assert {urlsplit(u).hostname for u in asked} == {"127.0.0.1"}, asked
