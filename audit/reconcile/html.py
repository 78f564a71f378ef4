"""report.html: one self-contained page with the verdict, the findings and their evidence, and
plots that show the fault (inline SVG, no script, nothing fetched).

Every chart has axis titles with units and a legend in its series' colours, and a colour means
one thing on every chart (PALETTE, shared with the live dashboard): blue what the run consumed
as it should, red what it consumed beyond the ideal (and the first bad step), grey the ideal
or the plan. Evidence links point at the live API (`tally serve`), which also serves this page
at /runs/{run}/report.html.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote, unquote, urlencode

import numpy as np
import pyarrow as pa

from tally.audit.core import exposure
from tally.audit.provenance import provenance_html
from tally.audit.reconcile import evidence
from tally.audit.render.charts import (
    CSS,
    MAX_POINTS,
    Chart,
    bars,
    cell_text,
    csv_link,
    decimals,
    esc,
    fmt_count,
    nice_ticks,
    round_up,
    step_or_none,
)

# Titles, legend names and colours: one vocabulary with the dashboard (it is served with it).
from tally.audit.render.vocabulary import (
    CHARTS,
    HEATMAP_CELL_PX,
    HEATMAP_FONT_PX,
    MAX_HEATMAP_HOSTS,
    PALETTE,
    heatmap_size,
)
from tally.audit.render.vocabulary import series as voc

MAX_BARS = 280  # per-step bars: steps are binned beyond this


# ---- charts ------------------------------------------------------------------------------

def per_step_chart(steps: pa.Table, first_bad: int | None,
                   restarts: Sequence[dict[str, Any]] = ()) -> str:
    """Exposures per step, stacked: records seen for the first time, records due again in a
    later epoch, and records repeated within their epoch (beyond the ideal); the first bad step
    marked. Long runs are binned, each bar summing its steps."""
    if not steps.num_rows:
        return ""
    s = steps["step"].to_numpy()
    new = steps["new_unique"].to_numpy()
    within = steps["epoch_repeats"].to_numpy()
    earlier = np.maximum(0, steps["repeats"].to_numpy() - within)
    lo, hi = int(s.min()), int(s.max())
    per = max(1, -(-(hi - lo + 1) // MAX_BARS))  # steps per bar
    b = (s - lo) // per
    nb = int(b.max()) + 1
    parts = [(voc("steps", k)["name"], v, voc("steps", k)["color"], k)
             for k, v in (("new", new), ("earlier", earlier), ("within_epoch", within))]
    sums = [np.bincount(b, weights=v, minlength=nb).astype(np.int64) for _, v, _, _ in parts]
    total = sum(sums)
    unit = "step" if per == 1 else f"{per} steps"
    c = Chart(lo, lo + nb * per, 0, round_up(1.15 * float(total.max()), True),  # room for
              name="per-step")  # the marker's label above the bars
    c.axes("step", f"exposures per {unit}", xticks=nice_ticks(lo, lo + nb * per, 6, True),
           yticks=nice_ticks(0, c.y1, 4, True))
    width = max(0.6, c.px(lo + per) - c.px(lo) - (0.4 if per == 1 else 0))
    base = np.zeros(nb, np.int64)
    for (name, _, color, series), v in zip(parts, sums, strict=True):
        rects = []
        for i in np.flatnonzero(v):
            y_top, y_base = c.py(base[i] + v[i]), c.py(base[i])
            height = max(2.0, y_base - y_top)  # a single repeat still shows
            rects.append(f'<rect x="{c.px(lo + i * per):.1f}" y="{y_base - height:.1f}" '
                         f'width="{width:.2f}" height="{height:.1f}" data-step="{lo + i * per}" '
                         f'data-value="{v[i]}"><title>step {lo + i * per}'
                         f'{"" if per == 1 else f"-{lo + i * per + per - 1}"}: {v[i]:,} {name}'
                         f'</title></rect>')
        base += v
        if rects:  # a series without data is neither drawn nor in the legend
            c.body.append(f'<g fill="{color}" data-series="{series}">{"".join(rects)}</g>')
    c.legend_of("steps", [k for (_, _, _, k), v in zip(parts, sums, strict=True) if v.any()])
    c.markers(first_bad, restarts)
    return c.svg()


def coverage_chart(steps: pa.Table, first_bad: int | None,
                   restarts: Sequence[dict[str, Any]] = ()) -> str:
    """Cumulative coverage against the ideal, the gap between them shaded."""
    if not steps.num_rows:
        return ""
    xs = steps["step"].to_numpy()
    cov = steps["coverage"].to_numpy()
    ideal = steps["ideal_coverage"].to_numpy()
    if len(xs) > MAX_POINTS:
        idx = np.linspace(0, len(xs) - 1, MAX_POINTS).astype(int)
        xs, cov, ideal = xs[idx], cov[idx], ideal[idx]
    c = Chart(float(xs.min()), float(xs.max()), 0, 1, name="coverage")
    c.axes("step", "coverage (% of train records)", yticks=[0, .25, .5, .75, 1],
           yfmt=lambda v: f"{v * 100:.0f}%")
    behind = bool((ideal - cov > 1e-9).any())
    if behind:
        pts = [f"{c.px(x):.1f},{c.py(y):.1f}" for x, y in zip(xs, ideal, strict=True)]
        pts += [f"{c.px(x):.1f},{c.py(y):.1f}" for x, y in zip(xs[::-1], cov[::-1],
                                                              strict=True)]
        c.body.append(f'<polygon points="{" ".join(pts)}" fill="{PALETTE["repeat"]}" '
                      'fill-opacity="0.15" data-series="behind ideal"/>')
    c.polyline(xs, ideal, PALETTE["ideal"], "ideal", dash=True, width=2.5)
    c.polyline(xs, cov, PALETTE["actual"], "coverage", width=2)
    c.legend_of("coverage", ["coverage", "ideal"] + (["behind"] if behind else []))
    c.markers(first_bad, restarts)
    return c.svg()


def histogram_chart(cov: dict[str, Any]) -> str:
    """Records seen 0, 1, 2, 3+ times against the ideal; counts on the bars, and the actual
    bars beyond the ideal (or short of it) in the repeat colour."""
    n = cov["train_records"] or 1
    hist = [cov["histogram"][b] for b in exposure.HIST_BINS]
    lo, hi = cov["ideal"]["min"], cov["ideal"]["max"]
    ideal = [0] * 4
    if cov["exposures"]:
        at_hi = cov["exposures"] - lo * n  # records at the ceiling
        for level, count in ((lo, n - at_hi), (hi, at_hi)):
            ideal[min(level, 3)] += count
    else:
        ideal[0] = n
    off = [PALETTE["repeat"] if (hist[i] and (i > hi or i < lo) and not (i == 3 and hi >= 3))
           else None for i in range(4)]
    return bars([f"{b}" for b in exposure.HIST_BINS],
                {"actual": [x / n for x in hist], "ideal": [x / n for x in ideal]},
                counts={"actual": hist, "ideal": ideal},
                colors={"actual": PALETTE["actual"], "ideal": PALETTE["ideal"]},
                bar_colors={"actual": off} if any(off) else None,
                xtitle="times a record was seen", ytitle="records (% of train records)",
                name="histogram")


def heatmap_chart(matrix: list[list[int]], per_host: list[dict[str, Any]],
                  max_hosts: int = MAX_HEATMAP_HOSTS) -> str:
    """Records each pair of hosts both saw, without the diagonal (a host with itself), with
    host labels, counts in the cells and a colour scale. Beyond `max_hosts` hosts, the ones
    sharing the most records with others (every host is in the Hosts table). Row i of the
    matrix is `per_host[i]`'s host (the hosts that sent rows: their numbers may be sparse)."""
    k = len(matrix)
    if not k:
        return ""
    arr = np.asarray(matrix, dtype=np.int64)
    name = [p["host"] for p in per_host] if len(per_host) == k else list(range(k))
    hosts = list(range(k))  # positions in the matrix
    if k > max_hosts:
        shared = [p["overlap_with_others"] for p in per_host] if len(per_host) == k else [0] * k
        hosts = sorted(sorted(hosts, key=lambda h: (-shared[h], h))[:max_hosts])
    sub = arr[np.ix_(hosts, hosts)]
    off = ~np.eye(len(hosts), dtype=bool)
    top = int(sub[off].max()) if off.any() else 0
    size = heatmap_size(len(hosts))  # cells wide enough for their numbers at 11 px
    cell = size / len(hosts)
    left, top_pad = 44, 26
    out = [f'<svg width="{left + size + 90}" height="{top_pad + size + 62}" role="img" '
           f'data-chart="overlap" data-hosts-shown="{len(hosts)}" data-hosts="{k}">']
    text_cells = cell >= HEATMAP_CELL_PX - 1e-9
    for a, i in enumerate(hosts):
        for b, j in enumerate(hosts):
            x, y = left + b * cell, top_pad + a * cell
            if i == j:
                out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{cell:.1f}" '
                           f'height="{cell:.1f}" fill="#f6f8fa" class="self"><title>host {name[i]} '
                           f'itself: {int(arr[i, i]):,} records</title></rect>')
                continue
            v = int(arr[i, j])
            t = 0.0 if top == 0 else v / top
            alpha = 0 if v == 0 else 0.08 + 0.92 * t  # none shared: a blank cell
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{cell:.1f}" height="{cell:.1f}" '
                       f'fill="{PALETTE["shared"]}" fill-opacity="{alpha:.3f}" '
                       f'stroke="#fff" class="cell" data-value="{v}" '
                       f'data-hosts="{name[i]},{name[j]}"><title>hosts {name[i]} and '
                       f'{name[j]}: {v:,} records both saw</title></rect>')
            if text_cells:
                ink = "#fff" if t > 0.55 else "#1f2328"
                out.append(f'<text x="{x + cell / 2:.1f}" y="{y + cell / 2 + 4:.1f}" '
                           f'text-anchor="middle" class="count" fill="{ink}" '
                           f'style="fill:{ink};font-size:{HEATMAP_FONT_PX}px">'
                           f'{fmt_count(v)}</text>')
    # Labels at 11 px, every `step`-th where a label is wider than its cell.
    font = HEATMAP_FONT_PX
    step = max(1, math.ceil(len(hosts) / 16), math.ceil(
        (0.62 * font * len(str(name[hosts[-1]])) + 4) / cell))
    for a, h in enumerate(hosts):
        if a % step:
            continue
        pos = (a + .5) * cell
        out.append(f'<text x="{left - 4}" y="{top_pad + pos + 4:.1f}" text-anchor="end" '
                   f'class="host-label" style="font-size:{font}px">{name[h]}</text>'
                   f'<text x="{left + pos:.1f}" '
                   f'y="{top_pad - 6}" text-anchor="middle" class="host-label" '
                   f'style="font-size:{font}px">{name[h]}</text>')
    # The colour scale: from none shared to the most any pair shared.
    sx, sy, sh = left + size + 18, top_pad, size
    out.append('<defs><linearGradient id="shared-scale" x1="0" y1="1" x2="0" y2="0">'
               f'<stop offset="0" stop-color="{PALETTE["shared"]}" stop-opacity="0.08"/>'
               f'<stop offset="1" stop-color="{PALETTE["shared"]}" stop-opacity="1"/>'
               '</linearGradient></defs>'
               f'<rect x="{sx}" y="{sy}" width="12" height="{sh}" fill="url(#shared-scale)" '
               f'class="scale" data-max="{top}"/>'
               f'<text x="{sx + 16}" y="{sy + 9}" class="scale-label">{fmt_count(top)}</text>'
               f'<text x="{sx + 16}" y="{sy + sh}" class="scale-label">0</text>'
               f'<text x="{left + size / 2:.1f}" y="{top_pad + size + 18}" text-anchor="middle"'
               ' class="axis-title">host (column), host (row): records both saw</text>')
    notes = (["no record was seen by two hosts"] if top == 0 else []) + (
        [f"{len(hosts)} of {k} hosts: those sharing the most records with others"]
        if len(hosts) < k else [])
    for i, note in enumerate(notes):
        out.append(f'<text x="{left + size / 2:.1f}" y="{top_pad + size + 34 + 14 * i}" '
                   f'text-anchor="middle" class="note">{note}</text>')
    return "".join(out) + "</svg>"


def loss_chart(section: dict | None, first_bad: int | None,
               restarts: Sequence[dict[str, Any]] = ()) -> str:
    """Mean training loss per window: due exposures, repeated (excess) ones, and the held-out
    loss at the milestones."""
    if not section or not section.get("windows"):
        return ""
    ws = section["windows"]
    series = [
        (voc("loss", "due")["name"],
         [x["first_step"] for x in ws if x["due"]["mean_loss"] is not None],
         [x["due"]["mean_loss"] for x in ws if x["due"]["mean_loss"] is not None],
         PALETTE["actual"], "due"),
        (voc("loss", "repeated")["name"], [x["first_step"] for x in ws
                                if x["excess"]["mean_loss"] is not None],
         [x["excess"]["mean_loss"] for x in ws if x["excess"]["mean_loss"] is not None],
         PALETTE["repeat"], "repeated"),
        (voc("loss", "held-out")["name"], [m["step"] for m in section.get("milestones", [])],
         [m["heldout_loss"] for m in section.get("milestones", [])], PALETTE["heldout"],
         "held-out"),
    ]
    ys = [y for _, _, v, _, _ in series for y in v if y is not None and np.isfinite(y)]
    xs = [x for _, k, _, _, _ in series for x in k]
    if not ys:
        return ""
    ticks = nice_ticks(min(ys), max(ys), 5)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1
    y0 = ticks[0] - step if ticks[0] > min(ys) else ticks[0]  # round values at both ends
    y1 = ticks[-1] + step if ticks[-1] < max(ys) else ticks[-1]
    ticks = nice_ticks(y0, y1, 5)
    c = Chart(min(xs), max(xs), y0, y1, name="loss")
    digits = decimals(ticks)
    c.axes("step", "mean training loss (nats)", yticks=ticks, yfmt=lambda v: f"{v:.{digits}f}")
    for _, sx, sy, color, key in series:
        if sx:
            c.polyline(np.asarray(sx, float),
                       np.asarray([np.nan if y is None else y for y in sy], float), color, key)
    c.legend_of("loss", [key for _, sx, _, _, key in series if sx])
    c.markers(first_bad, restarts)
    return c.svg()


def domain_chart(doms: list[dict[str, Any]]) -> str:
    if not doms:
        return ""
    return bars([d["domain"] for d in doms],
                {"planned": [d["planned_share"] for d in doms],
                 "actual": [d["actual_share"] for d in doms]},
                colors={"planned": PALETTE["ideal"], "actual": PALETTE["actual"]},
                xtitle="domain", ytitle="share of exposures (%)", name="domains")


def drift_chart(drifted: list[dict[str, Any]]) -> str:
    """Content drift by corpus source (the manifest's `source`): the consumed records whose
    bytes differ from the manifest's, with their counts; nothing without drift."""
    if not drifted:
        return ""
    total = sum(x["mismatched_records"] for x in drifted) or 1
    s = voc("drift", "mismatched")
    return bars([x["source"] for x in drifted],
                {s["name"]: [x["mismatched_records"] / total for x in drifted]},
                counts={s["name"]: [x["mismatched_records"] for x in drifted]},
                colors={s["name"]: s["color"]}, xtitle="corpus source (manifest)",
                ytitle="share of mismatched records (%)", name="drift")


# ---- tables and findings -----------------------------------------------------------------

def table(title: str, rows: list[dict[str, Any]], cols: list[tuple[str, str]],
          section: str, note: str = "") -> str:
    """A titled table, or nothing at all when it has no rows."""
    if not rows:
        return ""
    cells = [[cell_text(r.get(k)) for k, _ in cols] for r in rows]
    head = "".join(f"<th>{esc(t)}</th>" for _, t in cols)
    body = "".join(f"<tr{_row_attrs(r)}>" + "".join(f"<td>{esc(c)}</td>" for c in cs) + "</tr>"
                   for r, cs in zip(rows, cells, strict=True))
    link = csv_link(section, [t for _, t in cols], cells)
    return (f'<section id="{section}"><h2>{esc(title)} <small>{link}</small></h2>{note}'
            f'<table data-table="{section}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table></section>")


def _row_attrs(r: dict[str, Any]) -> str:
    return ' data-evidence="yes"' if r.get("_evidence") else ""


def _cell(v: Any) -> str:
    return esc(cell_text(v))


class Links:
    """Where report.html's evidence links lead. Made for a service (`tally reconcile --api-url
    URL`): to that service's API answers (`URL/v1/...`). Made for no service: to the rows of
    the page's own Evidence tables (`#ev-...`, evidence.anchor), which a copy opened from disk,
    attached to a ticket, still has. Each link keeps its API path in `data-api`, from which
    `tally serve` points it at its own API with the page's token (`served`)."""

    def __init__(self, api_url: str | None = None) -> None:
        self.api_url = api_url.rstrip("/") if api_url else None

    def href(self, api: str, item: dict[str, Any] | None = None) -> str:
        """An API path's link: on the service when there is one, else the item's row (or,
        for no item, the Evidence section)."""
        if self.api_url is not None:
            return self.api_url + api
        return "#" + (evidence.anchor(item) if item is not None else "evidence")

    def a(self, item: dict[str, Any], text: str) -> str:
        if not item.get("api"):
            return esc(text)
        return (f'<a href="{esc(self.href(item["api"], item))}" data-api="{esc(item["api"])}">'
                f"{esc(text)}</a>")


# An evidence link as `Links.a` writes it, or as a report written before `data-api` had it.
_API_LINK = re.compile(r'<a href="[^"]*" data-api="([^"]*)"|<a href="(/v1/[^"]*)"')
_RUN_SUMMARY = re.compile(r"/v1/runs/([^/?]+)")


def served(page: str, token: str | None) -> str:
    """report.html as `tally serve` serves it: every evidence link to the service's own API
    (root-relative, as the dashboard's requests are), carrying the token the page was opened
    with (the API takes it by query on the answers these links open: tally.api.app.PAGES), whatever
    the page was made for; the run's summary link to its dashboard page (a page, where the
    summary is shown, as a query token opens no other answer)."""
    tok = {"token": token} if token else {}

    def to_api(m: re.Match) -> str:
        api = html.unescape(m.group(1) or m.group(2))
        run = _RUN_SUMMARY.fullmatch(api)
        if run is not None:
            href = "/?" + urlencode({"run": unquote(run.group(1)), **tok})
        else:
            href = api + ("&" if "?" in api else "?") + urlencode(tok) if tok else api
        return f'<a href="{esc(href)}" data-api="{esc(api)}"'

    return _API_LINK.sub(to_api, page)


def _links_note(links: Links, api: str) -> str:
    """What the page says its evidence links open."""
    if links.api_url is None:
        return ("Evidence links lead to the Evidence tables below; served by <code>tally "
                "serve</code>, to its API.")
    return (f'Evidence links open the live API (<code>tally serve</code>: <a href="'
            f'{esc(links.href(api))}" data-api="{esc(api)}">{esc(links.href(api))}</a>).')


def evidence_html(ev: dict[str, list[dict[str, Any]]] | None,
                  links: Links | None = None) -> str:
    """A finding's evidence: its steps, hosts and records, each a link (`Links`)."""
    if not ev:
        return ""
    link = (links or Links()).a
    parts = []
    if ev.get("steps"):
        items = []
        for s in ev["steps"]:
            span = f"{s['step']}" + (f"-{s['last_step']}" if "last_step" in s else "")
            extra = (f" ({s['repeats']:,} repeats)" if "repeats" in s else
                     f" ({s['examples']} examples)" if "examples" in s else "")
            items.append(link(s, span) + extra)
        parts.append('<div data-evidence="steps"><b>steps</b> ' + ", ".join(items) + "</div>")
    if ev.get("hosts"):
        items = []
        for h in ev["hosts"]:
            extra = (f" ({h['repeats']:,} repeats, in {h['repeated_records']:,} repeated "
                     "records)" if "repeats" in h else
                     f" ({h['examples']} examples)" if "examples" in h else "")
            items.append(link(h, f"{h['host']}") + extra)
        parts.append('<div data-evidence="hosts"><b>hosts</b> ' + ", ".join(items) + "</div>")
    if ev.get("records"):
        items = []
        for x in ev["records"]:
            if x.get("exposures") == 0:
                extra = " (never consumed)"
            elif "exposures" in x:
                seen = ", ".join(f"{s['step']}/h{s['host']}" for s in x.get("seen", [])[:4])
                extra = (f" ({x['exposures']}&times;, {x.get('epoch_repeats', 0)} within its "
                         f"epoch, on {x.get('hosts', '?')} hosts: step/host {seen}"
                         + (" &hellip;" if len(x.get("seen", [])) > 4 else "") + ")")
            else:
                extra = " (" + ", ".join(f"step {s['step']} host {s['host']}"
                                         for s in x.get("seen", [])[:3]) + ")"
            items.append(link(x, f"{x['record_key']}") + extra)
        parts.append('<div data-evidence="records"><b>records</b> ' + "; ".join(items)
                     + "</div>")
    return '<div class="evidence">' + "".join(parts) + "</div>"


def segment_files(report: dict[str, Any]) -> int:
    """The run's spool segment files a report rests on (a report written before it said so:
    the files it read, which were the spool's)."""
    c = report["consumption"]
    return c.get("segment_files", c["files"])


def _replayed_banner(r: dict[str, Any]) -> str:
    """A run whose spool `tally replay` wrote says so above everything else."""
    k = r.get("replayed_files", 0)
    if not k:
        return ""
    what = ("Replayed: this consumption was written by <code>tally replay</code> from the "
            "loader's contract, not recorded while the run trained. It shows what the loader "
            "feeds; a restore that misbehaved inside the run only shows in a live audit."
            if r.get("replayed") else
            f"{k:,} of {segment_files(r):,} spool files were written by "
            "<code>tally replay</code>, the rest recorded live.")
    return f'<p class="replayed" data-replayed="{str(bool(r.get("replayed"))).lower()}">' \
           f"<strong>{what}</strong></p>\n"


def _basis_line(integ: dict[str, Any]) -> str:
    """One line: what the content-hash figures rest on (the manifest's content basis)."""
    basis = integ.get("content_basis")
    if not basis:
        return ""
    return (f'<p data-fact="content basis">content hashes over '
            f'{esc(basis["description"])}.</p>')


def findings_html(found: list[dict[str, Any]], links: Links | None = None) -> str:
    if not found:
        return ('<ul class="findings"><li>No findings: every train record was seen as often '
                "as a perfect loader would.</li></ul>")
    items = "".join(
        f'<li class="finding" data-code="{esc(f["code"])}" data-severity="{esc(f["severity"])}">'
        f'<span class="badge {esc(f["severity"])}">{esc(f["severity"])}</span> '
        f'<code>{esc(f["code"])}</code> {esc(f["message"])}'
        f'{evidence_html(f.get("evidence"), links)}'
        "</li>" for f in found)
    return f'<ul class="findings">{items}</ul>'


def evidence_section(found: list[dict[str, Any]], r: dict[str, Any],
                     steps: pa.Table | None) -> str:
    """The Evidence tables: one row per step range, host and record the findings name (ids
    from evidence.anchor), with what the report knows of each, so that a link into them shows
    the numbers with no service at hand. Empty when no finding names anything."""
    named: dict[str, dict[str, Any]] = {}  # anchor -> the item (merged), its kind and codes
    for f in found:
        for kind, items in (f.get("evidence") or {}).items():
            for x in items:
                row = named.setdefault(evidence.anchor(x), {"kind": kind, "codes": []})
                row.update({k: v for k, v in x.items() if k not in row})
                if f["code"] not in row["codes"]:
                    row["codes"].append(f["code"])
    if not named:
        return ""
    have = steps is not None and steps.num_rows
    col = {c: steps[c].to_numpy() for c in ("step", "exposures", "repeats", "epoch_repeats")} \
        if have else {}
    per_host = {p["host"]: p for p in r["hosts"]["per_host"]}
    dash = None  # shown as a dash, as every empty cell

    texts: list[list[str]] = []  # the table being built, as its CSV has it

    def tr(anchor: str, cells: list[Any]) -> str:
        texts.append([html.unescape(re.sub(r"<[^>]+>", "", c)) if isinstance(c, Markup)
                      else cell_text(c) for c in cells])
        return (f'<tr id="{esc(anchor)}">'
                + "".join(f"<td>{c if isinstance(c, Markup) else _cell(c)}</td>" for c in cells)
                + "</tr>")

    def titled(name: str, title: str, head: list[str]) -> str:
        """The table's title with its CSV link, and its head row; takes the rows made."""
        out = (f'<h3>{title} <small>{csv_link(f"evidence-{name}", head, texts[:])}</small></h3>'
               f'<table data-evidence-table="{name}"><tr>'
               + "".join(f"<th>{esc(t)}</th>" for t in head) + "</tr>")
        texts.clear()
        return out

    def by(kind: str, key: Callable[[dict[str, Any]], Any]) -> list[tuple[str, dict[str, Any]]]:
        return sorted(((a, x) for a, x in named.items() if x["kind"] == kind),
                      key=lambda ax: key(ax[1]))

    def codes(x: dict[str, Any]) -> Markup:
        return Markup(", ".join(f"<code>{esc(c)}</code>" for c in x["codes"]))

    parts = []
    rows = []
    for a, x in by("steps", lambda x: (evidence.step_host(x) or -1, x["step"])):
        lo, hi = x["step"], x.get("last_step", x["step"])
        host = evidence.step_host(x)
        sums = [dash] * 3
        if host is None and have:
            i, j = np.searchsorted(col["step"], [lo, hi + 1])
            sums = [int(col[c][i:j].sum()) for c in ("exposures", "repeats", "epoch_repeats")]
        rows.append(tr(a, [Markup(esc(lo if lo == hi else f"{lo}-{hi}")),
                           "all" if host is None else host, *sums, codes(x)]))
    if rows:
        parts.append(titled("steps", "Steps", ["steps", "host", "exposures",
                                               "repeats of records seen before",
                                               "within-epoch repeats", "named by"])
                     + "".join(rows) + "</table><p><small>One host's steps: its series is "
                     "the live API's (<code>/v1/runs/{run}/hosts/{host}/steps</code>)."
                     "</small></p>")
    rows = []
    for a, x in by("hosts", lambda x: x["host"]):
        p = per_host.get(x["host"], {})
        rows.append(tr(a, [x["host"], p.get("exposures", 0), p.get("unique", 0),
                           p.get("epoch_repeats", 0), codes(x)]))
    if rows:
        parts.append(titled("hosts", "Hosts", ["host", "exposures", "unique records",
                                               "within-epoch repeats", "named by"])
                     + "".join(rows) + "</table>")
    rows = []
    for a, x in by("records", lambda x: x["record_key"]):
        seen = x.get("seen", [])
        where = ("never consumed" if x.get("exposures") == 0 else
                 ", ".join(f"step {s['step']} host {s['host']}" for s in seen[:8])
                 + (", ..." if len(seen) > 8 else ""))
        never = x.get("exposures") == 0
        rows.append(tr(a, [x["record_key"], x.get("exposures"),
                           0 if never else x.get("epoch_repeats"), 0 if never else x.get("hosts"),
                           where, codes(x)]))
    if rows:
        parts.append(titled("records", "Records", ["record key", "exposures",
                                                   "within-epoch repeats", "hosts", "seen at",
                                                   "named by"])
                     + "".join(rows) + "</table>")
    return ('<section id="evidence"><h2>Evidence</h2><p>The steps, hosts and records the '
            "findings name, each finding's links lead here.</p>" + "".join(parts)
            + "</section>")


class Markup(str):
    """Cell text that is HTML already (not escaped again)."""


# ---- the page ----------------------------------------------------------------------------

def render_html(r: dict, steps: pa.Table, api_url: str | None = None) -> str:
    """The page; `api_url`: the `tally serve` its evidence links open (`Links`)."""
    c = r["coverage"]
    first_bad = r["first_bad_step"]
    lo, hi = c["ideal"]["min"], c["ideal"]["max"]
    frac = c["histogram_fraction"]
    doms = r["domains"]
    per_host = r["hosts"]["per_host"]
    integ = r["integrity"]
    run = r.get("run") or {}
    state = ("finished" + (f" at step {run['finished_step']}" if run.get("finished_step")
                           is not None else "") if run.get("finished") else "running")
    api = f"/v1/runs/{quote(r['run_id'], safe='')}"
    links = Links(api_url)
    facts = [
        ("coverage", f"{100 * c['coverage']:.1f}%", f"ideal {100 * c['ideal']['coverage']:.1f}%"),
        ("never seen", f"{c['never_seen']:,}", f"{100 * frac['0']:.1f}%"),
        ("seen 2+", f"{c['histogram']['2'] + c['histogram']['3+']:,}",
         f"{100 * (frac['2'] + frac['3+']):.1f}%"),
        ("exposures", f"{c['exposures']:,}", f"ideal {lo}..{hi} per record"),
        ("excess / missing", f"{c['excess_exposures']:,} / {c['missing_exposures']:,}", ""),
        ("within-epoch repeats", f"{c['epoch_duplicates']:,}", ""),
    ]
    own = r["domain_ideal"]
    if own["weighted"]:  # a mixture that weights its domains is measured by their own ideals
        facts[-2:] = [
            ("excess / missing", f"{own['excess_exposures']:,} / {own['missing_exposures']:,}",
             f"against each domain's own passes (the split's: {c['excess_exposures']:,} / "
             f"{c['missing_exposures']:,})"),
            ("within-epoch repeats", f"{own['epoch_duplicates']:,}",
             f"beyond the weights' own ({c['epoch_duplicates']:,} in all)")]
    facts += [
        ("first bad step", step_or_none(first_bad), ""),
        ("run", state, f"last step {step_or_none(r['consumption']['last_step'])}"),
    ]
    facts_html = "".join(f'<div data-fact="{esc(k)}">{esc(k)}: <b>{esc(v)}</b> '
                         f'<small>{esc(note)}</small></div>' for k, v, note in facts)
    epochs = [{**e, "steps": f"{e['first_step']}-{e['last_step']}"}
              for e in r.get("epochs", [])]
    restarts = r["restarts"]
    rb = r["hosts"].get("repeated_batches", [])
    gaps = r["hosts"].get("gaps", []) + [
        {**g, "host": f"{g['hosts']:,} silent: "
                      + ", ".join(map(str, g["examples"]))
                      + (", ..." if g["hosts"] > len(g["examples"]) else "")}
        for g in r["hosts"].get("silent_hosts", [])]
    hosts_note = ("" if len(per_host) <= 64 else
                  f"<p>{len(per_host):,} hosts, sorted by within-epoch repeats.</p>")
    host_rows = sorted(per_host, key=lambda p: (-p.get("epoch_repeats", 0), p["host"])) \
        if len(per_host) > 64 else per_host
    # The hosts the findings' evidence names lead the table, in the evidence's order.
    named = list(dict.fromkeys(h["host"] for f in r["findings"]
                               for h in (f.get("evidence") or {}).get("hosts", [])))
    rank = {h: i for i, h in enumerate(named)}
    host_rows = sorted(host_rows, key=lambda p: rank.get(p["host"], len(rank)))
    host_rows = [{**p, "host": p["host"], "_evidence": p["host"] in rank} for p in host_rows]
    # A restart that rolled nothing back says no "rolled back from".
    restarts = [{**x, "rolled_back_from_step": None} if not x.get("rolled_back_steps")
                else x for x in restarts]
    drifted = [x for x in r.get("sources", []) if x.get("mismatched_records")]
    if integ["hash_mismatches"]:
        facts_html += (f'<div data-fact="content drift" class="FAIL">content drift: '
                       f'<b>{integ["hash_mismatches"]:,}</b> <small>consumed records differ '
                       "from the manifest" + (": source " + ", ".join(
                           f'{esc(x["source"])} ({x["mismatched_records"]:,})'
                           for x in drifted) if drifted else "") + "</small></div>")
    panels = [("steps", per_step_chart(steps, first_bad, restarts)),
              ("coverage", coverage_chart(steps, first_bad, restarts)),
              ("histogram", histogram_chart(c)),
              ("overlap", heatmap_chart(r['hosts']['overlap_matrix'], per_host)),
              ("loss", loss_chart(r.get('loss'), first_bad, restarts)),
              ("domains", domain_chart(doms)),
              ("drift", drift_chart(drifted))]
    # A panel with nothing to show is left out (the vocabulary gives each one's title).
    figures = "\n".join(f'<figure data-panel="{k}"><figcaption>{esc(CHARTS[k]["title"])}'
                        f"</figcaption>\n{svg}</figure>" for k, svg in panels if svg)
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>Tally report: {esc(r['run_id'])} {r['verdict']}</title><style>{CSS}</style></head><body>
<h1>Run {esc(r['run_id'])}: <span class="verdict {r['verdict']}" data-verdict="{r['verdict']}">
{r['verdict']}</span></h1>
{_replayed_banner(r)}<div class="facts">{facts_html}</div>
<p><small>Manifest {esc(r['manifest']['fingerprint'])}{' as of step ' + str(r['at_step'])
if r['at_step'] is not None else ''}. {_links_note(links, api)}</small></p>
<h2>Findings</h2>
{findings_html(r['findings'], links)}
<div class="grid">
{figures}
</div>
{evidence_section(r['findings'], r, steps)}
{table("Repeated batches", rb, [("host", "host"), ("first_step", "first step"),
                                ("last_step", "last step"), ("steps", "steps")],
       "repeated-batches", "<p>Steps at which a host handed over exactly the batch of the step "
       "before.</p>")}
{table("Host gaps", gaps, [("host", "host"), ("attempt", "attempt"),
                           ("first_step", "first step"), ("last_step", "last step"),
                           ("steps", "steps")], "gaps",
       "<p>Steps at which a host consumed nothing while the others did.</p>")}
{table("Epochs", epochs, [("epoch", "epoch"), ("steps", "steps"), ("records", "records seen"),
                          ("complete", "complete"), ("final", "last of a finished run"),
                          ("skipped", "records skipped")], "epochs")}
{table("Restarts", restarts, [("attempt", "attempt"), ("resumed_from_step", "resumed from"),
                              ("host_count", "hosts"), ("rolled_back_from_step",
                                                        "rolled back from"),
                              ("rolled_back_steps", "rolled-back steps"),
                              ("replayed_steps", "replayed"), ("exact", "exact")], "restarts")}
{table("Hosts", host_rows, [("host", "host"), ("exposures", "exposures"),
                            ("unique", "unique records"),
                            ("overlap_with_others", "shared with others"),
                            ("epoch_repeats", "within-epoch repeats"), ("tokens", "tokens")],
       "hosts", hosts_note)}
{table("Domains", [{**d, "passes": f"{d['passes']:.2f}", **{k: f"{100 * d[k]:.1f}%" for k in (
    "planned_share", "actual_share", "planned_token_share", "actual_token_share")}}
                   for d in doms], [("domain", "domain"), ("records", "records"),
                         ("planned_share", "planned"), ("actual_share", "actual"),
                         ("planned_token_share", "planned tokens"),
                         ("actual_token_share", "actual tokens"),
                         ("passes", "passes"), ("never_seen", "never seen"),
                         ("excess_exposures", "beyond its own ideal"),
                         ("missing_exposures", "below it")], "domains")}
<section id="integrity"><h2>Integrity</h2><p>unknown keys {integ['unknown_keys']:,};
content-hash mismatches {integ['hash_mismatches']:,} of {integ['hash_checked']:,} checked
({integ['hash_unverifiable']:,} partial segments not checkable); held-out records consumed
{integ['heldout_consumed_records']:,}.</p>{_basis_line(integ)}</section>
<p><small>Tally report v{r['report_version']}, generated {r['generated_at']}.</small></p>
{provenance_html(r.get('provenance'))}
</body></html>"""
