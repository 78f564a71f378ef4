"""Hardening of the live API on a real uvicorn server (and the real CLI): answers sized by the
steps that exist and step series in pages, request bodies bounded, an alert webhook that never
follows a redirect, never hangs on a slow receiver and refuses what is no http(s) URL, and one
error shape for what nothing else answers."""

from __future__ import annotations

import ctypes
import json
import logging
import resource
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tally.api.alerts import Thresholds
from tally.api.app import MAX_BODY_BYTES, create_app
from tally.api.errors import Problem
from tally.audit.core.errors import TallyError
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.ledger.queries import MAX_POINTS
from tests.support.api import Server, free_port, poll, write_steps
from tests.support.batches import unpacked_batch
from tests.support.cli import tally
from tests.support.manifest import uniform_manifest

N = 150
FAR = [0, 1, 3 * 10**7, 2**40]  # steps of the sparse runs: a live diff was sized by the last


def _problem(r: httpx.Response, status: int) -> Problem:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json", r.headers
    p = Problem.model_validate(r.json())
    assert p.status == status and p.detail and "\n" not in p.detail
    return p


def _pages(srv: Server, path: str) -> tuple[dict[str, list], list[int]]:
    """Every page of a step series from `path` on, by the Link header: its lists joined."""
    joined: dict[str, list] = {}
    sizes, url = [], srv.url + path
    while url:
        r = httpx.get(url, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        for k, v in body.items():
            if isinstance(v, list):
                joined.setdefault(k, []).extend(v)
        sizes.append(len(body["step"]))
        url = r.links.get("next", {}).get("url")
        assert (body["next_cursor"] is None) == (url is None)
    return joined, sizes


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """Runs a and b alike at steps 0, 1, 3e7 and 2**40; c as a's steps with other records;
    `long`, 5,003 steps of one row; `evals`, 60 steps with a milestone every 10."""
    tmp = tmp_path_factory.mktemp("sparse")
    spool = tmp / "spool"
    for run, seed in (("a", 0), ("b", 0), ("c", 1)):
        write_steps(spool, run, host=0, hosts=2, steps=FAR, n=N, seed=seed)
        write_steps(spool, run, host=1, hosts=2, steps=FAR[:2], n=N, seed=seed + 5)
    write_steps(spool, "long", host=0, hosts=1, steps=range(MAX_POINTS + 3), n=N, seed=3,
                per_step=1, metrics=False, flush_every=10**6)
    write_steps(spool, "evals", host=0, hosts=1, steps=range(60), n=N, seed=4)
    with Ledger(tmp / "l.duckdb") as ledger:
        ingest(spool, ledger)
        with Server(create_app(ledger, records=N)) as srv:
            yield srv


def test_the_live_diff_is_sized_by_the_steps_that_exist(sparse):
    srv = sparse
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.monotonic()
    same = srv.get("/v1/diff?a=a&b=b")  # the old arrays: 24 TiB (a 500); at 3e7, 2.5 GB
    took = time.monotonic() - t
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert same.status_code == 200, same.text
    assert grew_mb < 200 and took < 10, (grew_mb, took)
    d = same.json()
    assert (d["status"], d["steps_compared"], d["identical_steps"]) == ("identical", 4, 4)
    assert d["first_divergent_step"] is None and d["compared_through_step"] == 2**40
    assert (d["a"]["first_step"], d["a"]["last_step"], d["a"]["steps"]) == (0, 2**40, 4)
    # Windows and plot buckets count from the first step; only those holding a step exist.
    assert d["windows"]["steps"] == -(-(2**40 + 1) // 20) and d["windows"]["count"] == 2
    s = d["steps_series"]
    assert s["bucket"] == -(-(2**40 + 1) // 500) and s["compared"] == [3, 1]
    assert s["step"] == [0, 2**40 // s["bucket"] * s["bucket"]]
    assert d["a"]["series"]["last_step"] == [3 * 10**7, 2**40]
    other = srv.get("/v1/diff?a=a&b=c&window=1").json()  # a window a step: still 4 of them
    assert other["status"] == "different" and other["first_divergent_step"] == 0
    assert other["windows"]["steps"] == 1 and other["windows"]["count"] == 4


def test_step_series_come_in_pages_that_reach_every_bucket(sparse):
    srv = sparse
    whole = srv.get("/v1/runs/a/steps?bucket=1").json()
    assert whole["step"] == FAR and whole["next_cursor"] is None
    assert whole["cumulative_exposures"][-1] == sum(whole["exposures"])
    paged, sizes = _pages(srv, "/v1/runs/a/steps?bucket=1&limit=3")
    assert sizes == [3, 1] and paged == {k: v for k, v in whole.items() if isinstance(v, list)}
    # Without a bucket, the size `points` gives is pinned in the Link: pages on one grid.
    first = srv.get("/v1/runs/a/steps?points=2&limit=1")
    assert (first.json()["bucket"], first.json()["next_cursor"]) == (2**39 + 1, 2**39 + 1)
    assert "bucket=549755813889" in first.links["next"]["url"]
    host, sizes = _pages(srv, "/v1/runs/a/hosts/1/steps?bucket=1&limit=1")
    assert host["step"] == [0, 1] and sizes == [1, 1]
    # An explicit bucket of one step over more steps than a page holds: MAX_POINTS a page
    # (2M steps in one answer were 97 MB, 66 s and 1.7 GB at the server's peak).
    long, sizes = _pages(srv, "/v1/runs/long/steps?bucket=1")
    assert sizes == [MAX_POINTS, 3] and long["step"] == list(range(MAX_POINTS + 3))
    assert long["cumulative_exposures"] == list(range(1, MAX_POINTS + 4))
    for bad in ("limit=0", f"limit={MAX_POINTS + 1}", "cursor=-1", f"cursor={2**62 + 1}"):
        _problem(srv.get(f"/v1/runs/a/steps?{bad}"), 422)


def test_metrics_are_bounded_by_points(sparse):
    srv = sparse
    every = srv.get("/v1/runs/evals/metrics").json()
    assert [m["step"] for m in every["milestones"]] == [9, 19, 29, 39, 49, 59]
    assert every["train_loss"]["step"] == list(range(60))
    # 200k steps that each logged a held-out loss were 200k milestones (14 MB, 6 s, +250 MB).
    few = srv.get("/v1/runs/evals/metrics?points=4").json()
    assert [m["step"] for m in few["milestones"]] == [19, 29, 39, 59]  # the last of a bucket
    assert few["milestones"][0] == every["milestones"][1]
    assert few["train_loss"]["step"] == [0, 15, 30, 45]
    assert few["train_loss"]["value"][0] == pytest.approx(5.0 - 0.01 * 7)


def _raw(port: int, head: bytes, body_chunks=(), timeout: float = 10.0) -> tuple[bytes, float]:
    """Sends a request's head (and chunks of its body) on a plain socket, then reads the
    answer to its end: (answer, seconds from the head sent to the answer read)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        t = time.monotonic()
        try:
            for c in body_chunks:
                s.sendall(c)
        except OSError:  # the service answered and closed while the body was still coming
            pass
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        return got, time.monotonic() - t


def test_a_body_over_the_limit_is_answered_413_before_it_is_read(sparse):
    srv = sparse
    # 1 GB announced, not a byte of it sent: answered at once (it was read, parsed, and 200).
    head = (b"POST /v1/runs/a/exposure HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: 1000000000\r\nConnection: close\r\n\r\n")
    got, took = _raw(srv.port, head)
    assert got.startswith(b"HTTP/1.1 413 ") and took < 5, (got[:200], took)
    p = Problem.model_validate(json.loads(got.split(b"\r\n\r\n", 1)[1]))
    assert p.status == 413 and f"{MAX_BODY_BYTES:,} bytes" in p.detail
    # Chunked, without a length: counted as it arrives, refused past the limit.
    head = (b"POST /v1/runs/a/exposure HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
    got, took = _raw(srv.port, head, [chunk] * (2 * MAX_BODY_BYTES // 0x10000))
    assert got.startswith(b"HTTP/1.1 413 "), got[:300]
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["status"] == 413
    # The largest body an endpoint takes is well inside it: 10,000 decimal hashes.
    many = {"content_hashes": [str(2**64 - 1 - i) for i in range(10_000)]}
    assert len(json.dumps(many)) < MAX_BODY_BYTES // 2
    r = httpx.post(srv.url + "/v1/runs/a/exposure", json=many, timeout=30)
    assert "--manifest" in _problem(r, 409).detail  # read, and past the limit's check
    _problem(httpx.post(srv.url + "/v1/runs/a/exposure", timeout=30,
                        content=b"[" + b" " * MAX_BODY_BYTES + b"]",
                        headers={"Content-Type": "application/json"}), 413)
    assert srv.get("/healthz").json()["status"] == "ok"


class _Hits(BaseHTTPRequestHandler):
    """Records every request; the `redirect` server answers a POST with 302 to `target`."""

    hits: list[tuple[str, str]] = []
    target = ""

    def _any(self):
        self.hits.append((self.command, self.path))
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", self.target)
        else:
            self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = _any  # noqa: N815 (http.server's names)

    def log_message(self, *args):
        pass


def _served(handler) -> ThreadingHTTPServer:
    hook = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    return hook


def _alerting(tmp_path, webhook: str):
    """A service ingesting a run whose epoch duplicates fire an alert, and its ledger."""
    spool = tmp_path / "spool"
    spool.mkdir()
    ledger = Ledger(tmp_path / "l.duckdb")
    app = create_app(ledger, spool=spool, records=N, interval=0.05, webhook=webhook,
                     thresholds=Thresholds(host_overlap=None, coverage_behind=None))
    hook = app.state.service.webhook
    hook.first_retry = hook.max_retry = 0.2
    write_steps(spool, "w", host=0, hosts=1, steps=range(10), n=N, seed=3)
    return ledger, app, hook


def test_a_redirecting_receiver_is_a_failure_retried_never_followed(tmp_path):
    _Hits.hits = []
    hook_server = _served(_Hits)
    base = f"http://127.0.0.1:{hook_server.server_port}"
    _Hits.target = base + "/elsewhere"
    try:
        ledger, app, hook = _alerting(tmp_path, base + "/redirect")
        with ledger, Server(app) as srv:
            assert poll(lambda: len(_Hits.hits) >= 3, timeout=20), _Hits.hits
            w = srv.get("/healthz").json()["webhook"]
        # Every try went to the receiver's URL, none to where it pointed; none counted sent.
        assert {h for h in _Hits.hits} == {("POST", "/redirect")}, _Hits.hits
        assert w["sent"] == 0 and w["failures"] >= 3 and w["pending"] == 1 and w["alive"]
    finally:
        hook_server.shutdown()


class _Trickle(socketserver.BaseRequestHandler):
    """Reads the request, then answers one byte every 0.3 s, never finishing the head."""

    tries: list[tuple[float, float]] = []  # (connected, hung up by the client)

    def handle(self):
        t = time.monotonic()
        self.request.settimeout(30)
        with self.request.makefile("rb") as f:
            length = 0
            while (line := f.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            f.read(length)
        try:
            self.request.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            for _ in range(100):
                time.sleep(0.3)
                self.request.sendall(b"a")
        except OSError:
            pass
        self.tries.append((t, time.monotonic()))


@pytest.mark.slow
def test_a_trickling_receiver_is_cut_off_at_the_posts_total_timeout(tmp_path):
    _Trickle.tries = []
    slow = socketserver.ThreadingTCPServer(("127.0.0.1", free_port()), _Trickle)
    slow.daemon_threads = True
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    try:
        ledger, app, hook = _alerting(tmp_path, f"http://127.0.0.1:{slow.server_address[1]}/")
        hook.timeout = 1.0
        with ledger, Server(app) as srv:
            # Each byte came within the socket timeout: the POST went on for 30 s before.
            assert poll(lambda: len(_Trickle.tries) >= 2, timeout=15), _Trickle.tries
            w = srv.get("/healthz").json()["webhook"]
        held = [end - start for start, end in _Trickle.tries]
        assert all(0.9 < h < 2.5 for h in held), held
        assert w["sent"] == 0 and w["failures"] >= 2 and w["alive"]
    finally:
        slow.shutdown()


@pytest.mark.parametrize("url", ["notaurl", "file:///etc/hostname", "ftp://127.0.0.1/x",
                                 "http://", "http://127.0.0.1:port/"])
def test_a_webhook_that_is_no_http_url_is_refused_at_start(tmp_path, url):
    with Ledger(tmp_path / "l.duckdb") as ledger, pytest.raises(TallyError, match="--webhook"):
        create_app(ledger, webhook=url)
    if url not in ("notaurl", "file:///etc/hostname"):
        return
    # The real command: one line, status 2, no ledger made (it served, and its sender thread
    # died at the first alert while /healthz said ok; file:// counted as delivered).
    r = tally("serve", "--ledger", str(tmp_path / "new.duckdb"), "--port", str(free_port()),
               "--webhook", url, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("tally: error: --webhook") and "http" in r.stderr
    assert not (tmp_path / "new.duckdb").exists()


def test_a_dead_webhook_sender_makes_healthz_degraded(tmp_path):
    _Hits.hits = []
    hook_server = _served(_Hits)
    try:
        ledger, app, hook = _alerting(tmp_path, f"http://127.0.0.1:{hook_server.server_port}/")
        with ledger, Server(app) as srv:
            assert poll(lambda: hook.sent == 1, timeout=20)
            assert srv.get("/healthz").json()["status"] == "ok"
            # The sender thread dies of what it does not expect (a real exception, raised in
            # that thread): it had stopped silently while /healthz said ok.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(hook._thread.ident), ctypes.py_object(RuntimeError))
            hook.update("w", [])  # wakes it to run
            h = poll(lambda: (x := srv.get("/healthz").json())["status"] == "degraded" and x,
                     timeout=10)
            assert h and h["webhook"]["alive"] is False, h
            assert h["webhook"]["error"].startswith("RuntimeError")
    finally:
        hook_server.shutdown()


class _Proxy(BaseHTTPRequestHandler):
    """A forward proxy that takes every request itself: its request line and credentials."""

    seen: list[tuple[str, str | None]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((self.requestline, self.headers.get("Proxy-Authorization")))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_webhook_goes_through_the_proxy_the_environment_names(monkeypatch):
    """As urllib did (the sender no longer uses it: it followed redirects)."""
    from tally.api.alerts import Webhook

    _Proxy.seen = []
    proxy = _served(_Proxy)
    monkeypatch.setenv("http_proxy", f"http://u:p@127.0.0.1:{proxy.server_port}")
    monkeypatch.setenv("no_proxy", "")
    hook = Webhook("http://alerts.invalid:8080/hook?x=1#f", first_retry=0.2)
    try:
        hook.update("r", [{"name": "lag", "firing": True}])
        assert poll(lambda: hook.sent == 1, timeout=10), hook.failures
    finally:
        hook.close()
        proxy.shutdown()
    assert _Proxy.seen == [("POST http://alerts.invalid:8080/hook?x=1 HTTP/1.1", "Basic dTpw")]


def test_an_unhandled_error_answers_500_in_the_problem_shape_and_is_logged(tmp_path, caplog):
    spool = tmp_path / "spool"
    write_steps(spool, "r", host=0, hosts=1, steps=range(3), n=N, seed=0)
    ledger = Ledger(tmp_path / "l.duckdb")
    ingest(spool, ledger)
    with Server(create_app(ledger)) as srv:
        assert srv.get("/v1/runs").status_code == 200
        ledger.con.close()  # the ledger's connection gone under the service: a fault of its own
        with caplog.at_level(logging.ERROR, logger="tally.api"):
            r = srv.get("/v1/runs/r/coverage?step=1")
        p = _problem(r, 500)
        assert "internal error" in p.detail and "Traceback" not in r.text
        (rec,) = [x for x in caplog.records if x.name == "tally.api"]
        assert "GET /v1/runs/r/coverage" in rec.getMessage() and rec.exc_info is not None
        assert srv.get("/healthz").status_code == 500  # and it goes on answering


@pytest.mark.parametrize("cli", ["reconcile", "diff"])
@pytest.mark.slow
def test_a_run_at_step_2_55_gets_its_report_and_its_plots(tmp_path, cli):
    manifest = uniform_manifest(tmp_path / "m.parquet", 100)
    spool = tmp_path / "spool"
    from tally.audit.hook.writer import LedgerWriter

    for run, at in (("r", 2**55), ("s", 2**55)):
        with LedgerWriter(spool, run, records_per_epoch=100, fsync=False) as w:
            w.write_batch(at, unpacked_batch(0 if run == "r" else 1, n_records=100))
    out = tmp_path / "out"
    args = (["reconcile", "--spool", str(spool), "--run", "r"] if cli == "reconcile" else
            ["diff", "--a", f"{spool}:r", "--b", f"{spool}:s"])
    r = tally(*args, "--manifest", str(manifest), "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr  # "math domain error", and no report, before
    page = (out / ("report.html" if cli == "reconcile" else "diff.html")).read_text()
    assert "<svg" in page and str(2**55) in page


def test_problems_are_documented_with_their_media_type(sparse):
    schema = sparse.get("/openapi.json").json()
    post = schema["paths"]["/v1/runs/{run_id}/exposure"]["post"]["responses"]
    assert "413" in post and schema["paths"]["/v1/runs/{run_id}/preflight"]["post"][
        "responses"]["413"]
    for content in (post["413"]["content"], post["422"]["content"]):
        assert content["application/problem+json"]["schema"] == {
            "$ref": "#/components/schemas/Problem"}
    steps = schema["paths"]["/v1/runs/{run_id}/steps"]["get"]
    assert {"limit", "cursor"} <= {p["name"] for p in steps["parameters"]}
    assert "Link" in steps["responses"]["200"]["headers"]
