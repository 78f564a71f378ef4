"""The live API on a real uvicorn server while real writers publish spool files: exactly-once
ingest, every endpoint, errors, bearer token, webhook, and the dashboard in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest

from tally.api.alerts import Thresholds
from tally.api.app import create_app
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tests.support import ROOT
from tests.support.api import Server, free_port, poll, write_steps
from tests.support.browser import chromium, needs_chromium
from tests.support.manifest import CODE_EVERY_THIRD, content_hash_of, keyed_manifest

N, HELDOUT = 150, 10


def write_manifest(path: Path) -> Path:
    return keyed_manifest(path, N, HELDOUT, hashes=content_hash_of, tokens=64,
                          domains=CODE_EVERY_THIRD, fingerprint="f00d")


@pytest.mark.slow
def test_live_ingest_every_endpoint_exactly_once(tmp_path):
    spool, reports = tmp_path / "spool", tmp_path / "reports"
    spool.mkdir()
    (reports / "r").mkdir(parents=True)
    (reports / "r" / "report.json").write_text(json.dumps({"run_id": "r", "verdict": "PASS"}))
    manifest = write_manifest(tmp_path / "manifest.parquet")
    with Ledger(tmp_path / "ledger.duckdb") as ledger:
        app = create_app(ledger, spool=spool, manifest=manifest, reports=reports, interval=0.05)
        with Server(app) as srv:
            assert srv.get("/v1/runs").json() == []
            # Two hosts publish while the server ingests.
            written = []
            threads = [threading.Thread(target=lambda h=h: written.append(write_steps(
                spool, "r", host=h, hosts=2, steps=range(40), n=N, seed=h, flush_every=3,
                outside={5: N + 2}))) for h in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            total = sum(written)
            s = poll(lambda: (x := srv.get("/v1/runs/r").json()).get("rows_ingested") == total
                     and x)
            assert s, "rows never all appeared"
            # Exactly once: the same numbers as SQL over the ledger; a second ingest adds none.
            eff = ledger.query("""SELECT count(*) FILTER (WHERE record_key < 150) AS ex,
                count(DISTINCT record_key) FILTER (WHERE record_key < 150) AS seen,
                count(*) AS rows FROM effective_consumption WHERE "offset" = 0""")[0]
            cov = s["coverage"]
            assert (cov["exposures"], cov["seen"]) == (eff["ex"], eff["seen"])
            assert cov["outside"] == {"records": 1, "exposures": 2}  # held-out key, both hosts
            assert ledger.query("SELECT count(*) AS n FROM consumption")[0]["n"] == total
            again = ingest(spool, ledger)
            assert again.files == 0 and again.already > 0
            assert srv.get("/v1/runs/r").json()["exposures"] == s["exposures"]

            runs = srv.get("/v1/runs").json()
            assert [r["run_id"] for r in runs] == ["r"] and runs[0]["last_step"] == 39
            dom = srv.get("/v1/runs/r/domains").json()
            assert {d["domain"] for d in dom} == {"web", "code"}
            assert sum(d["exposures"] for d in dom) == cov["exposures"]
            assert sum(d["records"] for d in dom) == N

            key = ledger.query("SELECT record_key AS k, count(*) AS n FROM consumption "
                               "GROUP BY ALL ORDER BY n DESC, k LIMIT 1")[0]
            rec = srv.get(f"/v1/runs/r/records/{key['k']}").json()
            assert len(rec["segments"]) == key["n"] and rec["record_keys"] == [key["k"]]
            assert {"step", "host", "attempt", "epoch", "rolled_back"} <= set(rec["segments"][0])
            h = int(content_hash_of(np.array([key["k"]]))[0])
            by_hash = srv.get(f"/v1/runs/r/records?content_hash={h:#x}").json()
            assert by_hash["segments"] == rec["segments"]
            # A 64-bit hash as 0x and 16 hex digits: exact in JavaScript too.
            assert {x["content_hash"] for x in rec["segments"]} == {f"{h:#018x}"}

            m = srv.get("/v1/runs/r/metrics").json()
            assert [x["step"] for x in m["milestones"]] == [9, 19, 29, 39]
            assert m["milestones"][0]["ppl"] == {"web": 91.0}
            assert m["milestones"][0]["train_loss"] == pytest.approx(5.0 - 0.09 + 0.0005)
            assert len(m["train_loss"]["step"]) == 40
            assert srv.get("/v1/runs/r/report").json()["verdict"] == "PASS"
            hs = srv.get("/v1/runs/r/hosts/1/steps?points=10").json()
            assert hs["bucket"] == 4 and len(hs["step"]) == 10

            text = srv.get("/metrics").text
            assert re.search(r'^tally_coverage_ratio\{run="r"\} 0\.\d+$', text, re.M)
            assert 'tally_host_rows_ingested_total{host="1",run="r"}' in text
            assert 'tally_alert{alert="ingest_lag",run="r"} 0.0' in text
            assert srv.get("/healthz").json()["status"] == "ok"

            # Bad input: 404 with a message, 422 for bad parameters.
            for path, code, words in (
                    ("/v1/runs/nope", 404, "unknown run"),
                    ("/v1/runs/r/records/999999", 404, "never consumed"),
                    ("/v1/runs/r/records?content_hash=99999999999999999999", 404,
                     "below 2**64"),
                    ("/v1/runs/r/hosts/7/steps", 404, "no host 7"),
                    ("/v1/runs/nope/report", 404, "no reconcile report"),
                    ("/v1/runs/r/coverage?step=-1", 422, "greater than or equal"),
                    ("/v1/runs/r/steps?bucket=0", 422, "greater than or equal"),
                    ("/v1/runs/r/records?content_hash=xyz", 422, "pattern"),
                    ("/v1/runs/bad%20id", 422, "pattern")):
                r = srv.get(path)
                assert r.status_code == code and words in r.text, (path, r.text)
    # Without a manifest, domains say why.
    with Ledger(tmp_path / "ledger.duckdb") as ledger, Server(create_app(ledger)) as srv:
        r = srv.get("/v1/runs/r/domains")
        assert r.status_code == 409 and "--manifest" in r.json()["detail"]
        assert srv.get("/v1/runs/r/coverage").json()["coverage"] is None


class _Hook(BaseHTTPRequestHandler):
    got: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).got.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_alerts_post_to_a_webhook(tmp_path):
    hook = HTTPServer(("127.0.0.1", free_port()), _Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    spool = tmp_path / "spool"
    spool.mkdir()
    try:
        with Ledger(tmp_path / "l.duckdb") as ledger, Server(create_app(
                ledger, spool=spool, records=N, interval=0.05,
                thresholds=Thresholds(host_overlap=None, coverage_behind=None),
                webhook=f"http://127.0.0.1:{hook.server_port}/hook")) as srv:
            # Random keys with replacement: some record repeats within an epoch.
            write_steps(spool, "w", host=0, hosts=1, steps=range(20), n=N, seed=3)
            assert poll(lambda: _Hook.got), "no webhook call"
            body = _Hook.got[0]
            assert body["run_id"] == "w" and body["status"] == "alert"
            assert body["started"] == ["epoch_duplicates"]
            s = srv.get("/v1/runs/w").json()
            assert s["status"] == "alert" and s["epoch_duplicates"] > 0
            assert 'tally_alert{alert="epoch_duplicates",run="w"} 1.0' in srv.get("/metrics").text
    finally:
        hook.shutdown()


@pytest.mark.slow
def test_serve_cli_requires_the_bearer_token(tmp_path):
    spool = tmp_path / "spool"
    write_steps(spool, "t", host=0, hosts=1, steps=range(5), n=N, seed=0)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TALLY_API_TOKEN": "s3cret"}
    proc = subprocess.Popen([sys.executable, "-m", "tally.audit.cli", "serve", "--ledger",
                             str(tmp_path / "l.duckdb"), "--spool", str(spool), "--port",
                             str(port), "--records", str(N)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer s3cret"}
    try:
        def up():
            try:
                return httpx.get(url + "/healthz", headers=auth, timeout=2).status_code == 200
            except httpx.TransportError:
                return proc.poll() is not None
        assert poll(up, timeout=60) and proc.poll() is None
        # (The schema and its pages, /openapi.json, /docs and /redoc, answer without it:
        # tests/test_api_docs.py.)
        for path in ("/healthz", "/v1/runs", "/v1/runs/t", "/", "/metrics"):
            assert httpx.get(url + path, timeout=5).status_code == 401, path
            assert httpx.get(url + path, headers={"Authorization": "Bearer nope"},
                             timeout=5).status_code == 401, path
            assert httpx.get(url + path, headers=auth, timeout=5).status_code in (200, 404), path
        assert poll(lambda: httpx.get(url + "/v1/runs/t", headers=auth, timeout=5)
                    .status_code == 200)
        assert httpx.get(url + "/?token=s3cret", timeout=5).status_code == 200
        # A run's report.html is a page too (409 here: no reports to serve), not a 401.
        assert httpx.get(url + "/runs/t/report.html?token=s3cret", timeout=5).status_code == 409
        assert httpx.get(url + "/runs/t/report.html", timeout=5).status_code == 401
        # A query token opens the pages, and the answers report.html's evidence links open
        # (tests/test_links.py): never the rest of the API, never a POST.
        for path in ("/v1/runs?token=s3cret", "/v1/runs/t?token=s3cret",
                     "/metrics?token=s3cret"):
            assert httpx.get(url + path, timeout=5).status_code == 401, path
        assert httpx.post(url + "/v1/runs/t/preflight?token=s3cret", timeout=5,
                          json={"checkpoint": "/tmp", "hosts": 1}).status_code == 401
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert f"http://127.0.0.1:{port}/" in out
    assert "serve: loading the state of" in out  # the start's progress


@needs_chromium
def test_dashboard_renders_plots_with_data_in_headless_chromium(tmp_path):
    spool = tmp_path / "spool"
    for h in range(3):
        write_steps(spool, "d", host=h, hosts=3, steps=range(60), n=N, seed=h, flush_every=20)
    with Ledger(tmp_path / "l.duckdb") as ledger:
        ingest(spool, ledger)
        with Server(create_app(ledger, records=N)) as srv, \
                tempfile.TemporaryDirectory() as profile:
            out = subprocess.run(
                [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
                 "--virtual-time-budget=10000", "--dump-dom", srv.url + "/?run=d"],
                capture_output=True, text=True, timeout=120)
    dom = out.stdout
    assert "data-updated" in dom, (dom[-2000:], out.stderr[-2000:])

    def points(series: str) -> int:
        m = re.search(rf'<polyline points="([^"]*)"[^>]*data-series="{series}"', dom)
        return len(m.group(1).split()) if m else 0

    assert points("coverage") == 60 and points("ideal") == 60
    assert points("train") == 60 and points("held-out") == 6
    bars = re.findall(r'data-series="actual" data-bin="([^"]+)" data-value="(\d+)"', dom)
    assert [b for b, _ in bars] == ["0", "1", "2", "3+"] and sum(int(v) for _, v in bars) == N
    cells = re.findall(r'class="cell" data-value="(\d+)"', dom)
    assert len(cells) == 6 and all(int(v) > 0 for v in cells)  # 3 x 2: every pair overlaps


@needs_chromium
def test_dashboard_heatmap_of_256_hosts_shows_those_sharing_most(tmp_path):
    """Beyond 64 hosts every host's shared records are numbers, so the heatmap's 16 hosts are
    the 16 that share the most, wherever they are (before, hosts 64.. had none to rank by)."""
    spool = tmp_path / "spool"
    for h in range(256):
        write_steps(spool, "w", host=h, hosts=256, steps=range(3), n=2000, seed=h,
                    flush_every=3, metrics=False)
    with Ledger(tmp_path / "l.duckdb") as ledger:
        ingest(spool, ledger)
        with Server(create_app(ledger, records=2000)) as srv, \
                tempfile.TemporaryDirectory() as profile:
            per_host = srv.get("/v1/runs/w/hosts").json()["per_host"]
            out = subprocess.run(
                [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
                 "--virtual-time-budget=10000", "--dump-dom", srv.url + "/?run=w"],
                capture_output=True, text=True, timeout=120)
    dom = out.stdout
    svg = re.search(r'<svg[^>]*data-chart="overlap"[^>]*>', dom)
    assert svg, (dom[-2000:], out.stderr[-2000:])
    assert 'data-hosts-shown="16"' in svg.group(0) and 'data-hosts="256"' in svg.group(0)
    shown = sorted({int(a) for a in re.findall(r'data-hosts="(\d+),\d+"', dom)})
    rank = sorted(per_host, key=lambda p: (-p["overlap_with_others"], p["host"]))
    assert shown == sorted(p["host"] for p in rank[:16]) and max(shown) >= 64, shown


def test_coverage_universe_from_writer_metadata_and_cached_answers(tmp_path):
    """Without a manifest or --records, coverage is over the records_per_epoch the run's
    writers recorded; answers cached between ingests change when an ingest lands."""
    spool = tmp_path / "spool"
    write_steps(spool, "w", host=0, hosts=1, steps=range(10), n=N, seed=1, flush_every=5,
                records_per_epoch=N)
    write_steps(spool, "plain", host=0, hosts=1, steps=range(5), n=N, seed=2, flush_every=5)
    with Ledger(tmp_path / "ledger.duckdb") as ledger:
        ingest(spool, ledger)
        for records, source in ((None, "writer metadata"), (40, "records option")):
            with Server(create_app(ledger, records=records)) as srv:
                c = srv.get("/v1/runs/w/coverage").json()
                n = records or N
                want = ledger.query(f"""SELECT count(DISTINCT record_key) AS seen FROM
                    effective_consumption JOIN runs USING (run) WHERE run_id = 'w'
                    AND "offset" = 0 AND record_key < {n}""")[0]["seen"]
                assert (c["train_records"], c["universe"], c["seen"]) == (n, source, want)
                assert c["coverage"] == pytest.approx(want / n)
                # Keys the writer said are inside; under --records 40 most are outside.
                assert (c["outside"]["records"] > 0) == (records is not None)
                assert srv.get("/v1/runs/w").json()["coverage"] == c
                p = srv.get("/v1/runs/plain/coverage").json()
                assert p["universe"] == ("unknown" if records is None else source)
        with Server(create_app(ledger)) as srv:
            before = srv.get("/v1/runs/w/steps?bucket=1").json()
            assert srv.get("/v1/runs/w/steps?bucket=1").json() == before
            om = {"Accept": "application/openmetrics-text"}
            scraped = [host_rows(srv.get("/metrics", headers=h).text) for h in ({}, om)]
            write_steps(spool, "w", host=0, hosts=1, steps=range(10, 15), n=N, seed=3,
                        flush_every=5, records_per_epoch=N)
            ingest(spool, ledger)
            after = srv.get("/v1/runs/w/steps?bucket=1").json()
            assert after["step"] == before["step"] + list(range(10, 15))
            assert srv.get("/v1/runs/w").json()["last_step"] == 14
            # The per-host series, kept encoded between versions, follow the new one.
            for h, old in zip(({}, om), scraped, strict=True):
                assert host_rows(srv.get("/metrics", headers=h).text) == {
                    **old, "w": old["w"] + 5 * 8}


def host_rows(scrape: str) -> dict[str, float]:
    """tally_host_rows_ingested of host 0, per run, from a scrape."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^tally_host_rows_ingested(?:_total)?\{host="0",run="([^"]+)"\} (\S+)$', scrape, re.M)}


def test_answers_asked_for_are_ready_after_each_ingest_round(tmp_path):
    spool = tmp_path / "spool"
    write_steps(spool, "r", host=0, hosts=1, steps=range(5), n=N, seed=1, flush_every=5)
    with Ledger(tmp_path / "ledger.duckdb") as ledger:
        app = create_app(ledger, spool=spool, records=N, interval=0.05)
        svc = app.state.service
        with Server(app) as srv:
            assert poll(lambda: srv.get("/v1/runs/r").json().get("last_step") == 4)
            first = srv.get("/v1/runs/r/steps?bucket=2").json()
            write_steps(spool, "r", host=0, hosts=1, steps=range(5, 9), n=N, seed=2,
                        flush_every=4)
            def newest() -> int:
                return ledger.query("SELECT max(file_id) AS g FROM segments")[0]["g"]

            gen = newest()

            def ready() -> bool:  # the new version's answer, computed with no request
                g = newest()
                key = (g, "steps", "r", None, None, 2, 500)
                return g > gen and key in svc.live._answers

            assert poll(ready)
            after = srv.get("/v1/runs/r/steps?bucket=2").json()
            assert after["step"] == [0, 2, 4, 6, 8] and after["step"][:3] == first["step"]


def test_an_answer_is_computed_once_for_concurrent_requests_and_refreshed_behind_them(tmp_path):
    """Requests for one answer of one version compute it once; while the service ingests
    (`revalidate`), a request after a new version gets the previous answer at once while the
    refresh thread computes the new one, never one older than STALE_S; without ingest, each
    answer is of the request's own snapshot."""
    from tally.audit.ledger import queries as q
    from tally.audit.ledger.live import LiveLedger

    spool = tmp_path / "spool"
    write_steps(spool, "r", host=0, hosts=1, steps=range(4), n=N, seed=1, flush_every=4)
    with Ledger(tmp_path / "ledger.duckdb") as ledger:
        ingest(spool, ledger)
        live = LiveLedger(ledger, q.Universe(N, "records option"))
        calls: list[int] = []

        def last_step(snap) -> int:
            calls.append(snap.gen)
            threading.Event().wait(0.3)  # long enough for every request to arrive meanwhile
            return snap.cur.execute("SELECT max(step) FROM consumption").fetchone()[0]

        def ask() -> int:
            return live.answer(("last",), "r", last_step)

        def together(n: int) -> list[int]:
            got: list[int] = []
            threads = [threading.Thread(target=lambda: got.append(ask())) for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return got

        assert together(4) == [3] * 4 and len(calls) == 1
        more = lambda steps, seed: (write_steps(  # noqa: E731
            spool, "r", host=0, hosts=1, steps=steps, n=N, seed=seed, flush_every=4),
            ingest(spool, ledger))
        more(range(4, 6), 2)
        assert together(3) == [5] * 3 and len(calls) == 2  # read only: the new version, once

        live.revalidate = True
        more(range(6, 8), 3)
        assert ask() == 5 and len(calls) == 2  # the previous one, its refresh under way
        assert poll(lambda: ask() == 7, timeout=10) and len(calls) == 3  # refreshed, once
        live.STALE_S = 0.0  # too old to serve: the request computes the new version itself
        more(range(8, 10), 4)
        assert ask() == 9 and len(calls) == 4
        live.close()
