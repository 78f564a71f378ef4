"""The diff's results: diff.json (versioned, documented in docs/DESIGN.md, "Diff"), Parquet
tables, one self-contained diff.html (tally.audit.posthoc.diff_html) and a short terminal summary.

A step is *identical* when both runs consumed the same multiset of records at it (record starts,
the project's exposures) and the same number of segments and tokens. The runs are:
- `identical`: every step either run consumed is identical;
- `same_data_other_order`: not identical, but every epoch (when both runs know every
  exposure's epoch), or else every window of steps, holds the same multiset of records;
- `different`: otherwise.
The verdict follows (PASS, WARN, FAIL) with findings that say where and how they differ.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tally.audit.buckets.left_out import files_left_out, left_out_findings
from tally.audit.buckets.partials import Partial
from tally.audit.core import exposure
from tally.audit.core.arrays import json_default
from tally.audit.core.exposure import Coverage, Findings, verdict
from tally.audit.core.words import plural
from tally.audit.hook.spool import replayed_run
from tally.audit.posthoc.diff_bucket import RUNS, DiffPartial
from tally.audit.posthoc.multiset import jaccard
from tally.audit.provenance import plan_fingerprint, provenance
from tally.pipeline.text import basis_differences

DIFF_VERSION = 1
STATUS = ("identical", "same_data_other_order", "different")
_GROUP_FIELDS = ("size_a", "size_b", "distinct_a", "distinct_b", "common", "l1")


def _padded(a: np.ndarray | None, n: int) -> np.ndarray:
    """A series padded with zeros, or cut, to length n."""
    out = np.zeros(n, np.int64)
    if a is not None:
        out[: min(n, len(a))] = np.asarray(a)[:n]
    return out


def _groups(arrays: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    return {k: _padded(arrays.get(k), n) for k in _GROUP_FIELDS}


def _first(mask: np.ndarray) -> int | None:
    i = np.flatnonzero(mask)
    return int(i[0]) if i.size else None


def build(plan: Any, m: DiffPartial) -> tuple[dict[str, Any], dict[str, pa.Table]]:
    """diff.json's content and the tables, from the plan (tally.audit.posthoc.diff.DiffPlan) and the
    job's merged partials."""
    layout = plan.layout
    n = layout.train_records
    # Per-step series run from the first step either run consumed (steps are int64).
    base, last = plan.first_step, plan.last_step
    n_steps = max(0, last - base + 1)
    read = {r: m.read.get(r, Partial()) for r in RUNS}
    seg = {r: _padded(read[r].step_segments.dense(base, last), n_steps) for r in RUNS}
    tok = {r: _padded(read[r].step_tokens.dense(base, last), n_steps) for r in RUNS}
    s = _groups(m.steps, n_steps)

    # ---- per step ----
    present = (seg["a"] > 0) | (seg["b"] > 0)
    same_records = s["l1"] == 0
    same_shape = (seg["a"] == seg["b"]) & (tok["a"] == tok["b"])
    identical = present & same_records & same_shape
    differ = present & ~identical
    jac = jaccard(s["distinct_a"], s["distinct_b"], s["common"])
    cov, ideal = {}, {}
    for r in RUNS:
        cum_exp = np.cumsum(_padded(m.train_exposures_by_step.get(r), n_steps))
        cum_new = np.cumsum(_padded(m.new_unique_by_step.get(r), n_steps))
        cov[r] = cum_new / n if n else cum_new * 0.0
        ideal[r] = np.asarray(exposure.ideal_coverage(cum_exp, n)) if n else cov[r] * 0.0
    step_ids = np.arange(n_steps)
    steps = pa.table({
        "step": (base + step_ids)[present],
        **{f"segments_{r}": seg[r][present] for r in RUNS},
        **{f"tokens_{r}": tok[r][present] for r in RUNS},
        **{f"exposures_{r}": s[f"size_{r}"][present] for r in RUNS},
        **{f"records_{r}": s[f"distinct_{r}"][present] for r in RUNS},
        "common_records": s["common"][present],
        "jaccard": jac[present],
        "multiset_difference": s["l1"][present],
        "identical": identical[present],
        **{f"coverage_{r}": cov[r][present] for r in RUNS},
        **{f"ideal_coverage_{r}": ideal[r][present] for r in RUNS},
    })

    # ---- per window of steps ----
    w = plan.window
    n_win = -(-n_steps // w)
    win = _groups(m.windows, n_win)
    win_of = step_ids // w
    win_present = np.bincount(win_of[present], minlength=n_win)
    win_identical = np.bincount(win_of[identical], minlength=n_win)
    win_same = (win["l1"] == 0) & (win_present > 0)
    windows = pa.table({
        "window": np.arange(n_win), "first_step": base + np.arange(n_win) * w,
        "last_step": base + np.minimum(np.arange(n_win) * w + w - 1, n_steps - 1),
        "steps_compared": win_present, "identical_steps": win_identical,
        **{f"exposures_{r}": win[f"size_{r}"] for r in RUNS},
        **{f"records_{r}": win[f"distinct_{r}"] for r in RUNS},
        "common_records": win["common"],
        "jaccard": jaccard(win["distinct_a"], win["distinct_b"], win["common"]),
        "multiset_difference": win["l1"], "same_multiset": win_same,
        "other_order": win_same & (win_identical < win_present),
    })

    # ---- per epoch (exposures whose epoch is known) ----
    n_ep = max([len(v) for v in m.epochs.values()] + [0])
    ep = _groups(m.epochs, n_ep)
    ep_jac = jaccard(ep["distinct_a"], ep["distinct_b"], ep["common"])
    epochs = [{"epoch": e, "exposures_a": int(ep["size_a"][e]),
               "exposures_b": int(ep["size_b"][e]), "records_a": int(ep["distinct_a"][e]),
               "records_b": int(ep["distinct_b"][e]), "common_records": int(ep["common"][e]),
               "jaccard": float(ep_jac[e]), "multiset_difference": int(ep["l1"][e]),
               "same_set": bool(ep["distinct_a"][e] == ep["distinct_b"][e] == ep["common"][e]),
               "same_multiset": bool(ep["l1"][e] == 0)}
              for e in range(n_ep) if ep["size_a"][e] or ep["size_b"][e]]

    # ---- per domain (train split), and over windows ----
    total = {r: sum(int(v[1 + i]) for v in m.domain.values()) or 1
             for i, r in enumerate(RUNS)}
    domains = [{"domain": d, "records": int(v[0]), "exposures_a": int(v[1]),
                "exposures_b": int(v[2]), "seen_a": int(v[3]), "seen_b": int(v[4]),
                "share_a": v[1] / total["a"], "share_b": v[2] / total["b"],
                "share_difference": v[1] / total["a"] - v[2] / total["b"]}
               for d, v in sorted(m.domain.items())]
    names = [d["domain"] for d in domains]
    mix = {r: np.stack([_padded(m.window_domain.get((r, d)), n_win) for d in names], axis=1)
           if names else np.zeros((n_win, 0), np.int64) for r in RUNS}
    share = {r: mix[r] / np.maximum(mix[r].sum(axis=1, keepdims=True), 1) for r in RUNS}
    window_mix = pa.table({
        "window": np.repeat(np.arange(n_win), len(names)),
        "domain": names * n_win,
        **{f"exposures_{r}": mix[r].ravel() for r in RUNS},
        **{f"share_{r}": share[r].ravel() for r in RUNS},
        "share_difference": (share["a"] - share["b"]).ravel(),
    })

    # ---- per run ----
    runs = {}
    for r in RUNS:
        p = plan.runs[r]
        train_exp = int(_padded(m.train_exposures_by_step.get(r), n_steps).sum())
        counts = _padded(m.exposure_counts.get(r), max(1, len(m.exposure_counts.get(r, []))))
        runs[r] = {
            **plan.sources[r].to_dict(), "run_manifest_fingerprint": p.run_fingerprint,
            # How the run's content hashes differ from the manifest's (reconcile's rule).
            "content_basis_differences": basis_differences(p.content_basis,
                                                           p.run_content_bases),
            # Written by `tally replay` from the loader's contract, not recorded live (as a
            # reconcile's report.json says it, from the spool's files or the ledger's attempts).
            "replayed": replayed_run(p.replayed_files, p.segment_files),
            "replayed_files": p.replayed_files, "segment_files": p.segment_files,
            "files": len(p.files),
            **files_left_out(p.left_out, read[r].skipped_files, read[r].skipped),
            "attempts": len(p.attempts), "hosts": p.hosts, "segments": read[r].segments,
            "exposures": int(m.exposures.get(r, 0)), "first_step": read[r].first_step,
            "last_step": read[r].last_step, "steps": int((seg[r] > 0).sum()),
            "heldout_exposures": int(m.heldout_exposures.get(r, 0)),
            "heldout_records": int(m.heldout_records.get(r, 0)),
            "unknown_keys": int(m.unknown_keys.get(r, 0)),
            "unknown_exposures": int(m.unknown_exposures.get(r, 0)),
            "unknown_epoch_exposures": int(m.unknown_epoch.get(r, 0)),
            "coverage": Coverage.from_levels(n, train_exp, counts).to_dict(),
        }

    epochs_known = all(runs[r]["unknown_epoch_exposures"] == 0 for r in RUNS) and bool(epochs)
    compared = int(present.sum())
    if not differ.any():
        status = "identical"
    elif (epochs_known and all(e["same_multiset"] for e in epochs)) or (
            not epochs_known and bool(win_same[win_present > 0].all())):
        status = "same_data_other_order"
    else:
        status = "different"
    div_at = _first(differ)
    first_div = None if div_at is None else base + div_at
    hist = sorted(m.difference_histogram.items())
    report: dict[str, Any] = {
        "diff_version": DIFF_VERSION,
        "generated_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "provenance": provenance(
            [{"role": "manifest", "kind": "manifest", "path": layout.manifest,
              "fingerprint": layout.fingerprint}]
            + [{"role": f"run {r.upper()}", "kind": plan.sources[r].kind,
                "path": plan.sources[r].path, "run_id": plan.sources[r].run_id,
                "fingerprint": plan_fingerprint(plan.runs[r].files)} for r in RUNS]),
        "a": runs["a"], "b": runs["b"],
        "manifest": {"path": layout.manifest, "fingerprint": layout.fingerprint,
                     "records": layout.records, "train_records": n},
        "at_step": layout.at_step,
        "status": status,
        "steps_compared": compared,
        "identical_steps": int(identical.sum()),
        "first_divergent_step": first_div,
        "steps_only_a": int(((seg["a"] > 0) & (seg["b"] == 0)).sum()),
        "steps_only_b": int(((seg["b"] > 0) & (seg["a"] == 0)).sum()),
        "steps_same_records_other_tokens": int((present & same_records & ~same_shape).sum()),
        "jaccard": {"mean": float(jac[present].mean()) if compared else None,
                    "min": float(jac[present].min()) if compared else None,
                    "at_first_divergent_step": None if first_div is None
                    else float(jac[div_at])},
        "records": {"compared": m.records, "only_a": m.only_a, "only_b": m.only_b,
                    "same": m.same, "more_often_a": m.more_a, "more_often_b": m.more_b,
                    "neither": m.records - m.only_a - m.only_b - m.same - m.more_a
                    - m.more_b},
        "records_only_a": m.only_a,
        "records_only_b": m.only_b,
        "exposure_difference_histogram": {str(k): int(v) for k, v in hist},
        "examples": {"only_a": m.only_a_examples, "only_b": m.only_b_examples},
        "epochs": epochs,
        "epochs_known": epochs_known,
        "windows": {"steps": w, "count": int((win_present > 0).sum()),
                    "same_multiset": int(win_same.sum()),
                    "other_order": int(windows["other_order"].to_numpy().sum())},
        "domains": domains,
    }
    report["findings"] = findings(report)
    report["verdict"] = verdict(report["findings"])
    tables = {"steps": steps, "windows": windows, "window_domains": window_mix,
              "epochs": pa.Table.from_pylist(epochs) if epochs else pa.table({}),
              "domains": pa.Table.from_pylist(domains) if domains else pa.table({})}
    return report, tables


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def findings(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The diff's findings, as diff.json stores them."""
    out = Findings()
    add = out.add
    for r in RUNS:
        run, fp = d[r], d[r]["run_manifest_fingerprint"]
        left_out_findings(run, add, whose=f"run {r.upper()} ({run['run_id']})",
                          missing_from="this diff", run=r)
        if fp and d["manifest"]["fingerprint"] and fp != d["manifest"]["fingerprint"]:
            add("FAIL", "manifest_mismatch",
                f"run {r.upper()} ({run['run_id']}) trained against manifest {fp}, this diff "
                f"compares against {d['manifest']['fingerprint']}: per-record numbers may be "
                "wrong", run=r)
        if run.get("content_basis_differences"):
            add("FAIL", "manifest_mismatch",
                f"run {r.upper()} ({run['run_id']}) hashes its records otherwise than the "
                f"manifest ({'; '.join(run['content_basis_differences'])}): steps with the "
                "same records may show other tokens", run=r,
                differences=run["content_basis_differences"])
        if run["unknown_keys"]:
            add("WARN", "unknown_keys",
                f"run {r.upper()} consumed {run['unknown_keys']:,} record keys that are not in "
                f"the manifest ({run['unknown_exposures']:,} exposures): compared per step, "
                "left out per record", run=r, keys=run["unknown_keys"])
    n, same = d["steps_compared"], d["identical_steps"]
    if not n:
        add("WARN", "nothing_compared", "neither run consumed a step to compare")
    elif d["status"] == "identical":
        add("INFO", "identical",
            f"both runs consumed the same records, segments and tokens at each of the {n:,} "
            "steps compared: the same data in the same order", steps=n)
    else:
        recs = d["records"]
        first = d["first_divergent_step"]
        detail = (f"{same:,} of {n:,} steps identical; Jaccard similarity of the steps' record "
                  f"sets {_pct(d['jaccard']['mean'])} on average; {recs['only_a']:,} records "
                  f"seen only by A, {recs['only_b']:,} only by B, {recs['more_often_a']:,} more "
                  f"often by A, {recs['more_often_b']:,} more often by B")
        if d["status"] == "same_data_other_order":
            where = "epoch" if d["epochs_known"] else f"window of {d['windows']['steps']} steps"
            add("WARN", "same_data_other_order",
                f"the runs consumed the same multiset of records in every {where}, in another "
                f"order from step {first}: {detail}", step=first, identical_steps=same)
        else:
            # A run's unreadable file reads as steps it did not consume: say so beside the
            # divergence rather than let the loader take the blame for a damaged file.
            unread = [f"{r.upper()} {d[r]['unreadable_files']:,}" for r in RUNS
                      if d[r].get("unreadable_files")]
            if unread:
                detail += (f"; unreadable spool files ({', '.join(unread)}, see "
                           "files_unreadable) hold rows missing here, so the divergence may "
                           "be those files, not the loader")
            add("FAIL", "diverged", f"the runs diverge at step {first}: {detail}",
                step=first, identical_steps=same, only_a=recs["only_a"], only_b=recs["only_b"])
        if d["steps_same_records_other_tokens"]:
            k = d["steps_same_records_other_tokens"]
            add("INFO", "other_segments",
                f"{k:,} steps consumed the same records in other segments or token counts "
                "(another packing, sequence length or truncation)", steps=k)
    if d["steps_only_a"] or d["steps_only_b"]:
        a, b = d["a"], d["b"]
        add("INFO", "unequal_length",
            f"A consumed steps {a['first_step']}..{a['last_step']} ({a['steps']:,}), B "
            f"{b['first_step']}..{b['last_step']} ({b['steps']:,}): {d['steps_only_a']:,} steps "
            f"only in A, {d['steps_only_b']:,} only in B (--at-step cuts both)",
            only_a=d["steps_only_a"], only_b=d["steps_only_b"])
    padded = [e for e in d["epochs"] if e["same_set"] and not e["same_multiset"]]
    if padded:
        extra = sum(abs(e["exposures_a"] - e["exposures_b"]) for e in padded)
        add("INFO", "same_set_per_epoch",
            f"in {plural(len(padded), 'epoch')} ({', '.join(str(e['epoch']) for e in padded[:5])}) "
            "both "
            f"runs consumed the same set of records ({padded[0]['records_a']:,} in epoch "
            f"{padded[0]['epoch']}) but not equally often ({extra:,} exposures apart): one "
            "repeats records within the epoch (sampler padding, a duplicate)",
            epochs=len(padded), exposures_apart=extra)
    return out.to_list()


# ---- writing ------------------------------------------------------------------------------

def write(report: dict, tables: dict[str, pa.Table], out: Path) -> None:
    """diff.json, diff.html and the tables (records/ is written by the job)."""
    from tally.audit.posthoc.diff_html import render_html

    out.mkdir(parents=True, exist_ok=True)
    (out / "diff.json").write_text(json.dumps(report, indent=2, default=json_default))
    for name, t in tables.items():
        pq.write_table(t, out / f"{name}.parquet")
    (out / "diff.html").write_text(render_html(report, tables))


def replayed_words(run: dict[str, Any]) -> str:
    """What a run's side of a diff rests on when `tally replay` wrote some or all of it."""
    if run.get("replayed"):
        return "replayed from the loader's contract, not recorded live"
    return f"{run['replayed_files']:,} of {run['segment_files']:,} spool files replayed"


def summary(d: dict, out: Path | None = None) -> str:
    """A few lines for the terminal."""
    a, b, recs = d["a"], d["b"], d["records"]
    head = {"identical": "IDENTICAL", "same_data_other_order": "SAME DATA, OTHER ORDER",
            "different": "DIFFERENT"}[d["status"]]
    first = d["first_divergent_step"]
    lines = [
        f"diff A {a['source']}:{a['run_id']} vs B {b['source']}:{b['run_id']}: {head} "
        f"({d['verdict']})" + (f" as of step {d['at_step']}" if d["at_step"] is not None else "")
        + "".join(f"; {r.upper()} {replayed_words(d[r])}" for r in RUNS
                  if d[r].get("replayed_files")),
        f"  steps: {d['identical_steps']:,} of {d['steps_compared']:,} identical; first "
        f"divergent step {'none' if first is None else first}; mean Jaccard "
        f"{_pct(d['jaccard']['mean'])}",
        f"  records: {recs['only_a']:,} only in A, {recs['only_b']:,} only in B, "
        f"{recs['more_often_a']:,} more often in A, {recs['more_often_b']:,} more often in B, "
        f"{recs['same']:,} alike ({recs['compared']:,} in the manifest)",
        "  " + "; ".join(f"{r.upper()}: {d[r]['exposures']:,} exposures, coverage "
                         f"{_pct(d[r]['coverage']['coverage'])}" for r in RUNS),
    ]
    lines += [f"  {x['severity']}: {x['message']}" for x in d["findings"]]
    if out is not None:
        lines.append(f"  diff: {out / 'diff.html'}  ({out / 'diff.json'})")
    return "\n".join(lines)
