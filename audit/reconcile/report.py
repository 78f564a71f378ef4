"""The reconcile report: report.json (versioned), Parquet tables, one self-contained HTML file
(tally.audit.reconcile.html), and a short terminal summary."""

from __future__ import annotations

import datetime as dt
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tally.audit.buckets import host_steps
from tally.audit.buckets.left_out import files_left_out
from tally.audit.buckets.partials import Partial, Spans, padded_sum
from tally.audit.buckets.plan import Plan
from tally.audit.core import exposure
from tally.audit.core.arrays import json_default
from tally.audit.core.errors import CorpusError
from tally.audit.core.exposure import Coverage, verdict
from tally.audit.hook.spool import replayed_run
from tally.audit.provenance import plan_fingerprint, provenance
from tally.audit.reconcile import loss
from tally.audit.reconcile.html import render_html, segment_files
from tally.audit.reconcile.verdict import findings
from tally.audit.render.charts import step_or_none
from tally.pipeline.text import ContentBasis, basis_differences

REPORT_VERSION = 1


def _series(a: np.ndarray, n: int) -> np.ndarray:
    """A per-step (or per-host) series padded with zeros, or cut, to length n."""
    out = np.zeros(n, dtype=np.int64)
    out[: min(n, len(a))] = a[:n]
    return out


def build(plan: Plan, merged: Partial, source: tuple[str, str | Path] | None = None
          ) -> tuple[dict[str, Any], dict[str, pa.Table]]:
    """The report dict and its tables, from the plan and the job's merged partials. `source`:
    (kind, path) of the consumption read, "spool" or "ledger", for the provenance block."""
    n = plan.train_records
    total = merged.train_exposures
    counts = merged.exposure_counts
    coverage = Coverage.from_levels(n, total, counts).to_dict()

    # Per-step series run from the run's first step to its last (steps are int64 and need not
    # start at 0; plan.MAX_RUN_STEPS bounds the span).
    last = merged.last_step
    base = plan.first_step if merged.first_step is None else merged.first_step
    n_steps = 0 if last is None else last - base + 1

    def series(s: Spans) -> np.ndarray:
        return s.dense(base, last) if n_steps else np.zeros(0, np.int64)

    seg = series(merged.step_segments)
    exp_step = series(merged.train_exposures_by_step)
    new = series(merged.new_unique_by_step)
    cum_exp = np.cumsum(exp_step)
    cum_unique = np.cumsum(new)
    present = seg > 0
    steps = pa.table({
        "step": (base + np.arange(n_steps, dtype=np.int64))[present],
        "segments": seg[present],
        "tokens": series(merged.step_tokens)[present],
        "rows": series(merged.step_rows)[present],
        "exposures": exp_step[present],
        "new_unique": new[present],
        "repeats": (exp_step - new)[present],
        "epoch_repeats": series(merged.epoch_repeats_by_step)[present],
        "cumulative_unique": cum_unique[present],
        "coverage": (cum_unique / n if n else cum_unique * 0.0)[present],
        "ideal_coverage": np.asarray(exposure.ideal_coverage(cum_exp, n))[present],
    })
    changes = _batch_changes(steps, plan)

    # The hosts that sent rows, by position (Plan.host_ids): the matrix's rows and columns
    # are per_host's, sized by the hosts that exist, whatever their numbers.
    h = len(plan.host_ids)
    overlap = merged.overlap
    overlap = np.pad(overlap, ((0, h - overlap.shape[0]), (0, h - overlap.shape[1])))
    per_host_series = {name: _series(getattr(merged, f"host_{name}"), h) for name in (
        "segments", "exposures", "tokens", "unique", "overlap_with_others")}
    per_host_series["epoch_repeats"] = _series(merged.epoch_repeats_by_host, h)
    per_host_series["epoch_duplicated_records"] = _series(merged.epoch_duplicated_by_host, h)
    per_host = [{"host": host, **{name: int(v[i]) for name, v in per_host_series.items()}}
                for i, host in enumerate(plan.host_ids.tolist())]

    dom = merged.domain
    # Each domain against its own ideal: where the run weights its domains, that is the ideal
    # it is measured against (tally.audit.core.exposure.weighted_domains).
    own = exposure.domain_distance(merged.domain_levels)
    sizes = {d: int(v[0]) for d, v in dom.items()}
    # Epochs by the thousand in a bucket leave each domain's epochs untold: their repeats
    # then count in full, and no epoch is said even.
    by_epoch = {} if merged.domain_epochs_untold else merged.domain_epoch_levels
    domain_ideal = {"excess_exposures": sum(a for a, _ in own.values()),
                    "missing_exposures": sum(b for _, b in own.values()),
                    "epoch_duplicates": merged.epoch_duplicates if merged.domain_epochs_untold
                    else exposure.domain_epoch_duplicates(sizes, by_epoch)}
    weighted = exposure.weighted_domains(
        (coverage["excess_exposures"], coverage["missing_exposures"], merged.epoch_duplicates),
        (domain_ideal["excess_exposures"], domain_ideal["missing_exposures"],
         domain_ideal["epoch_duplicates"]), merged.domain_levels)
    # Every exposure in a known epoch, and each epoch even within each domain: a distance over
    # the whole run is partial passes restarted epoch by epoch, the loader's design.
    in_epochs = sum(int(h.sum(axis=0) @ np.arange(h.shape[1])) for h in by_epoch.values())
    domain_ideal["epochs_even"] = bool(in_epochs and in_epochs == total) and \
        exposure.domain_epoch_distance(sizes, by_epoch) == (0, 0)
    repeats = None if merged.domain_epochs_untold else exposure.domain_epoch_repeats(by_epoch)
    rec_total = sum(int(v[0]) for v in dom.values()) or 1
    tok_total = sum(int(v[1]) for v in dom.values()) or 1
    exp_total = sum(int(v[2]) for v in dom.values()) or 1
    ctok_total = sum(int(v[3]) for v in dom.values()) or 1
    domains = [{"domain": d, "records": int(v[0]), "tokens": int(v[1]),
                "exposures": int(v[2]), "tokens_consumed": int(v[3]),
                "never_seen": int(v[4]),
                "planned_share": v[0] / rec_total, "actual_share": v[2] / exp_total,
                "planned_token_share": v[1] / tok_total,
                "actual_token_share": v[3] / ctok_total,
                "passes": v[2] / v[0] if v[0] else 0.0,
                "excess_exposures": own.get(d, (0, 0))[0],
                "missing_exposures": own.get(d, (0, 0))[1],
                "epoch_duplicates": None if repeats is None else repeats.get(d, 0)}
               for d, v in sorted(dom.items())]
    sources = [{"source": s, "records": int(v[0]), "never_seen": int(v[1]),
                "mismatched_records": int(v[2]) if len(v) > 2 else 0}
               for s, v in sorted(merged.source.items())]

    restarts = []
    prev_hosts = None
    for a in sorted(plan.attempts):
        info = plan.attempts[a]
        cut = plan.cutoffs.get(a)
        rolled, replayed, identical = map(int, _series(merged.replay.get(a, np.zeros(0)), 3))
        restarts.append({
            "attempt": a, "resumed_from_step": info["resumed_from_step"],
            "host_count": info["host_count"], "previous_host_count": prev_hosts,
            "rolled_back_from_step": cut, "rolled_back_steps": rolled,
            "replayed_steps": replayed, "identical_steps": identical,
            "exact": None if cut is None or not replayed else replayed == identical,
            "first_differing_step": merged.first_differing_step.get(a)})
        prev_hosts = info["host_count"]

    # Taken against the split's ideal: a run that weights its domains has none (ranks by step
    # are not kept per domain).
    bad_at = None if weighted else exposure.first_bad_step(
        series(merged.max_rank_by_step), exp_step, n)
    first_bad = None if bad_at is None else base + bad_at
    report: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "generated_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "provenance": provenance(
            [{"role": "manifest", "kind": "manifest", "path": plan.manifest,
              "fingerprint": plan.fingerprint}]
            + ([{"role": "consumption", "kind": source[0], "path": source[1],
                 "fingerprint": plan_fingerprint(plan.files, plan.files_print)}]
               if source else [])),
        "run_id": plan.run_id,
        "at_step": plan.at_step,
        # Written by `tally replay` from the loader's contract: what the loader would have fed,
        # not what the run consumed (docs/guides/attach.md, "What replay cannot prove").
        "replayed": replayed_run(plan.replayed_files, plan.segment_files),
        "replayed_files": plan.replayed_files,
        "manifest": {"path": plan.manifest, "fingerprint": plan.fingerprint,
                     "records": plan.records, "train_records": n},
        "run_manifest_fingerprint": plan.run_fingerprint,
        "consumption": {"segments": merged.segments,
                        "first_step": merged.first_step, "last_step": last,
                        "files": len(plan.files), "segment_files": plan.segment_files,
                        **files_left_out(plan.left_out, merged.skipped_files,
                                        merged.skipped),
                        "rows_per_step": int(np.median(steps["rows"].to_numpy()))
                        if steps.num_rows else 0},
        "coverage": {
            **coverage,
            # Exposures beyond the first of a record within one epoch (epoch known).
            "epoch_duplicates": merged.epoch_duplicates,
            "epoch_duplicate_records": merged.epoch_duplicate_records,
        },
        "hosts": {"count": plan.hosts, "per_host": per_host, "overlap_matrix": overlap.tolist(),
                  "repeated_batches": host_steps.repeated_batches(
                      merged.repeated_step_ranges, merged.host_step_edges, n),
                  **dict(zip(("gaps", "silent_hosts"), host_steps.gaps(
                      merged.host_step_ranges,
                      {a: v["host_count"] for a, v in plan.attempts.items()}, _ended(plan)),
                      strict=True))},
        "run": {"finished": plan.finished, "finished_step": plan.finished_step},
        "epochs": _epochs(merged, plan, n, last, _data_ended(steps, changes, plan),
                          weighted and not merged.domain_epochs_untold),
        "domains": domains,
        # The distance from each domain's own ideal, summed, and the within-epoch duplicates
        # beyond what each domain's share of an epoch forces; `weighted`: the run is measured
        # by those (its domains are read in different passes on purpose); `epochs_even`: each
        # epoch read each domain evenly.
        "domain_ideal": {"weighted": weighted, **domain_ideal},
        "sources": sources,
        "integrity": {**{k: int(getattr(merged, k)) for k in (
            "unknown_keys", "unknown_segments", "hash_checked", "hash_mismatches",
            "hash_unverifiable", "hash_overlong", "heldout_consumed_records",
            "heldout_exposures")},
            # What the content-hash figures rest on: the manifest's basis.
            "content_basis": _basis(plan.content_basis)},
        # The run's basis as its spool said it ([]: it did not say) and how it differs.
        "content_basis": {"run": [_basis(b) for b in plan.run_content_bases],
                          "differences": basis_differences(plan.content_basis,
                                                           plan.run_content_bases)},
        "examples": {"unknown": merged.unknown_examples,
                     "hash_mismatch": merged.hash_mismatch_examples,
                     "heldout": merged.heldout_examples,
                     # Evidence: train records repeated within an epoch or seen beyond the
                     # ideal, most first, with where they were seen; records never seen.
                     "most_repeated": [x for x in merged.most_repeated if x["epoch_repeats"]
                                       or not weighted
                                       and x["exposures"] > coverage["ideal"]["max"]],
                     "never_seen": merged.never_seen_examples},
        "restarts": [r for r in restarts if r["resumed_from_step"] is not None
                     or r["rolled_back_from_step"] is not None],
        "batch_changes": changes,
        "metrics": {"non_finite_losses": plan.non_finite_losses},
        "loss": _loss(merged, plan, exp_step, n, first_bad),
        "first_bad_step": first_bad,
        "exposures_before_first_bad": (int(cum_exp[bad_at - 1]) if bad_at else
                                       0 if bad_at == 0 else None),
    }
    report["findings"] = findings(report, steps)
    report["verdict"] = verdict(report["findings"])
    tables = {
        "steps": steps,
        "hosts": pa.Table.from_pylist(per_host),
        "domains": pa.Table.from_pylist(domains) if domains else pa.table({}),
    }
    return report, tables


def _basis(raw: str) -> dict[str, Any]:
    """A content basis (JSON, tally.pipeline.text.ContentBasis) as the report says it."""
    try:
        b = ContentBasis.from_json(raw)
    except CorpusError as exc:
        return {"kind": None, "description": str(exc)}
    return {"kind": b.kind, "description": b.describe(),
            **{k: v for k, v in json.loads(b.to_json()).items() if k != "kind"}}


def _loss(merged: Partial, plan: Plan, exposures_by_step: np.ndarray, n: int,
          first_bad: int | None) -> dict[str, Any]:
    """Training loss of due vs excess exposures per window, the held-out milestones, and the
    test of whether repeats flattered the loss (tally.audit.reconcile.loss)."""
    windows = loss.split(merged.loss_by_rank, plan.loss_window, exposures_by_step, n,
                         plan.first_step)
    return {"window_steps": plan.loss_window, "windows": loss.public(windows),
            "milestones": plan.milestones, "test": loss.test(windows, first_bad),
            "gap": loss.gap(plan.milestones, first_bad)}


def _ended(plan: Plan) -> dict[int, bool]:
    """Attempts that are over: replaced by a later one, or the last of a finished run."""
    last = max(plan.attempts, default=0)
    return {a: a < last or plan.finished for a in plan.attempts}


def _epochs(merged: Partial, plan: Plan, n: int, last: int | None,
            data_ended: bool = False, weighted: bool = False) -> list[dict[str, Any]]:
    """Per known epoch: its steps, the distinct train records seen in it, and, once the run has
    left it behind, the records it skipped. An epoch is complete when a later one has started
    and no host consumed it at the last step, or when it is the last of a finished run whose
    loader ran out of data in it (`data_ended`); the last epoch of a finished run is reported as
    `final` (the run may have ended inside it by design). A run that weights its domains
    (`weighted`) passes epochs domain by domain (each loader of a mixture counts its own): an
    epoch skips only the records of domains that went on past it, or, the final one, of
    domains that ended in it."""
    out = []
    seen = merged.records_by_epoch
    known = sorted(merged.epoch_steps)
    # Per domain: its train records, records seen by epoch, and the last epoch it reached.
    seen_by = {d: h[:, 1:].sum(axis=1) for d, h in merged.domain_epoch_levels.items()}
    # Records by times seen in each epoch, all domains (None: untold, too many epochs).
    times = None if merged.domain_epochs_untold else functools.reduce(
        padded_sum, merged.domain_epoch_levels.values(), np.zeros((0, 0), np.int64))
    domains = [(int(merged.domain[d][0]), v, int(np.flatnonzero(v)[-1]))
               for d, v in seen_by.items() if v.any()]

    def skipped(e: int, records: int) -> int:
        if not weighted:
            return n - records
        return sum(size - int(v[e] if e < len(v) else 0) for size, v, reached in domains
                   if reached > e or reached == e == known[-1])

    for e in known:
        first, end = merged.epoch_steps[e]
        later = any(x > e for x in known)
        records = int(seen[e]) if e < len(seen) else 0
        # An epoch that saw every train record is complete, whatever comes after it (one at
        # 100% coverage read "complete: no").
        complete = (later and last is not None and end < last) or (n > 0 and records >= n) or (
            data_ended and plan.finished and not later)
        out.append({"epoch": e, "first_step": first, "last_step": end, "records": records,
                    "complete": bool(complete), "final": plan.finished and not later,
                    "skipped": skipped(e, records) if complete or (plan.finished and not later)
                    else None,
                    # records seen 1, 2, ... times in the epoch
                    "times_seen": None if times is None else np.trim_zeros(
                        times[e, 1:] if e < len(times) else np.zeros(0, np.int64), "b").tolist()})
    return out


def _data_ended(steps: pa.Table, changes: list[dict[str, int]], plan: Plan) -> bool:
    """Whether a finished run ended because its loader ran out of data: its last steps are
    shorter than the batch every earlier step of its last stretch (since its last batch
    change) held, which a run stopped by its step budget never is (its last step is as full as
    the others). A loader that gives an epoch's remainder as a short batch has reached the
    epoch's end; one that drops it ends on a full step, and its epoch stays `final`, not
    `complete`. Batches whose rows vary from step to step (a token budget) say nothing: no."""
    if not plan.finished or not steps.num_rows:
        return False
    s, rows = steps["step"].to_numpy(), steps["rows"].to_numpy()
    since = max((c["step"] for c in changes), default=None)
    band = rows if since is None else rows[s >= since]
    full = band.max()
    last_full = np.flatnonzero(band == full)[-1]  # the short steps after it end the run
    return bool(last_full < len(band) - 1 and (band[:last_full + 1] == full).all())


# A resume's new global batch must hold for this many full steps after it to be a change: a
# loader that runs out of data right after a resume (a Hugging Face IterableDataset restored
# without its shuffle buffer: 2 short steps, then the end) shows short steps, not a new batch.
CHANGE_STEPS = 2


def _batch_changes(steps: pa.Table, plan: Plan) -> list[dict[str, int]]:
    """Resumes after which the global rows per step changed: the median of at least
    CHANGE_STEPS steps after the resume (the last step aside) differs from that before it."""
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
        if before.size and after.size >= CHANGE_STEPS:
            b, a = int(np.median(before)), int(np.median(after))
            if a != b:
                out.append({"step": r, "before": b, "after": a})
    return out


# ---- writing ------------------------------------------------------------------------------

def write(report: dict, tables: dict[str, pa.Table], out: Path,
          api_url: str | None = None) -> None:
    """report.json, report.html (its evidence links opening `api_url`'s API, or its own
    tables) and the small tables (records/ is written by the job)."""
    out.mkdir(parents=True, exist_ok=True)
    # By rename: a live service reads the report of a live reconcile while the next is written.
    tmp = out / ".report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=json_default))
    tmp.replace(out / "report.json")
    for name, t in tables.items():
        pq.write_table(t, out / f"{name}.parquet")
    (out / "report.html").write_text(render_html(report, tables["steps"], api_url))


def _replayed_note(report: dict) -> str:
    """What the consumption rests on when `tally replay` wrote some or all of it."""
    k = report.get("replayed_files", 0)
    if not k:
        return ""
    if report.get("replayed"):
        return " — replayed from the loader's contract, not recorded live"
    return f" — {k:,} of {segment_files(report):,} spool files replayed"


def _first_bad(report: dict) -> str:
    """The first bad step, or, for a FAIL no step of exposures explains ("FAIL" beside "first
    bad step none" read as a contradiction), which findings the FAIL comes from."""
    step = report["first_bad_step"]
    if step is not None:
        return f"first bad step {step}"
    fails = [x["code"] for x in report["findings"] if x["severity"] == "FAIL"]
    if report["verdict"] != "FAIL" or not fails:
        return f"first bad step {step_or_none(step)}"
    return ("no step is bad by exposure counts; the FAIL comes from "
            + ", ".join(dict.fromkeys(fails)))


def _distance_line(report: dict) -> str:
    """Excess and missing exposures against the ideal the run is measured by."""
    c, d = report["coverage"], report["domain_ideal"]
    line = f"  excess exposures {c['excess_exposures']:,}, missing {c['missing_exposures']:,}"
    if d["weighted"]:
        line = (f"  against each domain's own ideal (a mixture that weights its domains): excess "
                f"exposures {d['excess_exposures']:,}, missing {d['missing_exposures']:,} (the "
                f"whole split's: {c['excess_exposures']:,}, {c['missing_exposures']:,})")
    return line + "; "


def summary(report: dict, out: Path | None = None) -> str:
    c = report["coverage"]
    f = c["histogram_fraction"]
    lines = [
        f"run {report['run_id']}: {report['verdict']}"
        + (f" (as of step {report['at_step']})" if report["at_step"] is not None else "")
        + _replayed_note(report),
        f"  coverage {100 * c['coverage']:.1f}% of {c['train_records']:,} train records; "
        f"never seen {100 * f['0']:.1f}%, seen once {100 * f['1']:.1f}%, "
        f"seen 2+ {100 * (f['2'] + f['3+']):.1f}% ({c['exposures']:,} exposures; ideal "
        f"{c['ideal']['min']}..{c['ideal']['max']} each)",
        _distance_line(report) + _first_bad(report),
    ]
    lines += [f"  {x['severity']}: {x['message']}" for x in report["findings"]]
    if out is not None:
        lines.append(f"  report: {out / 'report.html'}  ({out / 'report.json'})")
    return "\n".join(lines)


