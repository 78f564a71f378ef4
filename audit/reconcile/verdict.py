"""Findings from a reconcile report: each finding names the likely cause, with the numbers
that point at it (docs/DESIGN.md, "Known ways loaders go wrong")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from audit.core.exposure import Findings, independent_hosts


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def findings(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's findings, as report.json stores them."""
    out = Findings()
    add = out.add

    cov, integ = r["coverage"], r["integrity"]
    n, total = cov["train_records"], cov["exposures"]
    _left_out_findings(r["consumption"], add)
    bad_loss = r.get("metrics", {}).get("non_finite_losses", {})
    if bad_loss.get("count"):
        add("WARN", "non_finite_loss",
            f"{bad_loss['count']:,} loss value(s) were logged as NaN or infinite, the first at "
            f"step {bad_loss['first_step']}: the run diverged there, and its losses after it "
            "say nothing about the data", count=bad_loss["count"],
            first_step=bad_loss["first_step"])
    if r["run_manifest_fingerprint"] and r["run_manifest_fingerprint"] != r["manifest"][
            "fingerprint"]:
        add("FAIL", "manifest_mismatch",
            f"the run trained against manifest {r['run_manifest_fingerprint']}, this report "
            f"reconciles against {r['manifest']['fingerprint']}: numbers below may be wrong")
    if integ["unknown_keys"]:
        add("FAIL", "unknown_keys",
            f"{integ['unknown_keys']:,} consumed record keys are not in the manifest "
            f"({integ['unknown_segments']:,} segments): the loader read another corpus, or the "
            "manifest is stale", keys=integ["unknown_keys"])
    if integ["hash_mismatches"]:
        add("FAIL", "hash_mismatch",
            f"{integ['hash_mismatches']:,} consumed records differ from the manifest's content "
            "hash: the corpus files changed after the manifest was built",
            mismatches=integ["hash_mismatches"])
    if integ["heldout_consumed_records"]:
        add("FAIL", "heldout_leak",
            f"{integ['heldout_consumed_records']:,} held-out records were trained on "
            f"({integ['heldout_exposures']:,} exposures): held-out loss is no longer held out",
            records=integ["heldout_consumed_records"])
    for rs in r["restarts"]:
        if rs["exact"] is False:
            add("FAIL", "replay_inexact",
                f"attempt {rs['attempt']}'s steps from {rs['rolled_back_from_step']} were rolled "
                f"back and replayed, and {rs['replayed_steps'] - rs['identical_steps']} of "
                f"{rs['replayed_steps']} replayed steps differ from the original "
                f"(first at step {rs['first_differing_step']}): the loader state was not "
                "restored exactly", attempt=rs["attempt"], step=rs["first_differing_step"])
    _exposure_findings(r, add)
    if n and not total:
        add("WARN", "nothing_consumed", "no train record has been consumed yet")
    return out.to_list()


def _left_out_findings(cons: dict[str, Any], add: Callable[..., Any]) -> None:
    def first(dup: bool) -> str:
        said = [s if len(s) < 240 else s[:237] + "..." for s in cons["skipped_files"]
                if (": duplicate:" in s) == dup]
        return "; ".join(said[:3])

    bad, dups = cons.get("unreadable_files", 0), cons.get("duplicate_files", 0)
    if bad:
        add("FAIL", "files_unreadable",
            f"{bad:,} spool file(s) of this run could not be read and were left out: the rows "
            f"they hold are missing from every number of this report. {first(False)}",
            files=bad)
    if dups:
        add("WARN", "duplicate_files",
            f"{dups:,} spool file(s) repeat host-steps already read from another file (a copy "
            f"of a file, or a writer restarted within its attempt); each host-step was counted "
            f"once. {first(True)}", files=dups)


def _exposure_findings(r: dict[str, Any], add: Callable[..., Any]) -> None:
    cov, hosts = r["coverage"], r["hosts"]
    n, total, h = cov["train_records"], cov["exposures"], hosts["count"]
    excess, missing = cov["excess_exposures"], cov["missing_exposures"]
    for change in r.get("batch_changes", []):
        add("FAIL", "batch_changed",
            f"the global batch changed from {change['before']} to {change['after']} rows at "
            f"step {change['step']}: records at the boundary were skipped or repeated "
            f"({excess:,} extra, {missing:,} missing exposures so far)", **change)
    if r.get("batch_changes"):
        return
    dups = cov["epoch_duplicates"]
    if not n or not total or (not excess and not missing and not dups):
        for rs in r["restarts"]:
            prev = rs.get("previous_host_count")
            if rs["resumed_from_step"] is not None and prev not in (None, rs["host_count"]):
                add("WARN", "resharded",
                    f"the run resumed at step {rs['resumed_from_step']} on {rs['host_count']} "
                    f"hosts (was {prev}); no record repeats yet, but a skipped band only shows "
                    "as never-seen records when the epoch ends: check it with tally preflight",
                    step=rs["resumed_from_step"])
        return
    first_bad = r["first_bad_step"]
    where = f" from step {first_bad}" if first_bad is not None else ""
    seen2 = cov["histogram_fraction"]["2"] + cov["histogram_fraction"]["3+"]
    unseen = cov["never_seen_fraction"]
    overlap = hosts["overlap_matrix"]
    per = hosts["per_host"]
    active = [p for p in per if p["exposures"]]
    explained = False

    # Every host saw (almost) everything any host saw: no sharding at all.
    if len(active) > 1:
        diag = [overlap[p["host"]][p["host"]] for p in active]
        off = [overlap[a["host"]][b["host"]] for a in active for b in active if a is not b]
        if min(off) >= 0.95 * max(diag):
            add("FAIL", "no_sharding",
                f"each of {len(active)} hosts saw the same records ({min(off):,} of "
                f"{max(diag):,} shared by every pair): no sharding — every record is seen "
                f"{len(active)} times per epoch", hosts=len(active))
            explained = True
    # Exposure spread like independent draws per host.
    if not explained and len(active) > 1:
        exp = independent_hosts(total, n, len(active))
        pairs = [overlap[a["host"]][b["host"]] > 0 for a in active for b in active
                 if a is not b]
        shared = sum(pairs) / len(pairs)
        if shared >= 0.9 and abs(unseen - exp["never_seen"]) < 0.03 and unseen > 0.05:
            who = ("every host overlaps every other" if shared == 1 else
                   f"{_pct(shared)} of host pairs overlap")
            msg = (f"exposure matches sampling with replacement: {_pct(unseen)} never seen vs "
                   f"{_pct(exp['never_seen'])} expected, {_pct(seen2)} seen 2+ vs "
                   f"{_pct(exp['seen_2plus'])}; {who} — per-host shuffle seeds or double "
                   "sharding")
            # A second slice reads disjoint records until every host has read 1/H^2 of the
            # corpus (N/H in all); independent seeds repeat far sooner (birthday bound).
            before, share = r.get("exposures_before_first_bad"), n / len(active)
            if before is not None and 0.95 * share <= before <= share + total / max(
                    1, r["consumption"]["last_step"] or 1):
                msg += (f"; no record repeated until the hosts had read 1/{len(active)} of the "
                        f"corpus (each 1/{len(active)}^2): the per-host slice was applied twice")
            add("FAIL", "with_replacement", msg, never_seen=unseen, expected=exp["never_seen"],
                seen_2plus=seen2)
            explained = True
    # A resume on another host count, or with another global batch.
    for rs in r["restarts"]:
        if explained or rs["resumed_from_step"] is None:
            continue
        prev = rs.get("previous_host_count")
        if prev is not None and prev != rs["host_count"] and first_bad is not None \
                and first_bad >= rs["resumed_from_step"]:
            add("FAIL", "reshard_band",
                f"after the resume at step {rs['resumed_from_step']} on {rs['host_count']} hosts "
                f"(was {prev}), {excess:,} exposures repeat records and {missing:,} are missing"
                f"{where}: loader state restored on a different host count without an elastic "
                "iterator", step=rs["resumed_from_step"])
            explained = True
    unread = [s for s in r["sources"] if s["never_seen"] == s["records"]]
    if not explained and unread and len(unread) < len(r["sources"]):
        k = sum(s["records"] for s in unread)
        add("FAIL", "files_unread",
            f"{len(unread)} corpus file(s) were never read ({k:,} records: "
            + ", ".join(s["source"] for s in unread[:5])
            + "): file-level sharding with a file count not divisible by the host count",
            files=len(unread), records=k)
        explained = True
    epochs = max(1, -(-total // n))
    batch = r["consumption"].get("rows_per_step") or h
    if not explained and dups and dups <= max(h, batch) * epochs:
        add("FAIL", "padding",
            f"{cov['epoch_duplicate_records']:,} records seen twice within an epoch "
            f"({dups:,} extra exposures over {epochs} epoch(s)), every other record once: the "
            f"sampler pads each epoch to a multiple of the host count ({h}) or of the global "
            f"batch ({batch})", duplicates=dups)
        explained = True
    if not explained and not excess and not missing:
        add("FAIL", "epoch_duplicates",
            f"{dups:,} exposures repeat a record within the same epoch"
            f"{where}", duplicates=dups)
        explained = True
    if not explained:
        add("FAIL", "uneven_exposure",
            f"{excess:,} exposures beyond the ideal and {missing:,} below it{where}: "
            f"{_pct(unseen)} never seen, {_pct(seen2)} seen 2+", excess=excess, missing=missing)

