"""report.html: one self-contained page with the verdict, the findings and plots (inline SVG,
no script, nothing fetched)."""

from __future__ import annotations

import html

import numpy as np
import pyarrow as pa

from audit.core import exposure


def step_or_none(s: int | None) -> str:
    return "none" if s is None else str(s)


CSS = """body{font:14px system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
h1{font-size:1.5em}.PASS{color:#1a7f37}.FAIL{color:#cf222e}.WARN{color:#9a6700}
table{border-collapse:collapse;margin:.5em 0}td,th{padding:2px 8px;border-bottom:1px solid #ddd;
text-align:right}th:first-child,td:first-child{text-align:left}.grid{display:flex;flex-wrap:wrap;
gap:24px}figure{margin:0}figcaption{font-weight:600;margin-bottom:4px}svg text{font-size:11px}"""


def _line_chart(xs, ys, ideal, w=520, h=240) -> str:
    if len(xs) == 0:
        return "<p>no steps yet</p>"
    if len(xs) > 600:  # keep the file small: plot an evenly thinned series
        idx = np.linspace(0, len(xs) - 1, 600).astype(int)
        xs, ys, ideal = xs[idx], ys[idx], ideal[idx]
    x0, x1 = float(xs.min()), float(max(xs.max(), xs.min() + 1))
    px = lambda x: 40 + (x - x0) / (x1 - x0) * (w - 50)  # noqa: E731
    py = lambda y: h - 25 - y * (h - 40)  # noqa: E731
    pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys, strict=True))
    ipts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ideal, strict=True))
    ticks = "".join(f'<text x="4" y="{py(v) + 4:.0f}">{int(v * 100)}%</text>'
                    f'<line x1="40" x2="{w - 10}" y1="{py(v):.1f}" y2="{py(v):.1f}" '
                    f'stroke="#eee"/>' for v in (0, .25, .5, .75, 1))
    return (f'<svg width="{w}" height="{h}" role="img" data-series="coverage">{ticks}'
            f'<polyline fill="none" stroke="#0969da" stroke-width="2" points="{pts}"/>'
            f'<polyline fill="none" stroke="#555" stroke-dasharray="4 3" points="{ipts}"/>'
            f'<text x="40" y="{h - 6}">step {int(x0)}</text>'
            f'<text x="{w - 90}" y="{h - 6}">step {int(x1)}</text>'
            f'<text x="{w - 200}" y="14" fill="#0969da">coverage</text>'
            f'<text x="{w - 120}" y="14" fill="#999">ideal</text></svg>')


def bars(labels, series: dict[str, list[float]], w=520, h=240) -> str:
    colors = ["#0969da", "#bf8700", "#8250df"]
    top = max([max(v) for v in series.values() if v] + [1e-9])
    group = (w - 50) / max(1, len(labels))
    bw = group * 0.8 / max(1, len(series))
    out = [f'<svg width="{w}" height="{h}" role="img" data-series="bars">']
    for si, (name, vals) in enumerate(series.items()):
        for i, v in enumerate(vals):
            bh = v / top * (h - 50)
            x = 40 + i * group + si * bw
            out.append(f'<rect x="{x:.1f}" y="{h - 25 - bh:.1f}" width="{bw:.1f}" '
                       f'height="{bh:.1f}" fill="{colors[si % 3]}"><title>{html.escape(name)} '
                       f'{labels[i]}: {100 * v:.1f}%</title></rect>'
                       f'<text x="{x + 2:.1f}" y="{h - 28 - bh:.1f}">{100 * v:.0f}%</text>')
        out.append(f'<text x="{40 + si * 110}" y="14" fill="{colors[si % 3]}">'
                   f'{html.escape(name)}</text>')
    for i, lab in enumerate(labels):
        out.append(f'<text x="{40 + i * group:.1f}" y="{h - 8}">{html.escape(str(lab))}</text>')
    return "".join(out) + "</svg>"


def _heatmap(m: list[list[int]], size=320) -> str:
    h = len(m)
    if not h:
        return ""
    arr = np.asarray(m, dtype=np.float64)
    diag = np.maximum(np.diag(arr), 1)
    norm = arr / np.sqrt(np.outer(diag, diag))  # share of records two hosts both saw
    cell = size / h
    out = [f'<svg width="{size + 40}" height="{size + 40}" role="img" data-series="overlap">']
    for i in range(h):
        for j in range(h):
            v = float(norm[i, j])
            shade = int(255 - 200 * min(1.0, v))
            out.append(f'<rect x="{30 + j * cell:.1f}" y="{10 + i * cell:.1f}" '
                       f'width="{cell:.1f}" height="{cell:.1f}" '
                       f'fill="rgb({shade},{shade},255)"><title>hosts {i} and {j}: '
                       f'{int(arr[i, j]):,} records</title></rect>')
    out.append(f'<text x="30" y="{size + 30}">host 0 .. {h - 1}; darker = more shared</text>')
    return "".join(out) + "</svg>"


def _loss_chart(section: dict | None, w: int = 520, h: int = 240) -> str:
    """Mean training loss per window: due exposures, repeated (excess) ones, and the held-out
    loss at the milestones."""
    if not section or not section.get("windows"):
        return "<p>no per-segment training loss in this run's spool</p>"
    series = {
        "due": ([x["first_step"] for x in section["windows"] if x["due"]["mean_loss"] is not None],
                [x["due"]["mean_loss"] for x in section["windows"]
                 if x["due"]["mean_loss"] is not None], "#0969da"),
        "repeated": ([x["first_step"] for x in section["windows"]
                      if x["excess"]["mean_loss"] is not None],
                     [x["excess"]["mean_loss"] for x in section["windows"]
                      if x["excess"]["mean_loss"] is not None], "#cf222e"),
        "held-out": ([m["step"] for m in section.get("milestones", [])],
                     [m["heldout_loss"] for m in section.get("milestones", [])], "#1a7f37"),
    }
    ys = [y for _, v, _ in series.values() for y in v if y is not None and np.isfinite(y)]
    xs = [x for k, _, _ in series.values() for x in k]
    if not ys:
        return "<p>no per-segment training loss in this run's spool</p>"
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(ys), max(max(ys), min(ys) + 1e-6)
    px = lambda x: 40 + (x - x0) / (x1 - x0) * (w - 50)  # noqa: E731
    py = lambda y: h - 25 - (y - y0) / (y1 - y0) * (h - 40)  # noqa: E731
    out = [f'<svg width="{w}" height="{h}" role="img" data-series="loss">']
    for i, (name, (sx, sy, color)) in enumerate(series.items()):
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(sx, sy, strict=True)
                       if y is not None and np.isfinite(y))
        if pts:
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                       f'points="{pts}" data-series="{name}"/>')
        out.append(f'<text x="{40 + i * 90}" y="14" fill="{color}">{name}</text>')
    out.append(f'<text x="4" y="{py(y1) + 4:.0f}">{y1:.2f}</text>'
               f'<text x="4" y="{py(y0) + 4:.0f}">{y0:.2f}</text>'
               f'<text x="40" y="{h - 6}">step {int(x0)}</text>'
               f'<text x="{w - 90}" y="{h - 6}">step {int(x1)}</text>')
    return "".join(out) + "</svg>"


def render_html(r: dict, steps: pa.Table) -> str:
    c = r["coverage"]
    n = c["train_records"] or 1
    xs = steps["step"].to_numpy() if steps.num_rows else np.zeros(0)
    cov = steps["coverage"].to_numpy() if steps.num_rows else np.zeros(0)
    ideal = steps["ideal_coverage"].to_numpy() if steps.num_rows else np.zeros(0)
    hist = [c["histogram"][b] / n for b in exposure.HIST_BINS]
    lo, hi = c["ideal"]["min"], c["ideal"]["max"]
    ideal_hist = [0.0] * 4
    if c["exposures"]:
        n_hi = c["exposures"] - lo * n  # records at the ceiling
        for level, count in ((lo, n - n_hi), (hi, n_hi)):
            ideal_hist[min(level, 3)] += count / n
    else:
        ideal_hist[0] = 1.0
    doms = r["domains"]
    rows = "".join(
        f"<tr><td>{html.escape(d['domain'])}</td><td>{d['records']:,}</td>"
        f"<td>{100 * d['planned_share']:.1f}%</td><td>{100 * d['actual_share']:.1f}%</td>"
        f"<td>{100 * d['planned_token_share']:.1f}%</td>"
        f"<td>{100 * d['actual_token_share']:.1f}%</td><td>{d['never_seen']:,}</td></tr>"
        for d in doms)
    hosts = "".join(
        f"<tr><td>{p['host']}</td><td>{p['exposures']:,}</td><td>{p['unique']:,}</td>"
        f"<td>{p['overlap_with_others']:,}</td><td>{p['tokens']:,}</td></tr>"
        for p in r["hosts"]["per_host"])
    finds = "".join(f"<li><b class='{f['severity']}'>{f['severity']}</b> "
                    f"{html.escape(f['message'])}</li>" for f in r["findings"]) \
        or "<li>No findings: every train record was seen as often as a perfect loader would.</li>"
    restarts = "".join(
        f"<tr><td>{x['attempt']}</td><td>{x['resumed_from_step']}</td><td>{x['host_count']}</td>"
        f"<td>{x['rolled_back_from_step']}</td><td>{x['rolled_back_steps']}</td>"
        f"<td>{x['replayed_steps']}</td><td>{x['exact']}</td></tr>" for x in r["restarts"])
    integ = r["integrity"]
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>Tally report: {html.escape(r['run_id'])}</title><style>{CSS}</style></head><body>
<h1>Run {html.escape(r['run_id'])}: <span class="{r['verdict']}">{r['verdict']}</span></h1>
<p>Coverage <b>{100 * c['coverage']:.1f}%</b> of {c['train_records']:,} train records;
never seen {100 * c['histogram_fraction']['0']:.1f}%, seen 2+
{100 * (c['histogram_fraction']['2'] + c['histogram_fraction']['3+']):.1f}%;
{c['exposures']:,} exposures (ideal {lo}..{hi} per record); excess {c['excess_exposures']:,},
missing {c['missing_exposures']:,}; first bad step {step_or_none(r['first_bad_step'])}.
Manifest {html.escape(r['manifest']['fingerprint'])}{' as of step ' + str(r['at_step'])
if r['at_step'] is not None else ''}.</p>
<ul>{finds}</ul>
<div class="grid">
<figure><figcaption>Cumulative coverage vs step (dashed: ideal)</figcaption>
{_line_chart(xs, cov, ideal)}</figure>
<figure><figcaption>Training loss per window: due exposures vs repeated ones (nats),
held-out loss at the milestones</figcaption>
{_loss_chart(r.get('loss'))}</figure>
<figure><figcaption>Exposure histogram (records seen 0, 1, 2, 3+ times)</figcaption>
{bars(list(exposure.HIST_BINS), {'actual': hist, 'ideal': ideal_hist})}</figure>
<figure><figcaption>Host overlap (records seen by both hosts)</figcaption>
{_heatmap(r['hosts']['overlap_matrix'])}</figure>
<figure><figcaption>Per domain: planned vs actual share of exposures</figcaption>
{bars([d['domain'] for d in doms], {'planned': [d['planned_share'] for d in doms],
                                     'actual': [d['actual_share'] for d in doms]})}</figure>
</div>
<h2>Domains</h2><table><tr><th>domain</th><th>records</th><th>planned</th><th>actual</th>
<th>planned tokens</th><th>actual tokens</th><th>never seen</th></tr>{rows}</table>
<h2>Hosts</h2><table><tr><th>host</th><th>exposures</th><th>unique</th>
<th>shared with others</th><th>tokens</th></tr>{hosts}</table>
<h2>Restarts</h2><table><tr><th>attempt</th><th>resumed from</th><th>hosts</th>
<th>rolled back from</th><th>rolled-back steps</th><th>replayed</th><th>exact</th></tr>
{restarts}</table>
<h2>Integrity</h2><p>unknown keys {integ['unknown_keys']:,}; content-hash mismatches
{integ['hash_mismatches']:,} of {integ['hash_checked']:,} checked
({integ['hash_unverifiable']:,} partial segments not checkable); held-out records consumed
{integ['heldout_consumed_records']:,}.</p>
<p><small>Tally report v{r['report_version']}, generated {r['generated_at']}.</small></p>
</body></html>"""
