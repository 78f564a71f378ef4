"""diff.html: one self-contained page (inline SVG, no script, nothing fetched) with both runs
side by side: coverage vs step of both against their ideal on one plot, the per-step Jaccard
similarity, the histogram of exposure differences and the domain mix."""

from __future__ import annotations

import html

import numpy as np
import pyarrow as pa

from tally.audit.provenance import provenance_html
from tally.audit.render.charts import CSS, above, bars, csv_link, step_or_none

COLORS = {"a": "#0969da", "b": "#bf8700"}
MAX_POINTS = 600  # per polyline: keeps the file small for long runs


def _thin(n: int) -> np.ndarray:
    return np.linspace(0, n - 1, MAX_POINTS).astype(int) if n > MAX_POINTS else np.arange(n)


def lines(xs: np.ndarray, series: list[tuple[str, np.ndarray, str, bool]], *, y1: float = 1.0,
          marker: int | None = None, w: int = 560, h: int = 260) -> str:
    """A line chart of several series over the same x; y from 0 to y1, shown as percent.
    `series`: (name, ys, color, dashed); `marker`: an x to mark with a vertical line."""
    if not len(xs):
        return "<p>no steps</p>"
    idx = _thin(len(xs))
    xs = np.asarray(xs)[idx]
    x0, x1 = float(xs.min()), float(xs.max())
    x1 = x1 if x1 > x0 else above(x0)  # one step (at 2**55, x0 + 1 is x0 as a float)
    px = lambda x: 45 + (x - x0) / (x1 - x0) * (w - 60)  # noqa: E731
    py = lambda y: h - 25 - y / y1 * (h - 45)  # noqa: E731
    out = [f'<svg width="{w}" height="{h}" role="img">']
    for v in (0, .25, .5, .75, 1):
        out.append(f'<line x1="45" x2="{w - 10}" y1="{py(v * y1):.1f}" y2="{py(v * y1):.1f}" '
                   f'stroke="#eee"/><text x="4" y="{py(v * y1) + 4:.0f}">'
                   f'{int(v * y1 * 100)}%</text>')
    if marker is not None and x0 <= marker <= x1:
        out.append(f'<line x1="{px(marker):.1f}" x2="{px(marker):.1f}" y1="20" y2="{h - 25}" '
                   f'stroke="#cf222e" stroke-dasharray="2 2" data-marker="{marker}"/>')
    for i, (name, ys, color, dashed) in enumerate(series):
        ys = np.asarray(ys)[idx]
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys, strict=True))
        dash = ' stroke-dasharray="4 3"' if dashed else ""
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2"{dash} '
                   f'points="{pts}" data-series="{html.escape(name)}"/>'
                   f'<text x="{50 + i * 120}" y="14" fill="{color}">{html.escape(name)}</text>')
    out.append(f'<text x="45" y="{h - 6}">step {int(xs.min())}</text>'
               f'<text x="{w - 90}" y="{h - 6}">step {int(xs.max())}</text></svg>')
    return "".join(out)


def _table(rows: list[dict], cols: list[tuple[str, str]], name: str) -> str:
    """A table with its CSV as a download link (as report.html's tables have them)."""
    cells = [[_text(r[k]) for k, _ in cols] for r in rows]
    head = "".join(f"<th>{html.escape(t)}</th>" for _, t in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cs) + "</tr>"
                   for cs in cells)
    link = csv_link(f"diff-{name}", [t for _, t in cols], cells)
    return (f'<p><small>{link}</small></p><table data-table="{name}"><tr>{head}</tr>{body}'
            "</table>")


def _text(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def _replayed(run: dict) -> str:
    """A run's side in the runs table: whether `tally replay` wrote its consumption."""
    k = run.get("replayed_files", 0)
    if not k:
        return "no: recorded live"
    return "yes" if run.get("replayed") else f"{k:,} of {run['segment_files']:,} files"


def _replayed_banner(d: dict) -> str:
    """Each run whose consumption `tally replay` wrote says so above everything else."""
    out = []
    for r in "ab":
        run = d[r]
        k = run.get("replayed_files", 0)
        if not k:
            continue
        what = ("replayed: written by <code>tally replay</code> from the loader's contract, "
                "not recorded while the run trained; it shows what the loader feeds"
                if run.get("replayed") else
                f"{k:,} of {run['segment_files']:,} spool files written by <code>tally "
                "replay</code>, the rest recorded live")
        out.append(f'<p class="replayed" data-run="{r}" data-replayed='
                   f'"{str(bool(run.get("replayed"))).lower()}"><strong>{r.upper()} '
                   f"({html.escape(run['run_id'])}) {what}.</strong></p>\n")
    return "".join(out)


def render_html(d: dict, tables: dict[str, pa.Table]) -> str:
    steps = tables["steps"]
    col = {c: steps[c].to_numpy() for c in steps.column_names} if steps.num_rows else {}
    xs = col.get("step", np.zeros(0))
    coverage = lines(xs, [
        ("coverage A", col.get("coverage_a"), COLORS["a"], False),
        ("coverage B", col.get("coverage_b"), COLORS["b"], False),
        ("ideal A", col.get("ideal_coverage_a"), "#555", True),
        ("ideal B", col.get("ideal_coverage_b"), "#aaa", True)],
        marker=d["first_divergent_step"]) if len(xs) else "<p>no steps</p>"
    similarity = lines(xs, [("Jaccard", col.get("jaccard"), "#8250df", False)],
                       marker=d["first_divergent_step"]) if len(xs) else ""
    hist = d["exposure_difference_histogram"]
    total = sum(hist.values()) or 1
    labels = sorted(hist, key=int)
    diffs = bars(labels, {"records": [hist[k] / total for k in labels]})
    doms = d["domains"]
    mix = bars([x["domain"] for x in doms], {"A": [x["share_a"] for x in doms],
                                             "B": [x["share_b"] for x in doms]})
    runs = [{"": k, **{r: d[r].get(k) for r in "ab"}} for k in (
        "source", "run_id", "kind", "files", "attempts", "hosts", "segments", "exposures",
        "first_step", "last_step", "steps", "heldout_exposures", "unknown_keys")]
    runs.append({"": "coverage", **{r: f"{100 * (d[r]['coverage']['coverage'] or 0):.1f}%"
                                    for r in "ab"}})
    runs.append({"": "replayed", **{r: _replayed(d[r]) for r in "ab"}})
    finds = "".join(f"<li><b class='{f['severity']}'>{f['severity']}</b> "
                    f"{html.escape(f['message'])}</li>" for f in d["findings"])
    recs = d["records"]
    status = {"identical": "identical", "same_data_other_order": "same data, other order",
              "different": "different"}[d["status"]]
    epochs = _table(d["epochs"], [("epoch", "epoch"), ("exposures_a", "exposures A"),
                                  ("exposures_b", "exposures B"), ("records_a", "records A"),
                                  ("records_b", "records B"), ("common_records", "common"),
                                  ("jaccard", "Jaccard"), ("multiset_difference", "difference"),
                                  ("same_set", "same set"), ("same_multiset", "same multiset")],
                    "epochs")
    domains = _table(doms, [("domain", "domain"), ("records", "train records"),
                            ("exposures_a", "exposures A"), ("exposures_b", "exposures B"),
                            ("share_a", "share A"), ("share_b", "share B"),
                            ("share_difference", "A - B")], "domains")
    win = tables["windows"].to_pylist()
    windows = _table([x for x in win if x["steps_compared"]][:200], [
        ("first_step", "from step"), ("last_step", "to step"), ("steps_compared", "steps"),
        ("identical_steps", "identical"), ("jaccard", "Jaccard"),
        ("multiset_difference", "difference"), ("same_multiset", "same multiset"),
        ("other_order", "other order")], "windows")
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>Tally diff: {html.escape(d['a']['run_id'])} vs {html.escape(d['b']['run_id'])}</title>
<style>{CSS}</style></head><body>
<h1>A {html.escape(d['a']['run_id'])} vs B {html.escape(d['b']['run_id'])}:
<span class="{d['verdict']}">{status}</span></h1>
{_replayed_banner(d)}
<p>{d['identical_steps']:,} of {d['steps_compared']:,} steps identical; first divergent step
<b>{step_or_none(d['first_divergent_step'])}</b>; {recs['only_a']:,} records seen only by A,
{recs['only_b']:,} only by B, {recs['more_often_a']:,} more often by A,
{recs['more_often_b']:,} more often by B, {recs['same']:,} alike, of {recs['compared']:,} in the
manifest {html.escape(d['manifest']['fingerprint'])}{' (as of step ' + str(d['at_step']) + ')'
if d['at_step'] is not None else ''}.</p>
<ul>{finds}</ul>
<div class="grid">
<figure><figcaption>Coverage vs step, both runs (dashed: each run's ideal; red: first
divergent step)</figcaption>{coverage}</figure>
<figure><figcaption>Jaccard similarity of each step's record sets</figcaption>
{similarity}</figure>
<figure><figcaption>Exposure difference per record (A - B), share of records</figcaption>
{diffs}</figure>
<figure><figcaption>Domain mix of the exposures, A vs B</figcaption>{mix}</figure>
</div>
<h2>Runs</h2>{_table(runs, [("", ""), ("a", "A"), ("b", "B")], "runs")}
<h2>Epochs</h2>{epochs}
<h2>Windows of {d['windows']['steps']:,} steps</h2>{windows}
<h2>Domains</h2>{domains}
<p><small>Tally diff v{d['diff_version']}, generated {d['generated_at']}.</small></p>
{provenance_html(d.get('provenance'))}
</body></html>"""
