"""Links that work where the report is read (issue 33, points 1 and 2), in headless Chromium:
report.html opened from disk, made with and without `tally reconcile --api-url`; the same page
served by a service with --token; a record lookup of a train record the run never consumed;
and the dashboard asked for a run that does not exist.

The run is per-host shuffle seeds (tests/test_pages.py's `bad`): its findings name steps,
hosts, repeated records and records never consumed."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tally.api.app import create_app
from tally.audit.ledger.database import Ledger
from tests.support.api import Server, poll
from tests.support.browser import Browser, chromium, needs_chromium
from tests.support.cli import tally
from tests.test_pages import HELDOUT, N, _manifest, _write_run

# Reconcile reports built by the job and served, followed in Chromium.
pytestmark = pytest.mark.slow

TOKEN = "s3cret-token"
API_URL = "http://tally.example:8000/audit"  # a service behind a path prefix
# Every link of a page that leads somewhere (a table's CSV download is a data: URL, the page's
# own content): as written, and as the browser resolved it.
LINKS = ("[...document.links].filter((a) => !a.href.startsWith('data:'))"
         ".map((a) => [a.getAttribute('href'), a.href])")



def _reconcile(root: Path, out: str, *extra: str) -> Path:
    done = tally("reconcile", "--spool", root / "spool", "--manifest", root / "manifest.parquet",
                 "--run", "bad", "-o", root / out, "-q", *extra, timeout=120)
    assert done.returncode == 0, done.stderr
    return root / out


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Two runs' spool and manifest, and the bad run's report made by the real CLI, once
    with no service in mind and once for one at API_URL."""
    root = tmp_path_factory.mktemp("links")
    for run_id in ("bad", "good"):
        _write_run(root / "spool", run_id)
    _manifest(root / "manifest.parquet")
    return root, _reconcile(root, "report"), _reconcile(root, "report-api", "--api-url",
                                                        API_URL)


@pytest.fixture(scope="module")
def browser():
    if chromium() is None:
        pytest.skip("needs chromium")
    with Browser() as b:
        yield b


@pytest.fixture(scope="module")
def served(made):
    """A service with --token over the spool, serving the report made for API_URL."""
    root, _, with_api = made
    with Ledger(root / "ledger.duckdb") as ledger:
        app = create_app(ledger, spool=root / "spool", manifest=root / "manifest.parquet",
                         reports=with_api, token=TOKEN, interval=0.05)
        with Server(app) as srv:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            assert poll(lambda: len(srv.get("/v1/runs", headers=auth).json()) == 2
                        and srv.get("/v1/runs/bad", headers=auth).json()["state"]
                        == "finished", timeout=60), "the spool was never ingested"
            yield srv


def _evidence_links(page) -> list[list[str]]:
    return page.eval("[...document.querySelectorAll('.evidence a')].map("
                     "(a) => [a.getAttribute('href'), a.dataset.api])")


@needs_chromium
def test_report_from_disk_links_into_its_own_tables(made, browser):
    """No --api-url: every link is an anchor of the page (none `file:///v1/...`), and the row
    it leads to shows the numbers, a never-consumed record's included."""
    _, report, _ = made
    page = browser.open((report / "report.html").as_uri())
    links = page.eval(LINKS)
    assert links and all(href.startswith("#") for href, _ in links), links
    missing = page.eval(f"{LINKS}.filter(([h]) => !document.getElementById(h.slice(1)))")
    assert missing == []
    ev = _evidence_links(page)
    records = [href for href, api in ev if "/records/" in api]
    assert len(records) >= 10
    rows = page.eval("""Object.fromEntries([...document.querySelectorAll(
        'table[data-evidence-table="records"] tr[id]')].map((tr) => [tr.id,
        [...tr.cells].map((td) => td.textContent)]))""")
    never = [h[1:] for h in records if rows[h[1:]][4] == "never consumed"]
    assert never and all(rows[a][1] == "0" for a in never)
    # Clicking one scrolls to its row.
    page.eval(f"document.querySelector('.evidence a[href=\"#{never[0]}\"]').click()")
    assert page.wait(f"location.hash === '#{never[0]}'")


@needs_chromium
def test_report_made_for_a_service_links_to_it(made, browser):
    """--api-url: every link opens that service's API (under its path prefix)."""
    _, _, with_api = made
    page = browser.open((with_api / "report.html").as_uri())
    links = page.eval(LINKS)
    assert links and all(url.startswith(API_URL + "/v1/runs/bad") for _, url in links), links
    ev = _evidence_links(page)
    assert ev and all(href == API_URL + api for href, api in ev)


def test_api_url_must_be_a_service_url(made, tmp_path):
    root, _, _ = made
    done = tally("reconcile", "--spool", root / "spool", "--manifest", root / "manifest.parquet",
                 "--run", "bad", "-o", tmp_path / "r", "--api-url", "tally.example:8000",
                 timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "not an http(s) URL" in done.stderr and not (tmp_path / "r").exists()


@needs_chromium
def test_served_report_links_answer_with_the_pages_token(served, browser):
    """Served with --token, the page's links (made for another address) open this service's
    API and answer 200 followed with nothing but the token the page was opened with."""
    srv = served
    page = browser.open(f"{srv.url}/runs/bad/report.html?token={TOKEN}")
    links = [url for _, url in page.eval(LINKS) if not urlsplit(url).fragment]
    assert len(links) >= 20 and any("/records/" in u for u in links)
    for url in links:  # the API's answers, and the run's summary as its dashboard page
        assert url.startswith((srv.url + "/v1/runs/bad/", srv.url + "/?run=bad&")), url
        got = httpx.get(url, timeout=30)
        assert got.status_code == 200, (url, got.text)
    assert f"{srv.url}/?run=bad&token={TOKEN}" in links
    # The query token opens these answers only, and only the right token does.
    for path in ("/v1/runs/bad", "/v1/runs/bad/hosts"):
        assert httpx.get(f"{srv.url}{path}?token={TOKEN}").status_code == 401
    wrong = links[0].replace(TOKEN, "nope")
    assert httpx.get(wrong).status_code == 401


def test_a_never_consumed_train_record_is_an_answer(made, served):
    """The records the evidence names as never consumed: 200, exposures 0, said so. A key that
    is no train record (held out, or beyond the manifest) is still a 404."""
    _, report, _ = made

    rep = json.loads((report / "report.json").read_text())
    never = {x["record_key"] for f in rep["findings"] for x in
             (f.get("evidence") or {}).get("records", []) if x.get("exposures") == 0}
    assert len(never) >= 5
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for key in sorted(never):
        got = served.get(f"/v1/runs/bad/records/{key}", headers=auth)
        assert got.status_code == 200, got.text
        body = got.json()
        assert body["exposures"] == 0 and body["segments"] == [] and body["never_consumed"]
        assert body["record_keys"] == [key]
    seen = next(x["record_key"] for f in rep["findings"] for x in
                (f.get("evidence") or {}).get("records", []) if x.get("exposures"))
    assert "never_consumed" not in served.get(f"/v1/runs/bad/records/{seen}",
                                              headers=auth).json()
    for key in (N + HELDOUT - 1, 10**12):
        got = served.get(f"/v1/runs/bad/records/{key}", headers=auth)
        assert got.status_code == 404 and "never consumed" in got.text


@needs_chromium
def test_an_unknown_run_is_said_so_with_the_runs_that_exist(served, browser):
    srv = served
    page = browser.open(f"{srv.url}/?run=nope&token={TOKEN}", "document.body.dataset.updated")
    shown = page.eval("""({unknown: !document.getElementById('unknown').hidden,
        runview: !document.getElementById('runview').hidden,
        text: document.getElementById('unknown').innerText,
        runs: [...document.querySelectorAll('#knownruns a')].map((a) => [a.dataset.run,
                                                                        a.getAttribute('href')]),
        verdict: document.getElementById('verdict').dataset.verdict || null})""")
    assert shown["unknown"] and not shown["runview"] and shown["verdict"] is None
    assert "No run nope in this ledger" in shown["text"]
    assert shown["runs"] == [["bad", f"/?run=bad&token={TOKEN}"],
                             ["good", f"/?run=good&token={TOKEN}"]]
    # A known run from that page is one click away.
    page.eval("document.querySelector('#knownruns a[data-run=\"good\"]').click()")
    page.wait("location.search.startsWith('?run=good') && document.body.dataset.updated && "
              "!document.getElementById('runview').hidden")
