"""The pages' rendering kit: report.html (tally.audit.reconcile.html) and diff.html
(tally.audit.posthoc.diff_html) draw with it. Inline SVG charts with axes, ticks, legends and
markers (`Chart`, `bars`), the pages' CSS, and tables' cells and CSV links; colours, names and
markers come from the vocabulary the dashboard shares (tally.audit.render.vocabulary).
"""

from __future__ import annotations

import csv
import html
import io
import math
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

import numpy as np

from tally.audit.render.vocabulary import CHARTS, MARKERS, PALETTE
from tally.audit.render.vocabulary import series as voc

MAX_POINTS = 600  # per polyline: keeps the file small for long runs


def step_or_none(s: int | None) -> str:
    """A step as a page writes it ('none' for no step)."""
    return "none" if s is None else str(s)


CSS = """body{font:14px system-ui,sans-serif;margin:2em;color:#1f2328;max-width:1200px}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em}.PASS{color:#1a7f37}.FAIL{color:#cf222e}
.WARN{color:#9a6700}.INFO,.UNKNOWN{color:#57606a}
.badge{display:inline-block;padding:0 6px;border-radius:4px;color:#fff;font-weight:600;
font-size:12px}.badge.FAIL{background:#cf222e}.badge.WARN{background:#bf8700}
.badge.PASS{background:#1a7f37}.badge.INFO,.badge.UNKNOWN{background:#6e7781}
table{border-collapse:collapse;margin:.5em 0}td,th{padding:2px 8px;border-bottom:1px solid #ddd;
text-align:right}th:first-child,td:first-child{text-align:left}.grid{display:flex;flex-wrap:wrap;
gap:24px}figure{margin:0}figcaption{font-weight:600;margin-bottom:4px;max-width:560px}
svg text{font-size:11px}svg{background:#fff}.findings li{margin:.4em 0}
.evidence{color:#57606a;font-size:13px;margin:.2em 0 0 1em}.evidence a{color:#0969da}
.facts{display:flex;flex-wrap:wrap;gap:6px 24px;margin:.5em 0}.facts b{font-size:1.1em}"""


def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    """About n round tick values (1, 2, 2.5 or 5 times a power of ten) from lo to hi."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        hi = above(lo)
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    if integer:
        step = max(1.0, round(step))
    first = math.ceil(lo / step - 1e-9) * step
    # Beyond 2**53 a float cannot hold every step: neighbouring ticks may round to one value.
    return sorted({round(first + i * step, 12)
                   for i in range(int((hi - first) / step + 1e-9) + 1)})


def above(v: float) -> float:
    """v + 1, or the next float above v where v + 1 is v itself (from 2**53: a run of one
    step at 2**55 made an axis of zero width, and its ticks a math domain error)."""
    return max(v + 1, math.nextafter(v, math.inf))


def decimals(ticks: Sequence[float]) -> int:
    """The fewest decimals that write every tick exactly (0.5 -> 1, 0.25 -> 2, 5 -> 0)."""
    return next((d for d in range(6) if all(abs(round(t, d) - t) < 1e-9 for t in ticks)), 6)


def round_up(hi: float, integer: bool = False) -> float:
    """The smallest round tick at or above hi (the top of an axis starting at 0)."""
    ticks = nice_ticks(0, max(hi, 1e-12), 4, integer)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1
    return ticks[-1] if ticks[-1] >= hi else ticks[-1] + step


def fmt_count(v: float) -> str:
    """A count as a tick or cell label: thousands as k, whole numbers without decimals."""
    if v >= 10_000:
        return f"{v / 1000:,.0f}k"
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.1f}"


def esc(x: Any) -> str:
    """`x` as HTML text."""
    return html.escape(str(x))


class Chart:
    """One SVG chart: a plot area with x and y scales, axes with titles, a legend above it."""

    def __init__(self, x0: float, x1: float, y0: float, y1: float, *, name: str,
                 w: int = 560, h: int = 270, left: int = 58, right: int = 14, top: int = 36,
                 bottom: int = 40) -> None:
        self.x0, self.x1 = x0, x1 if x1 > x0 else above(x0)
        self.y0, self.y1 = y0, y1 if y1 > y0 else above(y0)
        self.w, self.h, self.left, self.right, self.top, self.bottom = (w, h, left, right, top,
                                                                        bottom)
        self.name = name
        self.body: list[str] = []

    def px(self, x: float) -> float:
        return self.left + (x - self.x0) / (self.x1 - self.x0) * (self.w - self.left - self.right)

    def py(self, y: float) -> float:
        return self.h - self.bottom - (y - self.y0) / (self.y1 - self.y0) * (
            self.h - self.top - self.bottom)

    def axes(self, xtitle: str, ytitle: str, *, xticks: Sequence[float] | None = None,
             yticks: Sequence[float] | None = None, xfmt: Callable[[float], str] = fmt_count,
             yfmt: Callable[[float], str] = fmt_count, xlabels: Sequence[str] | None = None
             ) -> None:
        """Grid lines and tick labels on both axes, and each axis's title with its unit.
        `xlabels`: category names centred on their slots instead of x ticks."""
        b, lft, r = self.h - self.bottom, self.left, self.w - self.right
        out = [f'<g class="axes" data-x-title="{esc(xtitle)}" data-y-title="{esc(ytitle)}">']
        for v in yticks if yticks is not None else nice_ticks(self.y0, self.y1, 4):
            y = self.py(v)
            out.append(f'<line x1="{lft}" x2="{r}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eaeef2"/>'
                       f'<text x="{lft - 4}" y="{y + 4:.1f}" text-anchor="end" class="tick">'
                       f'{esc(yfmt(v))}</text>')
        if xlabels is not None:
            slot = (r - lft) / max(1, len(xlabels))
            for i, lab in enumerate(xlabels):
                out.append(f'<text x="{lft + (i + .5) * slot:.1f}" y="{b + 14}" '
                           f'text-anchor="middle" class="tick">{esc(lab)}</text>')
        else:
            for v in xticks if xticks is not None else nice_ticks(self.x0, self.x1, 6, True):
                x = self.px(v)
                out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{b}" y2="{b + 4}" '
                           f'stroke="#8c959f"/><text x="{x:.1f}" y="{b + 15}" '
                           f'text-anchor="middle" class="tick">{esc(xfmt(v))}</text>')
        out.append(f'<line x1="{lft}" x2="{r}" y1="{b}" y2="{b}" stroke="#8c959f"/>'
                   f'<line x1="{lft}" x2="{lft}" y1="{self.top}" y2="{b}" stroke="#8c959f"/>'
                   f'<text x="{(lft + r) / 2:.1f}" y="{self.h - 6}" text-anchor="middle" '
                   f'class="axis-title">{esc(xtitle)}</text>'
                   f'<text transform="translate(12 {(self.top + b) / 2:.1f}) rotate(-90)" '
                   f'text-anchor="middle" class="axis-title">{esc(ytitle)}</text></g>')
        self.body.insert(0, "".join(out))

    def legend(self, items: Sequence[tuple[str, str, str]]) -> None:
        """(name, colour, kind: line | dash | box) in a row above the plot; the text takes the
        series' colour."""
        x, out = self.left, ['<g class="legend">']
        for name, color, kind in items:
            if kind == "box":
                out.append(f'<rect x="{x}" y="8" width="12" height="10" fill="{color}"/>')
            else:
                dash = ' stroke-dasharray="4 3"' if kind == "dash" else ""
                out.append(f'<line x1="{x}" x2="{x + 14}" y1="13" y2="13" stroke="{color}" '
                           f'stroke-width="2"{dash}/>')
            out.append(f'<text x="{x + 18}" y="17" fill="{color}" style="fill:{color}" '
                       f'data-series="{esc(name)}">{esc(name)}</text>')
            x += 30 + 6.5 * len(name)
        self.body.append("".join(out) + "</g>")

    def marker(self, x: float | None, label: str, kind: str, row: int = 0) -> None:
        """A vertical line at x (a step), labelled, in its kind's colour (MARKERS); `row` 1
        puts the label under a first row's (restarts under the first bad step)."""
        if x is None or not self.x0 <= x <= self.x1:
            return
        c, xx = MARKERS[kind]["color"], self.px(x)
        anchor = "end" if xx > self.w * 0.7 else "start"
        dx = -4 if anchor == "end" else 4
        tw = 6.2 * len(label) + 6
        bx = xx + dx - (tw if anchor == "end" else 0) - (0 if anchor == "end" else 3)
        self.body.append(
            f'<g data-marker="{kind}" data-step="{x}"><line x1="{xx:.1f}" x2="{xx:.1f}" '
            f'y1="{self.top - 4}" y2="{self.h - self.bottom}" stroke="{c}" stroke-width="1.5" '
            f'stroke-dasharray="5 3"/><rect x="{bx:.1f}" y="{self.top - 2 + 16 * row}" '
            f'width="{tw:.1f}" height="14" fill="#fff" fill-opacity="0.85"/><text '
            f'x="{xx + dx:.1f}" y="{self.top + 8 + 16 * row}" text-anchor="{anchor}" '
            f'fill="{c}" style="fill:{c}">{esc(label)}</text></g>')

    def markers(self, first_bad: int | None, restarts: Sequence[dict[str, Any]]) -> None:
        """The first bad step, and each restart (a new attempt) where it resumed."""
        for r in restarts:
            if r.get("resumed_from_step") is not None:
                self.marker(r["resumed_from_step"],
                            MARKERS["restart"]["label"].format(attempt=r["attempt"]),
                            "restart", row=1)
        self.marker(first_bad, MARKERS["first-bad-step"]["label"].format(step=first_bad),
                    "first-bad-step")

    def legend_of(self, chart: str, keys: Sequence[str]) -> None:
        """The legend of `chart`'s series in `keys` (those with data), in the vocabulary's
        order, names and colours."""
        self.legend([(x["name"], x["color"], x["kind"]) for x in
                     (voc(chart, k) for k in _ordered(chart, keys))])

    def polyline(self, xs: np.ndarray, ys: np.ndarray, color: str, series: str,
                 dash: bool = False, width: float = 2) -> None:
        ok = np.isfinite(ys)
        xs, ys = np.asarray(xs)[ok], np.asarray(ys)[ok]
        if len(xs) > MAX_POINTS:
            idx = np.linspace(0, len(xs) - 1, MAX_POINTS).astype(int)
            xs, ys = xs[idx], ys[idx]
        pts = " ".join(f"{self.px(x):.1f},{self.py(y):.1f}" for x, y in zip(xs, ys, strict=True))
        d = ' stroke-dasharray="5 4"' if dash else ""
        self.body.append(f'<polyline fill="none" stroke="{color}" stroke-width="{width}"{d} '
                         f'points="{pts}" data-series="{esc(series)}" '
                         f'data-points="{len(xs)}"/>')

    def svg(self) -> str:
        return (f'<svg width="{self.w}" height="{self.h}" role="img" '
                f'data-chart="{self.name}">' + "".join(self.body) + "</svg>")


def _ordered(chart: str, keys: Sequence[str]) -> list[str]:
    return [x["key"] for x in CHARTS[chart]["series"] if x["key"] in set(keys)]


def bars(labels: Sequence[Any], series: dict[str, list[float]], w: int = 560, h: int = 270, *,
         counts: dict[str, list[int]] | None = None, colors: dict[str, str] | None = None,
         bar_colors: dict[str, list[str]] | None = None, xtitle: str = "",
         ytitle: str = "share (%)", name: str = "bars") -> str:
    """Grouped bars of shares (0..1), each labelled with its value (and its count, given
    `counts`); a bar above zero is at least 2 px tall, so a 0.3% bar shows. `bar_colors`
    colours single bars of a series (bars beyond the ideal in the repeat colour)."""
    default = [PALETTE["actual"], "#bf8700", PALETTE["shared"]]  # series without a meaning
    colors = {k: (colors or {}).get(k, default[i % 3]) for i, k in enumerate(series)}
    top = round_up(max([max(v) for v in series.values() if v] + [1e-9]))
    c = Chart(0, max(1, len(labels)), 0, top, name=name, w=w, h=h, top=46)
    c.axes(xtitle, ytitle, yticks=nice_ticks(0, top, 4), yfmt=lambda v: f"{100 * v:.4g}%",
           xlabels=[str(x) for x in labels])
    slot = (c.w - c.left - c.right) / max(1, len(labels))
    bw = slot * 0.8 / max(1, len(series))
    for si, (sname, vals) in enumerate(series.items()):
        out = []
        for i, v in enumerate(vals):
            color = (bar_colors or {}).get(sname, [None] * len(vals))[i] or colors[sname]
            x = c.left + i * slot + slot * 0.1 + si * bw
            bh = 0.0 if v <= 0 else max(2.0, c.py(0) - c.py(v))
            y = c.py(0) - bh
            n = None if counts is None or sname not in counts else counts[sname][i]
            label = f"{100 * v:.1f}%" if n is None else f"{n:,}"
            if si and v <= 0:  # the first series says its zeros; the others' go unsaid
                out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw - 2:.1f}" height="0" '
                           f'fill="{color}" data-series="{esc(sname)}" '
                           f'data-bin="{esc(labels[i])}" '
                           f'data-value="{0 if n is not None else v}"/>')
                continue
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw - 2:.1f}" height="{bh:.1f}" '
                       f'fill="{color}" data-series="{esc(sname)}" data-bin="{esc(labels[i])}" '
                       f'data-value="{n if n is not None else v}"><title>{esc(sname)} '
                       f'{esc(labels[i])}: {100 * v:.2f}%'
                       f'{"" if n is None else f" ({n:,} records)"}</title></rect>'
                       f'<text x="{x + (bw - 2) / 2:.1f}" '
                       f'y="{y - (15 if n is not None else 3):.1f}" text-anchor="middle" '
                       f'class="bar-label" fill="{color}" '
                       f'style="fill:{color}">{label}</text>')
            if n is not None:
                out.append(f'<text x="{x + (bw - 2) / 2:.1f}" y="{y - 3:.1f}" '
                           f'text-anchor="middle" class="bar-label" fill="{color}" '
                           f'style="fill:{color}">{100 * v:.1f}%</text>')
        c.body.append("".join(out))
    items = [(k, colors[k], "box") for k in series]
    if bar_colors:
        off = voc("histogram", "off")
        items.append((off["name"], off["color"], off["kind"]))
    c.legend(items)
    return c.svg()


def cell_text(v: Any) -> str:
    """A table cell as the reader sees it, in the page and in its CSV alike."""
    if v is None:
        return "\u2013"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def csv_link(name: str, head: list[str], cells: list[list[str]]) -> str:
    """A table's CSV as a download link. The CSV rides in the page (a data: link): it
    downloads from a report opened from disk, no script needed; served, the tables script
    adds sorting and a filter."""
    return (f'<a class="csv" data-csv="{name}" download="{name}.csv" '
            f'href="data:text/csv;charset=utf-8,{quote(to_csv(head, cells))}">CSV</a>')


def to_csv(head: list[str], rows: list[list[str]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(head)
    w.writerows(rows)
    return buf.getvalue()
