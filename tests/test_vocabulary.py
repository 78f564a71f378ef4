"""One vocabulary, provenance and browsing (issue 33, points 6 and 7): report.html and the
dashboard of the same run, read in headless Chromium, use the same titles, legends and colours
(audit/render/vocabulary.py), list only series with data, print the heatmap's numbers at
11 px or more, mark restarts on the step axis, show content drift with the corpus source of
the drifted records, and let every table download as CSV (equal to the table); report.json and
diff.json carry the Tally version, the command line and each input's path and fingerprint; the
sentences beside the numbers agree with them.

Two runs of 4 hosts over one epoch, each restarted: `good` (one shuffle, a restart at step 40
that rolled nothing back, every record seen) and `bad` (per-host seeds; a restart at step 40
after attempt 0 had reached step 44, so 5 steps rolled back; host 2 consumed records whose
bytes differ from the manifest's, all from the corpus source "books")."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest

from tally.api.app import create_app
from tally.audit.core.words import plural
from tally.audit.extras import version
from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.render.vocabulary import CHARTS, HEATMAP_FONT_PX, PALETTE
from tests.support.api import Server, poll
from tests.support.browser import Browser, chromium, needs_chromium
from tests.support.cli import tally
from tests.support.manifest import CODE_EVERY_THIRD, content_hash_of, keyed_manifest

# Reports and diffs built by the jobs and served, read in Chromium.
pytestmark = pytest.mark.slow

N, HOSTS, ROWS = 600, 4, 2
STEPS = N // (HOSTS * ROWS)  # 75: one epoch
RESUME = 40
ROOT = Path(__file__).resolve().parents[1]



def _manifest(path: Path) -> Path:
    return keyed_manifest(path, N, hashes=content_hash_of, tokens=32, domains=CODE_EVERY_THIRD,
                          sources=("crawl", "books"), fingerprint="feed")


def _write_run(spool: Path, run_id: str) -> None:
    orders = {h: (np.random.default_rng(7).permutation(N) if run_id == "good" else
                  np.random.default_rng(100 + h).permutation(N))[h::HOSTS] for h in range(HOSTS)}
    # Attempt 0 reaches step 39 (good) or 44 (bad: 5 steps rolled back by the restart).
    for attempt, steps in ((0, range(RESUME if run_id == "good" else RESUME + 5)),
                           (1, range(RESUME, STEPS))):
        for h in range(HOSTS):
            w = LedgerWriter(spool, run_id, host=h, host_count=HOSTS, records_per_epoch=N,
                             attempt=attempt, resumed_from_step=RESUME if attempt else None,
                             fsync=False, flush_every=25)
            for step in steps:
                keys = orders[h][ROWS * step: ROWS * step + ROWS]
                hashes = content_hash_of(keys)
                if run_id == "bad" and h == 2 and 10 <= step < 13:
                    odd = keys % 2 == 1  # records of the source "books" drifted
                    hashes = np.where(odd, hashes + np.uint64(2), hashes)
                w.write_segments(step, Segments.build(
                    row=np.arange(ROWS), record_key=keys, n_tokens=np.full(ROWS, 32),
                    content_hash=hashes, epoch=np.zeros(ROWS, np.int64),
                    loss=np.full(ROWS, 5.0 - 0.01 * step)))
                w.log_metric(step, "train_loss", 5.0 - 0.01 * step)
            if attempt:
                w.finish()
            w.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocabulary")
    spool = root / "spool"
    for run_id in ("good", "bad"):
        _write_run(spool, run_id)
    manifest = _manifest(root / "manifest.parquet")
    reports = {}
    for run_id in ("good", "bad"):
        out = root / f"report-{run_id}"
        p = tally("reconcile", "--spool", spool, "--manifest", manifest, "--run", run_id,
                   "-o", out, "-q")
        assert p.returncode == 0, p.stderr
        reports[run_id] = (json.loads((out / "report.json").read_text()), out)
    return root, spool, manifest, reports


# ---- provenance ---------------------------------------------------------------------------

def _check_provenance(p: dict, command: str, inputs: list[tuple[str, str, Path]]) -> None:
    assert p["tally_version"] == version()
    assert p["command_line"][:2] == ["tally", command]
    got = [(i["role"], i["kind"], i["path"]) for i in p["inputs"]]
    assert got == [(role, kind, str(path.absolute())) for role, kind, path in inputs]
    for i in p["inputs"]:
        assert isinstance(i["fingerprint"], str) and len(i["fingerprint"]) >= 4, i


def test_report_json_carries_version_command_line_inputs_and_fingerprints(world):
    root, spool, manifest, reports = world
    rep, out = reports["bad"]
    p = rep["provenance"]
    _check_provenance(p, "reconcile", [("manifest", "manifest", manifest),
                                       ("consumption", "spool", spool)])
    assert "--run" in p["command_line"] and "bad" in p["command_line"]
    assert p["inputs"][0]["fingerprint"] == "feed"  # the manifest's own fingerprint
    # The spool's fingerprint is over the run's files: another run's files give another.
    assert p["inputs"][1]["fingerprint"] != \
        reports["good"][0]["provenance"]["inputs"][1]["fingerprint"]
    page = (out / "report.html").read_text()
    assert "data-provenance" in page and version() in page and str(spool) in page
    assert "<script" not in page  # the file report stays static


def test_diff_json_carries_version_command_line_inputs_and_fingerprints(world):
    root, spool, manifest, _ = world
    out = root / "diff"
    p = tally("diff", "--manifest", manifest, "-o", out, "--a", f"{spool}:good",
               "--b", f"{spool}:bad", "-q")
    assert p.returncode in (0, 1), p.stderr
    d = json.loads((out / "diff.json").read_text())
    _check_provenance(d["provenance"], "diff", [("manifest", "manifest", manifest),
                                                ("run A", "spool", spool),
                                                ("run B", "spool", spool)])
    assert [i.get("run_id") for i in d["provenance"]["inputs"][1:]] == ["good", "bad"]
    page = (out / "diff.html").read_text()
    assert "data-provenance" in page
    # Each of diff.html's tables downloads as CSV equal to the table.
    from html.parser import HTMLParser

    class Tables(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tables: dict[str, list[list[str]]] = {}
            self.links: dict[str, str] = {}
            self.now: str | None = None
            self.cell: list[str] | None = None

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "a" and "data-csv" in a:
                self.links[a["data-csv"]] = a["href"]
            elif tag == "table":
                self.now = a.get("data-table")
                self.tables[self.now] = []
            elif tag == "tr" and self.now:
                self.tables[self.now].append([])
            elif tag in ("td", "th") and self.now:
                self.cell = []

        def handle_endtag(self, tag):
            if tag in ("td", "th") and self.cell is not None and self.now:
                self.tables[self.now][-1].append("".join(self.cell))
                self.cell = None
            elif tag == "table":
                self.now = None

        def handle_data(self, data):
            if self.cell is not None:
                self.cell.append(data)

    t = Tables()
    t.feed(page)
    assert {"runs", "epochs", "windows", "domains"} <= set(t.tables), t.tables.keys()
    for name, rows in t.tables.items():
        href = t.links[f"diff-{name}"]
        assert _csv(unquote(href.split(",", 1)[1])) == rows, name


# ---- sentences ----------------------------------------------------------------------------

def test_sentences_agree_with_the_numbers(world):
    _, _, _, reports = world
    good, _ = reports["good"]
    # An epoch at 100% coverage is complete (it read "complete: no" without a later epoch).
    (epoch,) = good["epochs"]
    assert epoch["records"] == N and epoch["complete"] is True and epoch["skipped"] == 0
    # Plurals agree, and no finding says "(s)".
    assert plural(1, "step") == "1 step" and plural(2, "step") == "2 steps"
    assert plural(1_000, "record") == "1,000 records"
    for rep, _ in reports.values():
        assert not any("(s)" in f["message"] for f in rep["findings"]), rep["findings"]


# ---- the pages ----------------------------------------------------------------------------

# What a page shows, panel by panel: caption, legend entries (name, fill), series with data.
PANELS = """(() => Object.fromEntries([...document.querySelectorAll('figure[data-panel]')]
  .filter((f) => !f.hidden).map((f) => [f.dataset.panel, {
    title: f.querySelector('figcaption').textContent.trim().replace(/\\s+/g, ' '),
    legend: [...f.querySelectorAll('.legend text')].map((t) => [t.textContent,
      t.getAttribute('fill')]),
    drawn: [...f.querySelectorAll('[data-series]:not(text)')].filter((e) =>
      e.tagName !== 'g' || e.querySelector('rect')).map((e) => e.getAttribute('data-series')),
    restarts: [...f.querySelectorAll('[data-marker="restart"]')].map((m) =>
      +m.getAttribute('data-step')),
    heatmapFonts: [...f.querySelectorAll('text.count, text.host-label')].map((t) =>
      parseFloat(getComputedStyle(t).fontSize)),
    counts: f.querySelectorAll('text.count').length}])))()"""

LEGEND = {c: {s["name"]: s["color"] for s in v["series"]} for c, v in CHARTS.items()}
# A legend name -> the series key its marks carry (data-series), for the series that draw.
KEYS = {"steps": {"first exposure": "new", "due again in a later epoch": "earlier",
                  "repeated within its epoch": "within_epoch"},
        "coverage": {"coverage": "coverage", "ideal": "ideal",
                     "behind the ideal": "behind ideal"},
        "loss": {"due exposures": "due", "repeated exposures": "repeated",
                 "training loss": "train", "held-out": "held-out"}}


@pytest.fixture(scope="module")
def site(world):
    if chromium() is None:
        pytest.skip("needs chromium")
    root, spool, manifest, reports = world
    with Ledger(root / "ledger.duckdb") as ledger:
        app = create_app(ledger, spool=spool, manifest=manifest, interval=0.05,
                         findings_every=3600)
        with Server(app) as srv:
            done = poll(lambda: all((srv.get(f"/v1/runs/{r}").json().get("findings") or {})
                                    .get("verdict") for r in ("good", "bad")),
                        timeout=120, every=0.5)
            assert done, "the service never reconciled both runs"
            with Browser() as browser:
                yield srv, browser, reports


def _pages(srv, browser, run_id: str) -> tuple:
    dash = browser.open(f"{srv.url}/?run={run_id}",
                        "document.body.dataset.updated && !document.querySelector("
                        "'figure[data-panel=domains]').hidden")
    report = browser.open(f"{srv.url}/runs/{run_id}/report.html")
    return dash, report


@needs_chromium
@pytest.mark.parametrize("run_id", ["good", "bad"])
def test_report_and_dashboard_speak_one_vocabulary(site, run_id):
    srv, browser, _ = site
    dash, report = _pages(srv, browser, run_id)
    d, r = dash.eval(PANELS), report.eval(PANELS)
    assert dash.eval("JSON.stringify(PALETTE)") == json.dumps(PALETTE, separators=(",", ":"))
    shared = ["steps", "coverage", "histogram", "overlap", "loss", "domains"]
    assert [k for k in d if k in shared] == [k for k in r if k in shared] == shared
    for k in shared:
        assert d[k]["title"] == r[k]["title"] == CHARTS[k]["title"], k
        # Same legend entries, names and colours (the vocabulary's), in the same order.
        assert d[k]["legend"] == r[k]["legend"], (k, d[k]["legend"], r[k]["legend"])
        for name, colour in r[k]["legend"]:
            assert LEGEND[k][name].lower() == colour.lower(), (k, name)
    # Legends list only series with data: on the good run nothing repeats within its epoch,
    # and its coverage never falls behind the ideal.
    for page in (d, r):
        for k, names in KEYS.items():
            for name, _ in page[k]["legend"]:
                if name in names and name != "behind the ideal":
                    assert names[name] in page[k]["drawn"], (k, name, page[k]["drawn"])
        steps_legend = [n for n, _ in page["steps"]["legend"]]
        if run_id == "good":
            assert "repeated within its epoch" not in steps_legend
            assert "behind the ideal" not in [n for n, _ in page["coverage"]["legend"]]
        else:
            assert "repeated within its epoch" in steps_legend
        # Restarts (attempts) marked on the step axis of the step charts.
        for k in ("steps", "coverage", "loss"):
            assert page[k]["restarts"] == [RESUME], (k, page[k]["restarts"])
        # The heatmap's numbers readable: every count and host label at 11 px or more.
        fonts = page["overlap"]["heatmapFonts"]
        assert fonts and min(fonts) >= HEATMAP_FONT_PX, fonts
        assert page["overlap"]["counts"] == HOSTS * (HOSTS - 1)


@needs_chromium
def test_content_drift_shows_in_the_header_and_a_chart_with_its_source(site, world):
    srv, browser, reports = site
    rep, out = reports["bad"]
    assert rep["integrity"]["hash_mismatches"] > 0
    drifted = {s["source"]: s["mismatched_records"] for s in rep["sources"]}
    assert drifted["books"] > 0 and drifted["crawl"] == 0
    page = browser.open((out / "report.html").as_uri())
    fact = page.eval("document.querySelector('[data-fact=\"content drift\"]').textContent")
    assert "books" in fact and "crawl" not in fact
    bars = page.eval("[...document.querySelectorAll('figure[data-panel=drift] rect[data-bin]')]"
                     ".map((r) => [r.dataset.bin, +r.dataset.value])")
    assert bars == [["books", drifted["books"]]]
    good = browser.open((reports["good"][1] / "report.html").as_uri())
    assert good.eval("document.querySelector('[data-fact=\"content drift\"]')") is None
    assert good.eval("document.querySelector('figure[data-panel=drift]')") is None


# The rows of a table as CSV would have them (header first), and a CSV link's text.
TABLE_ROWS = """(id) => [...document.querySelectorAll(`table[data-table="${id}"] tr`)]
  .filter((r) => !r.hidden).map((r) => [...r.cells].map((c) => c.textContent.trim()))"""


def _csv(text: str) -> list[list[str]]:
    import csv
    import io
    return [row for row in csv.reader(io.StringIO(text))]


@needs_chromium
def test_every_table_downloads_as_csv_equal_to_the_table(site, world):
    srv, browser, reports = site
    rep, out = reports["bad"]
    page = browser.open((out / "report.html").as_uri())  # from disk: no script, no service
    tables = page.eval("[...document.querySelectorAll('table[data-table]')].map("
                       "(t) => t.dataset.table)")
    assert {"hosts", "epochs", "restarts", "domains"} <= set(tables)
    for t in tables:
        href = page.eval(f"document.querySelector('a[data-csv=\"{t}\"]').getAttribute('href')")
        assert href.startswith("data:text/csv"), t
        assert _csv(unquote(href.split(",", 1)[1])) == \
            page.eval(f"({TABLE_ROWS})({json.dumps(t)})"), t
    # The Evidence tables too, each with its CSV.
    evidence = page.eval("[...document.querySelectorAll('table[data-evidence-table]')].map("
                         "(t) => t.dataset.evidenceTable)")
    assert evidence, "the bad run's findings name steps, hosts or records"
    for t in evidence:
        href = page.eval(f"document.querySelector('a[data-csv=\"evidence-{t}\"]')"
                         ".getAttribute('href')")
        shown = page.eval(f"""[...document.querySelectorAll(
            'table[data-evidence-table="{t}"] tr')].map((r) => [...r.cells].map(
            (c) => c.textContent.trim()))""")
        assert _csv(unquote(href.split(",", 1)[1])) == shown, t
    # The restart that rolled back 5 steps says so; the good run's, which rolled back none,
    # has no "rolled back from".
    restarts = page.eval(f"({TABLE_ROWS})('restarts')")
    col = restarts[0].index("rolled back from")
    assert restarts[1][col] == str(RESUME)
    good = browser.open((reports["good"][1] / "report.html").as_uri())
    g = good.eval(f"({TABLE_ROWS})('restarts')")
    assert g[1][g[0].index("rolled-back steps")] == "0" and g[1][col] == "\u2013"
    epochs = good.eval(f"({TABLE_ROWS})('epochs')")
    assert epochs[1][epochs[0].index("complete")] == "yes"
    # The dashboard's run list: its CSV is the table as shown.
    dash = browser.open(srv.url + "/", "document.body.dataset.updated")
    dash.eval("document.querySelector('a[data-csv=runs]').click()")
    href = dash.eval("document.querySelector('a[data-csv=runs]').getAttribute('href')")
    assert _csv(unquote(href.split(",", 1)[1])) == dash.eval(f"({TABLE_ROWS})('runs')")


@needs_chromium
def test_served_tables_sort_and_filter_and_hosts_lead_with_the_evidence(site):
    srv, browser, reports = site
    rep, _ = reports["bad"]
    named = [h["host"] for f in rep["findings"] for h in (f.get("evidence") or {})
             .get("hosts", [])]
    assert named
    page = browser.open(f"{srv.url}/runs/bad/report.html",
                        "document.querySelector('input[data-filter=hosts]') !== null")
    rows = page.eval(f"({TABLE_ROWS})('hosts')")
    lead = list(dict.fromkeys(named))
    assert [int(r[0]) for r in rows[1:1 + len(lead)]] == lead
    # Sort by exposures (a click on its head), ascending then descending.
    col = rows[0].index("exposures")
    page.eval(f"document.querySelectorAll('table[data-table=hosts] th')[{col}].click()")
    asc = [int(r[col].replace(",", "")) for r in page.eval(f"({TABLE_ROWS})('hosts')")[1:]]
    assert asc == sorted(asc)
    page.eval(f"document.querySelectorAll('table[data-table=hosts] th')[{col}].click()")
    desc = [int(r[col].replace(",", "")) for r in page.eval(f"({TABLE_ROWS})('hosts')")[1:]]
    assert desc == sorted(asc, reverse=True)
    # Filter: only the rows that hold the text stay.
    page.eval("const f = document.querySelector('input[data-filter=hosts]'); f.value = '3';"
              "f.dispatchEvent(new Event('input'))")
    assert [r[0] for r in page.eval(f"({TABLE_ROWS})('hosts')")[1:]] == ["3"]
    # The dashboard's run list sorts too.
    dash = browser.open(srv.url + "/", "document.body.dataset.updated")
    dash.eval("document.querySelector('#runlist th').click()")
    dash.eval("document.querySelector('#runlist th').click()")
    assert [r[0] for r in dash.eval(f"({TABLE_ROWS})('runs')")[1:]] == ["good", "bad"]
