"""The reconcile report: report.json (versioned), Parquet tables, one self-contained HTML file
with plots (inline SVG, no network), and a short terminal summary."""

from __future__ import annotations

import datetime as dt
import html
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from audit import exposure
from audit.verdict import findings, verdict

REPORT_VERSION = 1


def _arr(merged: dict, *path: str) -> np.ndarray:
    x: Any = merged
    for p in path:
        x = x.get(p) if isinstance(x, dict) else None
        if x is None:
            return np.zeros(0, dtype=np.int64)
    return np.asarray(x)


def _pad(a: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.int64)
    out[: min(n, len(a))] = a[:n]
    return out


def build(plan, merged: dict) -> tuple[dict[str, Any], dict[str, pa.Table]]:
    """The report dict and its tables, from the plan and the job's merged aggregates."""
    n = plan.train_records
    counts = _arr(merged, "exposure_counts")
    hist = exposure.histogram(counts)
    seen_train = int(hist[1:].sum())
    total = int(merged.get("train_exposures", 0))
    lo, hi = exposure.ideal_bounds(total, n)
    excess, missing = exposure.excess(counts, total, n)

    last = merged.get("max_step")
    n_steps = 0 if last is None else last + 1
    seg = _pad(_arr(merged, "steps", "segments"), n_steps)
    exp_step = _pad(_arr(merged, "train_exposures_by_step"), n_steps)
    new = _pad(_arr(merged, "steps", "new_unique"), n_steps)
    cum_exp = np.cumsum(exp_step)
    cum_unique = np.cumsum(new)
    present = seg > 0
    steps = pa.table({
        "step": np.arange(n_steps)[present],
        "segments": seg[present],
        "tokens": _pad(_arr(merged, "steps", "tokens"), n_steps)[present],
        "rows": _pad(_arr(merged, "steps", "rows"), n_steps)[present],
        "exposures": exp_step[present],
        "new_unique": new[present],
        "repeats": (exp_step - new)[present],
        "cumulative_unique": cum_unique[present],
        "coverage": (cum_unique / n if n else cum_unique * 0.0)[present],
        "ideal_coverage": np.asarray(exposure.ideal_coverage(cum_exp, n))[present],
    })

    h = plan.hosts
    overlap = np.asarray(merged.get("overlap", np.zeros((h, h), np.int64)))
    overlap = np.pad(overlap, ((0, h - overlap.shape[0]), (0, h - overlap.shape[1])))
    per_host = [{"host": i,
                 "segments": int(_pad(_arr(merged, "hosts", "segments"), h)[i]),
                 "exposures": int(_pad(_arr(merged, "hosts", "exposures"), h)[i]),
                 "tokens": int(_pad(_arr(merged, "hosts", "tokens"), h)[i]),
                 "unique": int(_pad(_arr(merged, "hosts", "unique"), h)[i]),
                 "overlap_with_others": int(_pad(_arr(merged, "hosts", "overlap_with_others"),
                                                  h)[i])} for i in range(h)]

    dom = merged.get("domain", {})
    rec_total = sum(int(v[0]) for v in dom.values()) or 1
    tok_total = sum(int(v[1]) for v in dom.values()) or 1
    exp_total = sum(int(v[2]) for v in dom.values()) or 1
    ctok_total = sum(int(v[3]) for v in dom.values()) or 1
    domains = [{"domain": d, "records": int(v[0]), "tokens": int(v[1]),
                "exposures": int(v[2]), "tokens_consumed": int(v[3]),
                "never_seen": int(v[4]),
                "planned_share": v[0] / rec_total, "actual_share": v[2] / exp_total,
                "planned_token_share": v[1] / tok_total,
                "actual_token_share": v[3] / ctok_total}
               for d, v in sorted(dom.items())]
    sources = [{"source": s, "records": int(v[0]), "never_seen": int(v[1])}
               for s, v in sorted(merged.get("source", {}).items())]

    restarts = []
    prev_hosts = None
    for a in sorted(plan.attempts):
        info = plan.attempts[a]
        cut = plan.cutoffs.get(a)
        rp = _pad(_arr(merged, "replay", str(a)), 3)
        restarts.append({
            "attempt": a, "resumed_from_step": info["resumed_from_step"],
            "host_count": info["host_count"], "previous_host_count": prev_hosts,
            "rolled_back_from_step": cut, "rolled_back_steps": int(rp[0]),
            "replayed_steps": int(rp[1]), "identical_steps": int(rp[2]),
            "exact": None if cut is None or not rp[1] else bool(rp[1] == rp[2]),
            "first_differing_step": merged.get(f"min_differs_{a}")})
        prev_hosts = info["host_count"]

    # First step whose highest exposure rank exceeds ceil(C_s / N), C_s exposures so far.
    rank = _pad(_arr(merged, "max_rank_by_step"), n_steps)
    allowed = -(-cum_exp // n) if n else cum_exp
    bad = np.flatnonzero(rank > allowed)
    first_bad = int(bad[0]) if bad.size else None
    report: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "generated_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "run_id": plan.run_id,
        "at_step": plan.at_step,
        "manifest": {"path": plan.manifest, "fingerprint": plan.fingerprint,
                     "records": plan.records, "train_records": n},
        "run_manifest_fingerprint": plan.run_fingerprint,
        "consumption": {"segments": int(merged.get("segments", 0)),
                        "first_step": merged.get("min_step"), "last_step": last,
                        "files": len(plan.files), "skipped_files": merged["skipped_files"],
                        "rows_per_step": int(np.median(steps["rows"].to_numpy()))
                        if steps.num_rows else 0},
        "coverage": {
            "train_records": n, "exposures": total, "seen": seen_train,
            "coverage": seen_train / n if n else 0.0, "never_seen": int(hist[0]),
            "never_seen_fraction": hist[0] / n if n else 0.0,
            "histogram": dict(zip(exposure.HIST_BINS, map(int, hist), strict=True)),
            "histogram_fraction": dict(zip(exposure.HIST_BINS, (hist / n if n else hist * 0.0)
                                           .tolist(), strict=True)),
            "ideal": {"min": lo, "max": hi,
                      "never_seen": max(0, n - total) if n else 0},
            "excess_exposures": excess, "missing_exposures": missing,
            # Exposures beyond the first of a record within one epoch (epoch known).
            "epoch_duplicates": int(merged.get("epoch_duplicates", 0)),
            "epoch_duplicate_records": int(merged.get("epoch_duplicate_records", 0)),
        },
        "hosts": {"count": h, "per_host": per_host, "overlap_matrix": overlap.tolist()},
        "domains": domains,
        "sources": sources,
        "integrity": {k: int(merged.get(k, 0)) for k in (
            "unknown_keys", "unknown_segments", "hash_checked", "hash_mismatches",
            "hash_unverifiable", "heldout_consumed_records", "heldout_exposures")},
        "examples": merged.get("examples", {}),
        "restarts": [r for r in restarts if r["resumed_from_step"] is not None
                     or r["rolled_back_from_step"] is not None],
        "batch_changes": _batch_changes(steps, plan),
        "first_bad_step": first_bad,
        "exposures_before_first_bad": (int(cum_exp[first_bad - 1]) if first_bad else
                                       0 if first_bad == 0 else None),
    }
    report["findings"] = findings(report)
    report["verdict"] = verdict(report["findings"])
    tables = {
        "steps": steps,
        "hosts": pa.Table.from_pylist(per_host),
        "domains": pa.Table.from_pylist(domains) if domains else pa.table({}),
    }
    return report, tables


def _batch_changes(steps: pa.Table, plan) -> list[dict[str, int]]:
    """Resumes after which the global rows per step changed."""
    out = []
    if not steps.num_rows:
        return out
    s = steps["step"].to_numpy()
    rows = steps["rows"].to_numpy()
    last = s == s.max()  # a run still going may have a partial last step
    for info in plan.attempts.values():
        r = info["resumed_from_step"]
        if r is None:
            continue
        before = rows[(s < r) & ~last]
        after = rows[(s >= r) & ~last]
        if before.size and after.size:
            b, a = int(np.median(before)), int(np.median(after))
            if a != b:
                out.append({"step": r, "before": b, "after": a})
    return out


# ---- writing ------------------------------------------------------------------------------

def write(report: dict, tables: dict[str, pa.Table], out: Path) -> None:
    """report.json, report.html and the small tables (records/ is written by the job)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=_json))
    for name, t in tables.items():
        pq.write_table(t, out / f"{name}.parquet")
    (out / "report.html").write_text(render_html(report, tables["steps"]))


def _step(s: int | None) -> str:
    return "none" if s is None else str(s)


def _json(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    raise TypeError(type(o).__name__)


def summary(report: dict, out: Path | None = None) -> str:
    c = report["coverage"]
    f = c["histogram_fraction"]
    lines = [
        f"run {report['run_id']}: {report['verdict']}"
        + (f" (as of step {report['at_step']})" if report["at_step"] is not None else ""),
        f"  coverage {100 * c['coverage']:.1f}% of {c['train_records']:,} train records; "
        f"never seen {100 * f['0']:.1f}%, seen once {100 * f['1']:.1f}%, "
        f"seen 2+ {100 * (f['2'] + f['3+']):.1f}% ({c['exposures']:,} exposures; ideal "
        f"{c['ideal']['min']}..{c['ideal']['max']} each)",
        f"  excess exposures {c['excess_exposures']:,}, missing {c['missing_exposures']:,}; "
        f"first bad step {_step(report['first_bad_step'])}",
    ]
    lines += [f"  {x['severity']}: {x['message']}" for x in report["findings"]]
    if out is not None:
        lines.append(f"  report: {out / 'report.html'}  ({out / 'report.json'})")
    return "\n".join(lines)


# ---- HTML ---------------------------------------------------------------------------------

_CSS = """body{font:14px system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
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


def _bars(labels, series: dict[str, list[float]], w=520, h=240) -> str:
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
<title>Tally report: {html.escape(r['run_id'])}</title><style>{_CSS}</style></head><body>
<h1>Run {html.escape(r['run_id'])}: <span class="{r['verdict']}">{r['verdict']}</span></h1>
<p>Coverage <b>{100 * c['coverage']:.1f}%</b> of {c['train_records']:,} train records;
never seen {100 * c['histogram_fraction']['0']:.1f}%, seen 2+
{100 * (c['histogram_fraction']['2'] + c['histogram_fraction']['3+']):.1f}%;
{c['exposures']:,} exposures (ideal {lo}..{hi} per record); excess {c['excess_exposures']:,},
missing {c['missing_exposures']:,}; first bad step {_step(r['first_bad_step'])}.
Manifest {html.escape(r['manifest']['fingerprint'])}{' as of step ' + str(r['at_step'])
if r['at_step'] is not None else ''}.</p>
<ul>{finds}</ul>
<div class="grid">
<figure><figcaption>Cumulative coverage vs step (dashed: ideal)</figcaption>
{_line_chart(xs, cov, ideal)}</figure>
<figure><figcaption>Exposure histogram (records seen 0, 1, 2, 3+ times)</figcaption>
{_bars(list(exposure.HIST_BINS), {'actual': hist, 'ideal': ideal_hist})}</figure>
<figure><figcaption>Host overlap (records seen by both hosts)</figcaption>
{_heatmap(r['hosts']['overlap_matrix'])}</figure>
<figure><figcaption>Per domain: planned vs actual share of exposures</figcaption>
{_bars([d['domain'] for d in doms], {'planned': [d['planned_share'] for d in doms],
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
