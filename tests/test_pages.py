"""The pages people read, looked at in headless Chromium (tests/browser.py: the DOM, computed
styles and element boxes of the rendered page): the dashboard's run list and run view and the
report.html the service serves, for a correct run and a faulty one (per-host shuffle seeds),
both reconciled live by a real service over a real spool. Each check asks whether the picture
shows the fault: the first bad step marked (and not on the correct run), bar labels carrying
the counts, a heatmap without its diagonal, legends in their series' colours, round axis
ticks, formatted alert values, findings with evidence that links to the API's answers.

Set TALLY_SCREENSHOTS=DIR to keep a PNG of every page looked at (for a person to judge)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tally.api.app import create_app
from tally.api.models import LiveFindings
from tally.audit import load_report
from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.reconcile.html import heatmap_chart
from tally.audit.render.charts import nice_ticks
from tally.audit.render.vocabulary import MAX_HEATMAP_HOSTS, PALETTE
from tests.support.api import Server, poll
from tests.support.browser import Browser, chromium, needs_chromium
from tests.support.manifest import CODE_EVERY_THIRD, content_hash_of, keyed_manifest

N, HELDOUT, HOSTS, ROWS = 600, 24, 4, 2  # 8 records a step: one epoch in 75 steps
STEPS = N // (HOSTS * ROWS)
RUNS = ("good", "bad")



def _manifest(path: Path) -> Path:
    return keyed_manifest(path, N, HELDOUT, hashes=content_hash_of, tokens=32,
                          domains=CODE_EVERY_THIRD, fingerprint="feed")


def _write_run(spool: Path, run_id: str) -> None:
    """4 hosts, one epoch. `good`: one shuffle, sliced per host; `bad`: each host shuffles with
    its own seed, then slices (records repeat and others are never seen), and a repeated
    record's loss is lower (what memorising it does)."""
    rng = np.random.default_rng(3)
    seen: set[int] = set()
    orders = {h: (np.random.default_rng(7).permutation(N) if run_id == "good" else
                  np.random.default_rng(100 + h).permutation(N))[h::HOSTS] for h in range(HOSTS)}
    writers = [LedgerWriter(spool, run_id, host=h, host_count=HOSTS, records_per_epoch=N,
                            fsync=False, flush_every=25) for h in range(HOSTS)]
    for step in range(STEPS):
        for h, w in enumerate(writers):
            keys = orders[h][ROWS * step: ROWS * step + ROWS]
            again = np.array([int(k) in seen for k in keys])
            seen.update(int(k) for k in keys)
            loss = 5.0 - 0.01 * step + rng.normal(0, 0.1, ROWS) - 0.5 * again
            w.write_segments(step, Segments.build(
                row=np.arange(ROWS), record_key=keys, n_tokens=np.full(ROWS, 32),
                content_hash=content_hash_of(keys), epoch=np.zeros(ROWS, np.int64), loss=loss))
            w.log_metric(step, "train_loss", float(loss.mean()))
            if h == 0 and step % 25 == 24:
                w.log_metric(step, "heldout_loss", 5.2 - 0.002 * step)
    for w in writers:
        w.finish()
        w.close()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A service over both runs' spool, each run reconciled by the service itself (its live
    findings, whose report.html it serves)."""
    root = tmp_path_factory.mktemp("pages")
    spool = root / "spool"
    for run_id in RUNS:
        _write_run(spool, run_id)
    manifest = _manifest(root / "manifest.parquet")
    with Ledger(root / "ledger.duckdb") as ledger:
        app = create_app(ledger, spool=spool, manifest=manifest, interval=0.05,
                         findings_every=3600)
        with Server(app) as srv:
            done = poll(lambda: all((srv.get(f"/v1/runs/{r}").json().get("findings") or {})
                                    .get("verdict") for r in RUNS), timeout=120, every=0.5)
            assert done, "the service never reconciled both runs"
            reports = {r: json.loads((root / "ledger.duckdb.findings" / r / "report.json")
                                     .read_text()) for r in RUNS}
            yield srv, reports, root


@pytest.fixture(scope="module")
def site(service):
    """The service and one browser."""
    if chromium() is None:
        pytest.skip("needs chromium")
    srv, reports, root = service
    with Browser() as browser:
        yield srv, browser, reports, root


def _shot(page, name: str) -> None:
    folder = os.environ.get("TALLY_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(Path(folder) / f"{name}.png")


# JavaScript run in the page: what a chart shows, read from the rendered SVG.
CHART = """(sel) => { const svg = document.querySelector(sel); if (!svg) return null;
  const fill = (e) => getComputedStyle(e).fill;
  return {
    legend: [...svg.querySelectorAll('.legend text')].map((t) => ({
      name: t.textContent, fill: fill(t), attr: t.getAttribute('fill')})),
    series: [...svg.querySelectorAll('[data-series]:not(text)')].map((e) => ({
      name: e.getAttribute('data-series'), stroke: getComputedStyle(e).stroke,
      fill: fill(e), attrFill: e.getAttribute('fill'), attrStroke: e.getAttribute('stroke')})),
    marker: [...svg.querySelectorAll('[data-marker="first-bad-step"]')].map((m) =>
      +m.getAttribute('data-step')),
    axes: [...svg.querySelectorAll('g.axes')].map((g) => [g.getAttribute('data-x-title'),
      g.getAttribute('data-y-title')]),
    yticks: [...svg.querySelectorAll('g.axes text.tick')].filter((t) =>
      t.getAttribute('text-anchor') === 'end').map((t) => t.textContent),
    barLabels: [...svg.querySelectorAll('text.bar-label')].map((t) => t.textContent),
    bars: [...svg.querySelectorAll('rect[data-bin]')].map((r) => ({
      series: r.getAttribute('data-series'), bin: r.getAttribute('data-bin'),
      value: +r.getAttribute('data-value'), height: r.getBBox().height})),
    cells: [...svg.querySelectorAll('rect.cell')].map((r) => r.getAttribute('data-hosts')),
    counts: [...svg.querySelectorAll('text.count')].map((t) => t.textContent),
    hostLabels: [...svg.querySelectorAll('text.host-label')].map((t) => t.textContent),
    scale: svg.querySelector('.scale') ? +svg.querySelector('.scale').getAttribute('data-max')
      : null,
  }; }"""


def chart(page, selector: str) -> dict:
    return page.eval(f"({CHART})({json.dumps(selector)})")


def _rgb(hex_color: str) -> str:
    h = hex_color.lstrip("#")
    return "rgb({}, {}, {})".format(*(int(h[i:i + 2], 16) for i in (0, 2, 4)))


def assert_legend_in_series_colours(c: dict) -> None:
    """Each legend entry is painted in its series' colour (no stylesheet greys it out), and
    each series is drawn in its legend's colour, or in the colour of a legend entry that is
    no series (a bar "off the ideal", the area "behind the ideal")."""
    assert c["legend"], "a chart without a legend"
    names = {s["name"] for s in c["series"]}
    marks = {i["attr"].lower() for i in c["legend"] if i["name"] not in names}
    colours = {i["attr"].lower() for i in c["legend"]}

    def colour_of(s: dict) -> str | None:
        return s["attrStroke"] if s["attrStroke"] not in (None, "", "none") else s["attrFill"]

    for item in c["legend"]:
        assert item["fill"] == _rgb(item["attr"]), item  # what the browser paints
        drawn = [s for s in c["series"] if s["name"] == item["name"]]
        for s in drawn:
            if colour_of(s):  # a group carries its colour for its bars
                assert colour_of(s).lower() in {item["attr"].lower()} | marks, (item, s)
    # Every series drawn has its colour in the legend, whatever its name is keyed by (a series
    # keyed "due" under the legend entry "due exposures" was checked by nothing above).
    for s in c["series"]:
        if colour_of(s):
            assert colour_of(s).lower() in colours, (s, c["legend"])


def assert_round_ticks(labels: list[str]) -> None:
    """Tick values at equal, round steps (1, 2, 2.5 or 5 times a power of ten)."""
    values = [float(x.replace("%", "").replace(",", "")) for x in labels]
    assert len(values) >= 3, labels
    steps = {round(b - a, 9) for a, b in zip(values, values[1:], strict=False)}
    assert len(steps) == 1, labels
    step = abs(steps.pop())
    mantissa = step / 10 ** np.floor(np.log10(step))
    assert any(abs(mantissa - m) < 1e-6 for m in (1, 2, 2.5, 5)), labels


@needs_chromium
def test_run_list_is_the_home_and_links_each_run(site):
    srv, browser, reports, _ = site
    page = browser.open(srv.url + "/", "document.body.dataset.updated")
    _shot(page, "dashboard-home")
    rows = page.eval("""[...document.querySelectorAll('#runlist tbody tr')].map((tr) => ({
        run: tr.dataset.run, link: tr.querySelector('a.run').getAttribute('href'),
        cells: [...tr.querySelectorAll('td')].map((td) => td.textContent.trim()),
        report: tr.querySelector('a[href*="report.html"]').getAttribute('href'),
        verdict: tr.querySelector('[data-verdict]').dataset.verdict}))""")
    assert [r["run"] for r in rows] == ["bad", "good"]
    by = {r["run"]: r for r in rows}
    for run_id in RUNS:
        assert by[run_id]["link"] == f"/?run={run_id}"
        assert by[run_id]["report"] == f"/runs/{run_id}/report.html"
        # Columns: run, verdict, reconcile, alerts, state, attempts, hosts, last step,
        # coverage, ideal, ...
        cells = by[run_id]["cells"]
        assert cells[4] == "finished" and cells[5] == "1" and cells[6] == "4"
        assert cells[7] == str(STEPS - 1)
        assert cells[8] == f"{100 * reports[run_id]['coverage']['coverage']:.1f}%"
    assert by["good"]["verdict"] == "PASS" and by["bad"]["verdict"] == "FAIL"
    # The list is paged (Link: rel="next"); the page reads every page.
    assert page.eval("getAll('/v1/runs?limit=1').then((r) => r.map((x) => x.run_id))") == \
        ["bad", "good"]
    # One click away: the run view.
    page.eval("document.querySelector('tr[data-run=\"bad\"] a.run').click()")
    page.wait("location.search === '?run=bad' && document.body.dataset.updated && "
              "!document.getElementById('runview').hidden")


@needs_chromium
@pytest.mark.parametrize("run_id", RUNS)
def test_dashboard_run_view_shows_the_fault(site, run_id):
    srv, browser, reports, _ = site
    rep = reports[run_id]
    page = browser.open(f"{srv.url}/?run={run_id}",
                        "document.body.dataset.updated && document.querySelector("
                        "'#domains [data-chart]') !== null || document.querySelector("
                        "'#domains rect') !== null")
    _shot(page, f"dashboard-{run_id}")
    assert page.eval("JSON.stringify(PALETTE)") == json.dumps(PALETTE, separators=(",", ":"))
    # One verdict vocabulary: the live reconcile's verdict, shown as report.html shows it.
    assert page.eval("document.getElementById('verdict').dataset.verdict") == rep["verdict"]
    assert page.eval("document.querySelector('[data-kind=reconcile]').textContent") == \
        rep["verdict"]
    assert page.eval("document.getElementById('reportlink').getAttribute('href')") == \
        f"/runs/{run_id}/report.html"
    # Alert values as numbers people read, never a raw float.
    alerts = page.eval("[...document.querySelectorAll('#alerts li')].map((l) => l.textContent)")
    assert alerts and not any(re.search(r"\d\.\d{4,}", a) for a in alerts), alerts
    behind = next(a for a in alerts if "coverage_behind_ideal" in a)
    assert re.search(r"coverage_behind_ideal: \d+\.\d\d% \(threshold 2\.00%", behind), behind

    charts = {name: chart(page, f"#{name}") for name in (
        "steps", "coverage", "histogram", "overlap", "loss", "domains")}
    for name, c in charts.items():
        if name != "overlap":
            assert_legend_in_series_colours(c)
            assert c["axes"] and all(x and y for x, y in c["axes"]), (name, c["axes"])
    for name in ("loss", "steps"):
        assert_round_ticks(charts[name]["yticks"])
    # The first bad step, marked where the reconcile found it; nothing on the correct run.
    first_bad = rep["first_bad_step"]
    for name in ("steps", "coverage"):
        assert charts[name]["marker"] == ([] if first_bad is None else [first_bad]), name
    # Histogram bars carry their counts, and a bar above zero is visible.
    hist = charts["histogram"]
    actual = {b["bin"]: b for b in hist["bars"] if b["series"] == "actual"}
    assert {k: v["value"] for k, v in actual.items()} == rep["coverage"]["histogram"]
    for b in actual.values():
        assert f"{b['value']:,}" in hist["barLabels"]
        assert (b["height"] >= 2) == (b["value"] > 0)
    # Overlap without the diagonal: 4 x 3 cells, host labels, a colour scale.
    ov = charts["overlap"]
    assert len(ov["cells"]) == HOSTS * (HOSTS - 1)
    assert all(len(set(c.split(","))) == 2 for c in ov["cells"])
    assert ov["hostLabels"] == [str(h) for h in range(HOSTS)] * 2 or \
        sorted(ov["hostLabels"]) == sorted([str(h) for h in range(HOSTS)] * 2)
    m = rep["hosts"]["overlap_matrix"]
    assert ov["scale"] == max(m[i][j] for i in range(HOSTS) for j in range(HOSTS) if i != j)
    assert len(ov["counts"]) == HOSTS * (HOSTS - 1)
    # Per domain: planned vs actual, both domains.
    assert {b["bin"] for b in charts["domains"]["bars"]} == {"web", "code"}
    # The findings, each with its evidence, linking to the API.
    found = page.eval("""[...document.querySelectorAll('#findings li.finding')].map((li) => ({
        code: li.dataset.code, links: [...li.querySelectorAll('a[data-api]')].map(
        (a) => a.getAttribute('href'))}))""")
    assert [f["code"] for f in found] == [f["code"] for f in rep["findings"]]
    if run_id == "good":
        assert not found
        return
    links = [a for f in found for a in f["links"]]
    assert any(re.fullmatch(r"/v1/runs/bad/records/\d+", a) for a in links)
    assert any(re.fullmatch(r"/v1/runs/bad/steps\?start=\d+&end=\d+&bucket=1", a) for a in links)
    assert any(re.fullmatch(r"/v1/runs/bad/hosts/\d/steps", a) for a in links)
    # A record's link shows the API's answer (fetched with the page's token, if any).
    page.eval("document.querySelector('#findings [data-evidence=records] a').click()")
    answer = page.wait("(() => { const t = document.getElementById('answer').textContent;"
                       " return t.includes('HTTP') && t; })()")
    assert "HTTP 200" in answer and '"segments"' in answer


@needs_chromium
@pytest.mark.parametrize("run_id", RUNS)
def test_report_html_served_and_shows_the_fault(site, run_id):
    srv, browser, reports, _ = site
    rep = reports[run_id]
    r = srv.get(f"/runs/{run_id}/report.html")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert srv.get("/runs/nope/report.html").status_code == 404
    page = browser.open(f"{srv.url}/runs/{run_id}/report.html")
    _shot(page, f"report-{run_id}")
    assert page.eval("document.querySelector('[data-verdict]').dataset.verdict") == rep["verdict"]
    names = page.eval("[...document.querySelectorAll('svg[data-chart]')].map("
                      "(s) => s.dataset.chart)")
    assert names == ["per-step", "coverage", "histogram", "overlap", "loss", "domains"]
    charts = {n: chart(page, f'svg[data-chart="{n}"]') for n in names}
    for n, c in charts.items():
        if n != "overlap":
            assert_legend_in_series_colours(c)
            assert c["axes"] and all(x and y for x, y in c["axes"]), n
    first_bad = rep["first_bad_step"]
    assert (first_bad is None) == (run_id == "good")
    for n in ("per-step", "coverage", "loss"):
        assert charts[n]["marker"] == ([] if first_bad is None else [first_bad]), n
    assert_round_ticks(charts["loss"]["yticks"])
    assert_round_ticks(charts["per-step"]["yticks"])
    # Per step: the repeats within an epoch, one bar per step, as the steps table has them.
    series = page.eval("""[...document.querySelectorAll('svg[data-chart="per-step"] g[data-series]'
        )].map((g) => [g.dataset.series, [...g.querySelectorAll('rect')].reduce(
        (a, r) => a + +r.getAttribute('data-value'), 0)])""")
    sums = dict(series)
    # A series without data has no bars and no group (the correct run repeats nothing).
    assert sums.get("within_epoch", 0) == rep["coverage"]["epoch_duplicates"]
    assert sums["new"] == rep["coverage"]["seen"]
    hist = charts["histogram"]
    for b in hist["bars"]:
        if b["series"] == "actual":
            assert b["value"] == rep["coverage"]["histogram"][b["bin"]]
            assert f"{b['value']:,}" in hist["barLabels"]
            assert (b["height"] >= 2) == (b["value"] > 0)
    ov = charts["overlap"]
    assert len(ov["cells"]) == HOSTS * (HOSTS - 1) and len(ov["counts"]) == HOSTS * (HOSTS - 1)
    assert sorted(set(ov["hostLabels"])) == [str(h) for h in range(HOSTS)]
    # Empty tables are left out; the ones with rows are there.
    sections = page.eval("[...document.querySelectorAll('section[id]')].map((s) => s.id)")
    assert "restarts" not in sections and "gaps" not in sections
    assert "repeated-batches" not in sections
    assert {"epochs", "hosts", "domains", "integrity"} <= set(sections)
    # Evidence links go to the API, which answers them.
    links = page.eval("[...document.querySelectorAll('.evidence a')].map("
                      "(a) => a.getAttribute('href'))")
    assert bool(links) == (run_id == "bad")
    for path in links[:3] + [x for x in links if "/records/" in x][:2]:
        got = srv.get(path)
        assert got.status_code in (200, 404), path  # 404: a record never consumed, said so
        if "/records/" in path and got.status_code == 404:
            assert "never consumed" in got.text


def test_heatmap_of_256_hosts_shows_the_hosts_that_share_most():
    rng = np.random.default_rng(0)
    k = 256
    m = np.zeros((k, k), np.int64)
    busy = [3, 77, 140, 200]  # hosts whose loaders read what the others read
    for h in busy:
        m[h, :] += rng.integers(5, 50, k)
        m[:, h] += rng.integers(5, 50, k)
    np.fill_diagonal(m, 1000)
    per_host = [{"host": h, "overlap_with_others": int(m[h].sum() - m[h, h])} for h in range(k)]
    svg = heatmap_chart(m.tolist(), per_host)
    shown = int(re.search(r'data-hosts-shown="(\d+)"', svg).group(1))
    assert shown == MAX_HEATMAP_HOSTS and 'data-hosts="256"' in svg
    cells = re.findall(r'class="cell" data-value="(\d+)" data-hosts="(\d+),(\d+)"', svg)
    assert len(cells) == shown * (shown - 1) and all(a != b for _, a, b in cells)
    hosts = {int(a) for _, a, _ in cells}
    assert set(busy) <= hosts  # the hosts that share most are the ones shown
    assert "16 of 256 hosts" in svg
    labels = re.findall(r'class="host-label"[^>]*>(\d+)<', svg)
    assert sorted({int(x) for x in labels}) == sorted(hosts)


def test_ticks_are_round():
    assert nice_ticks(0, 1, 4) == [0, 0.25, 0.5, 0.75, 1]
    assert nice_ticks(3.62, 5.13, 5) == [4.0, 4.5, 5.0]
    assert nice_ticks(0, 74, 6, integer=True) == [0, 20, 40, 60]


@pytest.mark.slow
def test_evidence_is_what_the_ledger_says(service):
    """The bad run's evidence, computed by the reconcile job in its buckets, against the live
    API's own answers from the ledger: each record's exposures and where they were seen, the
    steps with the most within-epoch repeats, the hosts with the most."""
    srv, reports, root = service
    rep = reports["bad"]
    (f,) = [f for f in rep["findings"] if f["code"] == "with_replacement"]
    ev = f["evidence"]
    repeated = [x for x in ev["records"] if x["exposures"]]
    assert len(repeated) == 5 and [x["epoch_repeats"] for x in repeated] == sorted(
        (x["epoch_repeats"] for x in repeated), reverse=True)
    for x in repeated:
        got = srv.get(x["api"]).json()["segments"]
        seen = sorted((s["step"], s["host"]) for s in got if not s["rolled_back"])
        assert len(seen) == x["exposures"] == x["epoch_repeats"] + 1  # one epoch
        assert [(s["step"], s["host"]) for s in x["seen"]] == seen[:8]
        assert x["hosts"] == len({h for _, h in seen})
    never = [x for x in ev["records"] if x["exposures"] == 0]
    assert never and all(srv.get(x["api"]).json()["never_consumed"] for x in never)
    steps = pq.read_table(root / "ledger.duckdb.findings" / "bad" / "steps.parquet").to_pydict()
    by_step = dict(zip(steps["step"], steps["epoch_repeats"], strict=True))
    assert [s["repeats"] for s in ev["steps"]] == sorted(by_step.values(), reverse=True)[:5]
    assert all(by_step[s["step"]] == s["repeats"] for s in ev["steps"])
    for s in ev["steps"][:2]:  # the API's step series at that step: its repeats are there
        api = srv.get(s["api"]).json()
        assert api["step"] == [s["step"]] and api["repeats"][0] >= s["repeats"]
    per_host = {p["host"]: p["epoch_repeats"] for p in rep["hosts"]["per_host"]}
    assert [h["repeats"] for h in ev["hosts"]] == sorted(per_host.values(), reverse=True)
    for h in ev["hosts"]:
        assert srv.get(h["api"]).status_code == 200


@pytest.mark.slow
def test_live_findings_and_loaded_reports_keep_their_evidence(service):
    """What the summary serves is what its OpenAPI model says (first bad step, evidence), and a
    report loaded in a notebook keeps each finding's evidence."""
    srv, reports, root = service
    found = srv.get("/v1/runs/bad").json()["findings"]
    LiveFindings.model_validate(found)  # extra fields are refused: the schema names them all
    assert found["first_bad_step"] == reports["bad"]["first_bad_step"] is not None
    assert [f.get("evidence") for f in found["findings"]] == \
        [f.get("evidence") for f in reports["bad"]["findings"]]
    loaded = load_report(root / "ledger.duckdb.findings" / "bad")
    assert [f.evidence for f in loaded.findings] == \
        [f.get("evidence") for f in reports["bad"]["findings"]]
    assert any(f.evidence for f in loaded.findings)
    table = loaded.findings_table().to_pylist()
    assert [json.loads(r["evidence"]) if r["evidence"] else None for r in table] == \
        [f.evidence for f in loaded.findings]
