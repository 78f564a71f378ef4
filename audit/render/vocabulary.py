"""One vocabulary for the pages people read: report.html (tally.audit.reconcile.html renders from
it)
and the live dashboard (api/dashboard.html, served with it injected as JSON: `inject`). Chart
titles, legend names, their order and colours, markers and the heatmap's geometry live here
and nowhere else, so that the same fault reads the same on both pages."""

from __future__ import annotations

import json
from typing import Any

# One meaning per colour, on every chart.
PALETTE = {
    "actual": "#0969da",  # consumed as it should be: coverage, first exposures, due exposures
    "earlier": "#54aeff",  # seen again in a later epoch: due again
    "repeat": "#cf222e",  # beyond the ideal: within-epoch repeats, excess, first bad step
    "ideal": "#6e7781",  # what a perfect loader gives, or the plan
    "heldout": "#1a7f37",  # held-out loss
    "shared": "#8250df",  # records two hosts both saw
    "restart": "#9a6700",  # a restart (a new attempt) on the step axis
    "drift": "#bf8700",  # content drift: records whose bytes differ from the manifest's
}


def _s(key: str, name: str, colour: str, kind: str) -> dict[str, str]:
    return {"key": key, "name": name, "color": PALETTE[colour], "kind": kind}


# Panels in page order: key -> title (the figure's caption) and series (legend order). A page
# shows a legend entry only for a series with data, and leaves out a panel with none.
CHARTS: dict[str, dict[str, Any]] = {
    "steps": {"title": "Exposures per step: first exposures, records due again in a later "
                       "epoch, and records repeated within their epoch",
              "series": [_s("new", "first exposure", "actual", "box"),
                         _s("earlier", "due again in a later epoch", "earlier", "box"),
                         _s("within_epoch", "repeated within its epoch", "repeat", "box")]},
    "coverage": {"title": "Cumulative coverage vs step, against the ideal",
                 "series": [_s("coverage", "coverage", "actual", "line"),
                            _s("ideal", "ideal", "ideal", "dash"),
                            _s("behind", "behind the ideal", "repeat", "box")]},
    "histogram": {"title": "Exposure histogram: records by the times they were seen, against "
                           "the ideal",
                  "series": [_s("actual", "actual", "actual", "box"),
                             _s("ideal", "ideal", "ideal", "box"),
                             _s("off", "off the ideal", "repeat", "box")]},
    "overlap": {"title": "Host overlap: records each pair of hosts both saw", "series": []},
    "loss": {"title": "Training loss per window: due exposures vs repeated ones, and held-out "
                      "loss at the milestones",
             "series": [_s("due", "due exposures", "actual", "line"),
                        _s("repeated", "repeated exposures", "repeat", "line"),
                        _s("train", "training loss", "ideal", "line"),
                        _s("held-out", "held-out", "heldout", "line")]},
    "domains": {"title": "Per domain: planned vs actual share of exposures",
                "series": [_s("planned", "planned", "ideal", "box"),
                           _s("actual", "actual", "actual", "box")]},
    "drift": {"title": "Content drift: consumed records whose bytes differ from the manifest, "
                       "by corpus source",
              "series": [_s("mismatched", "records with other content", "drift", "box")]},
}

MARKERS = {
    "first-bad-step": {"label": "first bad step {step}", "color": PALETTE["repeat"]},
    "restart": {"label": "attempt {attempt}", "color": PALETTE["restart"]},
}

# The heatmap: numbers at HEATMAP_FONT_PX or not at all (a cell narrower than HEATMAP_CELL_PX
# keeps its number in its tooltip); the grid grows so that MAX_HEATMAP_HOSTS hosts fit.
MAX_HEATMAP_HOSTS = 16
HEATMAP_FONT_PX = 11
HEATMAP_CELL_PX = 30
HEATMAP_MIN_SIZE = 340


def heatmap_size(hosts: int) -> int:
    """The side of the heatmap's grid for `hosts` hosts shown."""
    return max(HEATMAP_MIN_SIZE, HEATMAP_CELL_PX * hosts)


def series(chart: str, key: str) -> dict[str, str]:
    return next(s for s in CHARTS[chart]["series"] if s["key"] == key)


def title(chart: str) -> str:
    return CHARTS[chart]["title"]


VOCABULARY = {"palette": PALETTE, "charts": CHARTS, "markers": MARKERS,
              "heatmap": {"max_hosts": MAX_HEATMAP_HOSTS, "font_px": HEATMAP_FONT_PX,
                          "cell_px": HEATMAP_CELL_PX, "min_size": HEATMAP_MIN_SIZE}}

PLACEHOLDER = "/*TALLY_VOCABULARY*/null"
TABLES_PLACEHOLDER = "/*TALLY_TABLES*/"

# Sorting (a click on a column's head), a filter box and a CSV download for every
# table[data-table], for the served pages (the dashboard, a served report.html). The report
# file has no script: its tables are static, and each carries its CSV as a data: link.
TABLES_SCRIPT = r"""
function tableCsv(t) {
  const q = (s) => /[",\n]/.test(s) ? '"' + s.replace(/"/g, '""') + '"' : s;
  return [...t.rows].filter((r) => !r.hidden).map((r) => [...r.cells].map(
    (c) => q(c.textContent.trim())).join(",")).join("\n") + "\n";
}
function tallyTables() {
  for (const t of document.querySelectorAll("table[data-table]")) {
    const head = t.tHead ? t.tHead.rows[0] : t.rows[0];
    const rows = () => [...t.rows].filter((r) => r.parentNode !== t.tHead && r !== head);
    if (!t.dataset.enhanced) {
      t.dataset.enhanced = "1";
      const bar = document.createElement("div");
      bar.className = "tablebar";
      const f = document.createElement("input");
      f.type = "search"; f.placeholder = "filter rows"; f.dataset.filter = t.dataset.table;
      f.addEventListener("input", () => { t.dataset.q = f.value; tallyTables(); });
      bar.appendChild(f);
      if (!document.querySelector(`a[data-csv="${t.dataset.table}"]`)) {
        const a = document.createElement("a");
        a.textContent = " CSV"; a.className = "csv"; a.dataset.csv = t.dataset.table;
        a.download = t.dataset.table + ".csv"; a.href = "#";
        a.addEventListener("click", () => {
          a.href = "data:text/csv;charset=utf-8," + encodeURIComponent(tableCsv(t)); });
        bar.appendChild(a);
      }
      t.parentNode.insertBefore(bar, t);
      [...head.cells].forEach((th, i) => {
        th.style.cursor = "pointer"; th.title = "sort by this column";
        th.addEventListener("click", () => {
          t.dataset.dir = t.dataset.col === String(i) && t.dataset.dir === "asc" ? "desc" : "asc";
          t.dataset.col = String(i); tallyTables(); });
      });
    }
    const q = (t.dataset.q || "").toLowerCase();
    for (const r of rows()) r.hidden = !!q && !r.textContent.toLowerCase().includes(q);
    if (t.dataset.col !== undefined) {
      const i = +t.dataset.col, dir = t.dataset.dir === "desc" ? -1 : 1;
      const key = (r) => { const s = r.cells[i] ? r.cells[i].textContent.trim() : "";
        return /^-?[\d,]*\.?\d+%?$/.test(s) ? parseFloat(s.replace(/[,%]/g, "")) : s; };
      const list = rows().sort((a, b) => { const x = key(a), y = key(b);
        if (typeof x !== typeof y) return (typeof x === "number" ? -1 : 1) * dir;
        return (x < y ? -1 : x > y ? 1 : 0) * dir; });
      for (const r of list) r.parentNode.appendChild(r);
      for (const th of head.cells) delete th.dataset.sort;
      if (head.cells[i]) head.cells[i].dataset.sort = t.dataset.dir;
    }
  }
}
"""


def inject(page: str) -> str:
    """The dashboard with the vocabulary and the tables script in place of their placeholders
    (`</` escaped so that no title can end the script element)."""
    return page.replace(PLACEHOLDER, json.dumps(VOCABULARY).replace("</", "<\\/"), 1).replace(
        TABLES_PLACEHOLDER, TABLES_SCRIPT, 1)


def with_tables_script(report_html: str) -> str:
    """A served report.html: its tables sort, filter and download (the file stays static)."""
    return report_html.replace("</body>", f"<script>{TABLES_SCRIPT}tallyTables();</script>"
                               "</body>", 1)
