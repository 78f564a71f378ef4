"""Findings from a reconcile report: each finding names the likely cause, with the numbers
that point at it (docs/DESIGN.md, "Known ways loaders go wrong")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tally.audit.core.exposure import Findings, independent_hosts
from tally.audit.reconcile import evidence


def plural(n: int, word: str, many: str | None = None) -> str:
    """"1 step", "2 steps": the count with its noun agreeing (never "step(s)")."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def _were(n: int) -> str:
    return "was" if n == 1 else "were"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def findings(r: dict[str, Any], steps: Any = None) -> list[dict[str, Any]]:
    """The report's findings, as report.json stores them; `steps` is its steps table (the
    per-step series the findings about step ranges read)."""
    out = Findings()
    add = out.add
    r = {**r, "_steps": _StepSeries(steps)}

    cov, integ = r["coverage"], r["integrity"]
    n, total = cov["train_records"], cov["exposures"]
    left_out_findings(r["consumption"], add)
    bad_loss = r.get("metrics", {}).get("non_finite_losses", {})
    if bad_loss.get("count"):
        add("WARN", "non_finite_loss",
            f"{plural(bad_loss['count'], 'loss value')} {_were(bad_loss['count'])} logged as NaN "
            f"or infinite, the first at "
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
    differ = (r.get("content_basis") or {}).get("differences") or []
    if differ:
        # Every consumed hash was taken over something else than the manifest's: the hash
        # mismatches are this one cause, not content drift (no hash_mismatch flood below).
        basis = integ.get("content_basis") or {}
        said = [f"{integ['hash_mismatches']:,} of {integ['hash_checked']:,} consumed records' "
                "hashes differ"] if integ["hash_checked"] else []
        if integ["hash_unverifiable"]:  # another length than the record's: not checkable
            said.append(f"{plural(integ['hash_unverifiable'], 'segment')} "
                        f"{'is' if integ['hash_unverifiable'] == 1 else 'are'} of another "
                        "length than the manifest's record and could not be checked")
        add("FAIL", "manifest_mismatch",
            f"the run hashes its records otherwise than the manifest ({'; '.join(differ)}; the "
            f"manifest hashes {basis.get('description', 'token ids')}): because of it, "
            f"{' and '.join(said) or 'no consumed record could be checked'}. Rebuild the "
            "manifest with the run's tokenizer and settings (tally manifest --tokenizer ...), "
            "or hash in the loop as the manifest does",
            differences=differ, mismatches=integ["hash_mismatches"],
            unverifiable=integ["hash_unverifiable"])
    elif integ["hash_mismatches"]:
        add("FAIL", "hash_mismatch",
            f"{integ['hash_mismatches']:,} consumed records differ from the manifest's content "
            "hash: the corpus files changed after the manifest was built",
            mismatches=integ["hash_mismatches"])
    starts_seen = total + integ["heldout_exposures"]
    if not differ and integ.get("hash_overlong", 0) * 2 >= max(1, starts_seen):
        # The run did not say how it hashes, and most of its record starts are longer than
        # the manifest's whole record, which no loop reading these records makes: its rows
        # count padding as tokens, or it tokenizes otherwise (an EOS or BOS added). The
        # coverage stands; the hashes cannot be checked. A few such starts are left to the
        # integrity figures (synthetic spools make them; a systematic cause makes most).
        k = integ["hash_overlong"]
        add("WARN", "records_longer",
            f"{k:,} of the run's record starts are longer than the manifest's whole record "
            "(its n_tokens), so their content hashes could not be checked: the loop counts "
            "padding as tokens (give the batch's tokens_segment_ids or a padding mask), or its "
            "records are not the manifest's (a BOS or EOS added, another tokenizer: build the "
            "manifest with the run's settings, tally manifest --tokenizer ... --eos-id ..., "
            "and say them in the loop, LedgerWriter content_basis=)",
            overlong=k, unverifiable=integ["hash_unverifiable"])
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
    _loss_findings(r, add)
    if n and not total:
        add("WARN", "nothing_consumed", "no train record has been consumed yet")
    return [f.to_dict() for f in evidence.attach(out, r, steps)]


def basis_differences(manifest_basis: str, run_bases: list[str]) -> list[str]:
    """How the run's content bases (JSON, tally.pipeline.text.ContentBasis; none: unknown, never a
    difference) differ from the manifest's ("": token ids), in words."""
    from tally.audit.core.errors import CorpusError
    from tally.pipeline.text import ContentBasis

    want = ContentBasis.from_json(manifest_basis, "the manifest")
    out: list[str] = []
    for raw in run_bases:
        try:
            got = ContentBasis.from_json(raw, "the run's spool")
        except CorpusError as exc:
            out.append(str(exc))
            continue
        out += [d for d in want.differences(got) if d not in out]
    return out


def _loss_findings(r: dict[str, Any], add: Callable[..., Any]) -> None:
    """Repeats flattered the training loss: exposures beyond the ideal scored measurably lower
    than due ones in the same windows (tally.audit.reconcile.loss: z >= 3). How train and held-out
    loss moved between the milestones is said beside it, as context: within one run a widening
    gap is also what ordinary generalization does, and the train loss logged at a milestone
    is one step's, so it is no condition of the finding."""
    section = r.get("loss") or {}
    t, g = section.get("test"), section.get("gap")
    if not t or t["z"] < t["threshold_z"]:
        return
    held = ("" if g is None else
            f"; between steps {g['from_step']} and {g['to_step']} the train loss changed by "
            f"{g['train_change']:+.3f} and the held-out loss by {g['heldout_change']:+.3f}")
    add("WARN", "loss_flattered",
        f"train loss on repeated records is {t['difference']:.3f} nats below first exposures "
        f"since step {t['since_step']} (z = {t['z']:.1f} over {t['windows']} windows of "
        f"{section['window_steps']} steps; {t['excess_exposures']:,} repeated and "
        f"{t['due_exposures']:,} due exposures){held}: the training loss looks better than "
        "the data warrants", difference=t["difference"], z=t["z"], since_step=t["since_step"],
        widened_by=None if g is None else g["widened_by"])


def left_out_findings(cons: dict[str, Any], add: Callable[..., Any], *, whose: str = "this run",
                      missing_from: str = "every number of this report",
                      **numbers: Any) -> None:
    """FAIL files_unreadable, FAIL run_id_reused and WARN duplicate_files from what
    tally.audit.reconcile.report.files_left_out counted: how reconcile, diff and exposure say it."""
    from tally.audit.ledger.ingest import is_reuse

    def first(kind: str) -> str:
        said = [s if len(s) < 240 else s[:237] + "..." for s in cons["skipped_files"]
                if _left_out_kind(s, is_reuse) == kind]
        return "; ".join(said[:3])

    bad, dups = cons.get("unreadable_files", 0), cons.get("duplicate_files", 0)
    reused = cons.get("reused_files", 0)
    if bad:
        add("FAIL", "files_unreadable",
            f"{plural(bad, 'spool file')} of {whose} could not be read and {_were(bad)} left "
            f"out: the rows they hold are missing from {missing_from}. {first('unreadable')}",
            files=bad, **numbers)
    if reused:
        add("FAIL", "run_id_reused",
            f"{plural(reused, 'spool file')} under the id of {whose} "
            f"{'comes' if reused == 1 else 'come'} from another training (its run id reused "
            f"after the spool was removed) and {_were(reused)} left out: the rows of that "
            f"training are in none of {missing_from}; give it its own run id. "
            f"{first('reused')}", files=reused, **numbers)
    if dups:
        add("WARN", "duplicate_files",
            f"{plural(dups, 'spool file')} of {whose} {'repeats' if dups == 1 else 'repeat'} "
            f"host-steps already read from another file "
            f"(a copy of a file, or a writer restarted within its attempt); each host-step was "
            f"counted once. {first('duplicate')}", files=dups, **numbers)


def _left_out_kind(said: str, is_reuse: Callable[[str], bool]) -> str:
    """'duplicate', 'reused' or 'unreadable', from one "path: why" example."""
    why = said.split(": ", 1)[-1]
    return "duplicate" if why.startswith("duplicate:") else \
        "reused" if is_reuse(why) else "unreadable"


def _exposure_findings(r: dict[str, Any], add: Callable[..., Any]) -> None:
    """Causes, most specific first: what one host or one resume did (its own evidence in the
    steps), then what the whole run's exposure looks like, then where unexplained repeats sit,
    then what each epoch left out."""
    cov = r["coverage"]
    n, total = cov["train_records"], cov["exposures"]
    if not n:
        return
    explained = _host_findings(r, add)
    explained |= _resume_findings(r, add)
    dups = cov["epoch_duplicates"]
    off = total and (cov["excess_exposures"] or cov["missing_exposures"] or dups)
    if off and not explained:
        explained = _run_findings(r, add)
    if dups and not explained:
        explained = _concentration_findings(r, add)
    if off and not explained:
        explained = _plain_findings(r, add)
    _epoch_findings(r, add, explained)


def _host_findings(r: dict[str, Any], add: Callable[..., Any]) -> bool:
    """A host that handed the same batch at consecutive steps, or consumed nothing for a
    stretch of steps while the others went on."""
    hosts = r["hosts"]
    found = False
    by_host: dict[int, list[dict]] = {}
    for x in hosts.get("repeated_batches", []):
        by_host.setdefault(x["host"], []).append(x)
    for host, spans in sorted(by_host.items()):
        steps = sum(x["steps"] for x in spans)
        where = ", ".join(_steps(x) for x in spans[:5]) + (" ..." if len(spans) > 5 else "")
        add("FAIL", "repeated_batches",
            f"host {host} handed the same batch again at {plural(steps, 'step')} ({where}): each "
            f"of "
            "those steps consumed exactly the records of the step before it, a stalled or "
            "stuck input pipeline", host=host, steps=steps,
            ranges=[[x["first_step"], x["last_step"]] for x in spans])
        found = True
    for g in hosts.get("gaps", []):
        add("FAIL", "host_gap",
            f"host {g['host']} consumed nothing at {_steps(g)} ({plural(g['steps'], 'step')}) "
            f"while "
            f"the other hosts of attempt {g['attempt']} did: its share of those steps' records "
            "was never consumed (a host that stalled, died or was left out of the data)",
            host=g["host"], first_step=g["first_step"], last_step=g["last_step"],
            attempt=g["attempt"])
        found = True
    for g in hosts.get("silent_hosts", []):
        k, named = g["hosts"], ", ".join(map(str, g["examples"]))
        add("FAIL", "host_gap",
            f"{plural(k, 'host')} of attempt {g['attempt']} ({'hosts' if k > 1 else 'host'} {named}"
            f"{', ...' if k > len(g['examples']) else ''}) consumed nothing at all at "
            f"{_steps(g)} ({plural(g['steps'], 'step')}) while the other hosts of the attempt did: "
            "their share of those steps' records was never consumed (hosts that never started "
            "or died before their first flush, or a host count larger than the hosts that ran)",
            hosts=k, examples=g["examples"], first_step=g["first_step"],
            last_step=g["last_step"], attempt=g["attempt"])
        found = True
    return found


def _steps(x: dict[str, Any]) -> str:
    a, b = x["first_step"], x["last_step"]
    return f"step {a}" if a == b else f"steps {a}-{b}"


class _StepSeries:
    """The steps table's within-epoch repeats, as arrays."""

    def __init__(self, steps: Any) -> None:
        if steps is None or not steps.num_rows or "epoch_repeats" not in steps.column_names:
            self.step = self.repeats = np.zeros(0, np.int64)
        else:
            self.step = steps["step"].to_numpy()
            self.repeats = steps["epoch_repeats"].to_numpy()

    def between(self, lo: int, hi: int | None) -> int:
        """Repeats at steps lo <= s < hi."""
        keep = (self.step >= lo) & (True if hi is None else self.step < hi)
        return int(self.repeats[keep].sum())


def _repeats_between(r: dict[str, Any], lo: int, hi: int | None) -> int:
    """Within-epoch repeats at steps lo <= s < hi."""
    return r["_steps"].between(lo, hi)


def _epoch_at(r: dict[str, Any], step: int) -> dict[str, Any] | None:
    """The epoch in progress at `step` (the earliest one whose steps include it)."""
    for e in r.get("epochs", []):
        if e["first_step"] <= step <= e["last_step"]:
            return e
    return None


def _resume_findings(r: dict[str, Any], add: Callable[..., Any]) -> bool:
    """A resume on another host count is the cause of what follows it: repeats after it and
    records its epoch skipped, counted from the ledger. A global batch that changed with it is
    a consequence, reported beside it. A resume the ledger shows to be clean (nothing repeated,
    its epoch complete with nothing skipped) is not flagged; one whose epoch is still going is
    a warning until the epoch ends."""
    found = False
    restarts = [x for x in r["restarts"] if x["resumed_from_step"] is not None]
    changes = {c["step"]: c for c in r.get("batch_changes", [])}
    for i, rs in enumerate(restarts):
        s, prev, now = rs["resumed_from_step"], rs.get("previous_host_count"), rs["host_count"]
        nxt = restarts[i + 1]["resumed_from_step"] if i + 1 < len(restarts) else None
        change = changes.get(s)
        repeated = _repeats_between(r, s, nxt)
        epoch = _epoch_at(r, s)
        skipped = epoch["skipped"] if epoch is not None else None
        if prev is not None and prev != now:
            lost = ("its epoch is still going, so records it skips are not known yet"
                    if skipped is None else f"{skipped:,} records of epoch {epoch['epoch']} "
                    "skipped")
            if repeated or skipped:
                add("FAIL", "reshard_band",
                    f"attempt {rs['attempt']} resumed at step {s} on {now} hosts (was {prev}): "
                    "per-host loader states were restored on another topology; "
                    f"{repeated:,} exposures repeated records already seen in their epoch, "
                    f"{lost}", attempt=rs["attempt"], step=s, hosts=now, previous_hosts=prev,
                    repeated=repeated, skipped=skipped)
                found = True
            elif skipped is None:
                add("WARN", "resharded",
                    f"attempt {rs['attempt']} resumed at step {s} on {now} hosts (was {prev}); "
                    "nothing repeated so far, but a skipped band only shows when its epoch "
                    "ends: check it with tally preflight", attempt=rs["attempt"], step=s,
                    hosts=now, previous_hosts=prev)
            else:
                add("INFO", "resharded",
                    f"attempt {rs['attempt']} resumed at step {s} on {now} hosts (was {prev}); "
                    f"its epoch ({epoch['epoch']}) ended with every record seen once: the "
                    "reshard was clean", attempt=rs["attempt"], step=s)
            if change is not None:
                add("FAIL" if found else "WARN", "batch_changed",
                    f"with it, the global batch changed from {change['before']} to "
                    f"{change['after']} rows at step {s} (a consequence of the new topology)",
                    **change)
        elif change is not None:
            add("FAIL", "batch_changed",
                f"the global batch changed from {change['before']} to {change['after']} rows "
                f"at step {s}: a position recomputed as step x batch no longer names the next "
                f"record ({repeated:,} exposures repeated records after it"
                + ("" if skipped is None else f", {skipped:,} records of its epoch skipped")
                + ")", **change, repeated=repeated, skipped=skipped)
            found = True
    return found


def _run_findings(r: dict[str, Any], add: Callable[..., Any]) -> bool:
    """Patterns of the whole run's exposure: no sharding, sampling with replacement, files
    never read, sampler padding, plain within-epoch repeats or an uneven spread."""
    cov, hosts = r["coverage"], r["hosts"]
    n, total, h = cov["train_records"], cov["exposures"], hosts["count"]
    dups = cov["epoch_duplicates"]
    seen2 = cov["histogram_fraction"]["2"] + cov["histogram_fraction"]["3+"]
    unseen = cov["never_seen_fraction"]
    overlap = hosts["overlap_matrix"]  # rows and columns in per_host's order
    at = [i for i, p in enumerate(hosts["per_host"]) if p["exposures"]]
    active = [hosts["per_host"][i] for i in at]

    # Every host saw (almost) everything any host saw: no sharding at all.
    if len(active) > 1:
        diag = [overlap[i][i] for i in at]
        off = [overlap[i][j] for i in at for j in at if i != j]
        if min(off) >= 0.95 * max(diag):
            add("FAIL", "no_sharding",
                f"each of {len(active)} hosts saw the same records ({min(off):,} of "
                f"{max(diag):,} shared by every pair): no sharding — every record is seen "
                f"{len(active)} times per epoch", hosts=len(active))
            return True
    # Exposure spread like independent draws per host: the histogram matches the binomial
    # model, and nearly every host shares records with some other one (with many hosts, most
    # pairs share none: N/H^2 records each, but each host's records meet the others').
    if len(active) > 1:
        exp = independent_hosts(total, n, len(active))
        sharing = sum(p["overlap_with_others"] > 0 for p in active) / len(active)
        # ... and no host singled out: every host takes its share of the repeats.
        if sharing >= 0.9 and unseen > 0.05 and abs(unseen - exp["never_seen"]) < 0.03 and \
                abs(seen2 - exp["seen_2plus"]) < 0.05 and not _singled_out(r)[0]:
            msg = (f"exposure matches sampling with replacement: {_pct(unseen)} never seen vs "
                   f"{_pct(exp['never_seen'])} expected, {_pct(seen2)} seen 2+ vs "
                   f"{_pct(exp['seen_2plus'])}; {_pct(sharing)} of {len(active)} hosts share "
                   "records with another host — per-host shuffle seeds or double sharding")
            # A second slice reads disjoint records until every host has read 1/H^2 of the
            # corpus (N/H in all); independent seeds repeat far sooner (birthday bound).
            before, share = r.get("exposures_before_first_bad"), n / len(active)
            if before is not None and 0.95 * share <= before <= share + total / max(
                    1, r["consumption"]["last_step"] or 1):
                msg += (f"; no record repeated until the hosts had read 1/{len(active)} of the "
                        f"corpus (each 1/{len(active)}^2): the per-host slice was applied twice")
            add("FAIL", "with_replacement", msg, never_seen=unseen, expected=exp["never_seen"],
                seen_2plus=seen2, hosts=len(active))
            return True
    unread = [s for s in r["sources"] if s["never_seen"] == s["records"]]
    if unread and len(unread) < len(r["sources"]):
        k = sum(s["records"] for s in unread)
        add("FAIL", "files_unread",
            f"{plural(len(unread), 'corpus file')} {_were(len(unread))} never read ({k:,} records: "
            + ", ".join(s["source"] for s in unread[:5])
            + "): file-level sharding with a file count not divisible by the host count",
            files=len(unread), records=k)
        return True
    # The epochs the run consumed: those the rows name, else whole passes over the corpus
    # (ceil(total / n) counted a padded one-epoch run as two).
    epochs = len(r.get("epochs") or []) or max(1, total // n)
    batch = r["consumption"].get("rows_per_step") or h
    if dups and dups <= max(h, batch) * epochs and \
            cov["epoch_duplicate_records"] == dups:
        add("FAIL", "padding",
            f"{cov['epoch_duplicate_records']:,} records seen twice within an epoch "
            f"({dups:,} extra exposures over {plural(epochs, 'epoch')}), every other record "
            f"once: the "
            f"sampler pads each epoch to a multiple of the host count ({h}) or of the global "
            f"batch ({batch})", duplicates=dups)
        return True
    return False


def _plain_findings(r: dict[str, Any], add: Callable[..., Any]) -> bool:
    """What is wrong when no mechanism explains it: repeats within an epoch, or exposure
    spread unevenly around the ideal."""
    cov = r["coverage"]
    excess, missing, dups = (cov["excess_exposures"], cov["missing_exposures"],
                             cov["epoch_duplicates"])
    first_bad = r["first_bad_step"]
    where = f" from step {first_bad}" if first_bad is not None else ""
    if dups and not excess and not missing:
        add("FAIL", "epoch_duplicates",
            f"{dups:,} exposures repeat a record within the same epoch{where}", duplicates=dups)
        return True
    if excess or missing:
        seen2 = cov["histogram_fraction"]["2"] + cov["histogram_fraction"]["3+"]
        add("FAIL", "uneven_exposure",
            f"{excess:,} exposures beyond the ideal and {missing:,} below it{where}: "
            f"{_pct(cov['never_seen_fraction'])} never seen, {_pct(seen2)} seen 2+",
            excess=excess, missing=missing)
        return True
    return False


def _singled_out(r: dict[str, Any]) -> tuple[list[int], dict[int, float], float]:
    """Hosts that took part in at least half of the records repeated within an epoch, and in
    twice the share of the typical host, when they are a quarter of the hosts or fewer; with
    every host's share and the typical (median) share."""
    per = [p for p in r["hosts"]["per_host"] if p["exposures"]]
    groups = r["coverage"]["epoch_duplicate_records"]
    if groups < 10 or len(per) < 2:
        return [], {}, 0.0
    share = {p["host"]: p.get("epoch_duplicated_records", 0) / groups for p in per}
    typical = float(np.median(list(share.values())))
    named = sorted((h for h, s in share.items() if s >= 0.5 and s >= 2 * typical),
                   key=lambda h: -share[h])
    if len(named) > max(1, len(per) // 4):
        named = []
    return named, share, typical


def _concentration_findings(r: dict[str, Any], add: Callable[..., Any]) -> bool:
    """Where within-epoch repeats sit when a few hosts or one stretch of steps hold most of
    them. A host is named when it took part in at least half of the records repeated within
    an epoch and in twice the share of the typical host: its loader reads what the others also
    read (its shard, seed or slice differs). Steps are named when 80% of the repeats fall in a
    quarter of the run's steps or less."""
    per = [p for p in r["hosts"]["per_host"] if p["exposures"]]
    groups = r["coverage"]["epoch_duplicate_records"]
    named, share, typical = _singled_out(r)
    if named:
        said = ", ".join(f"host {h} {_pct(share[h])}" for h in named)
        add("FAIL", "repeats_on_hosts",
            f"{len(named)} of {len(per)} hosts took part in most of the {groups:,} records "
            f"repeated within an epoch ({said}; the typical host {_pct(typical)}): their "
            "loaders read records the other hosts also read (a shard, seed or slice that "
            "differs)", hosts=named, shares=[share[h] for h in named], typical=typical)
    total = sum(p["epoch_repeats"] for p in per)
    series = r["_steps"]
    if total < 10 or not len(series.step):
        return bool(named)
    span = int(series.step[-1] - series.step[0] + 1)
    # The shortest stretch of steps holding 80% of the repeats: two pointers over the steps
    # that have any.
    at = np.flatnonzero(series.repeats)
    steps = list(zip(series.step[at].tolist(), series.repeats[at].tolist(), strict=True))
    best = None
    j = held = 0
    for i in range(len(steps)):
        while j < len(steps) and held < 0.8 * total:
            held += steps[j][1]
            j += 1
        if held >= 0.8 * total:
            width = steps[j - 1][0] - steps[i][0] + 1
            if best is None or width < best[2]:
                best = (steps[i][0], steps[j - 1][0], width, held)
        held -= steps[i][1]
    if best is not None and best[2] <= 0.25 * span:
        add("FAIL", "repeats_in_steps",
            f"{_pct(best[3] / total)} of the {total:,} within-epoch repeats fell in steps "
            f"{best[0]}-{best[1]} ({best[2]:,} of the run's {span:,} steps): something changed "
            "there (a resume, a loader reconfigured, a data source switched)",
            first_step=best[0], last_step=best[1], share=best[3] / total)
        return True
    return bool(named)


def _epoch_findings(r: dict[str, Any], add: Callable[..., Any], explained: bool) -> None:
    """Records an epoch never reached. In an epoch the run has left behind, a loader that drops
    each epoch's remainder leaves exactly N mod (global batch) out; other counts are skipped
    records. The last epoch of a finished run may end early by design: said, not flagged."""
    n = r["coverage"]["train_records"]
    batch = r["consumption"].get("rows_per_step") or 0
    remainder = n % batch if batch else None
    done = [e for e in r.get("epochs", []) if e["complete"] and e["skipped"]]
    if done and not explained:
        if remainder and all(e["skipped"] == remainder for e in done):
            add("WARN", "drop_remainder",
                ("the finished epoch" if len(done) == 1 else
                 f"each of {len(done):,} finished epochs")
                + f" left out {plural(remainder, 'record')}: {n:,} train records do not divide "
                f"by the global batch of {batch}, and the loader "
                "drops each epoch's remainder (drop_last samplers, batch drop_remainder); "
                "different records each epoch", epochs=len(done), records=remainder)
        else:
            skipped = sum(e["skipped"] for e in done)
            add("FAIL", "epoch_skipped",
                f"{plural(skipped, 'record')} {_were(skipped)} never consumed in "
                f"{'the epoch' if len(done) == 1 else 'epochs'} the run has finished ("
                + ", ".join(f"epoch {e['epoch']}: {e['skipped']:,}" for e in done[:5])
                + "): the loader skipped them", records=skipped,
                epochs=[e["epoch"] for e in done])
    for e in r.get("epochs", []):
        if e["final"] and e["skipped"]:
            why = (f": {n:,} train records do not divide by the global batch of {batch}, and "
                   "the run ended with the last full batch" if remainder and
                   e["skipped"] == remainder else "")
            add("INFO", "final_epoch_short",
                f"the run finished in epoch {e['epoch']} with {e['skipped']:,} of its records "
                f"never consumed{why}", epoch=e["epoch"], records=e["skipped"])
