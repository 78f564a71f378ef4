"""Findings from a reconcile report: each finding names the likely cause, with the numbers
that point at it (docs/DESIGN.md, "Known ways loaders go wrong")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from tally.audit.buckets.left_out import left_out_findings
from tally.audit.core.exposure import Findings, independent_hosts
from tally.audit.core.words import listed, plural, were
from tally.audit.reconcile import evidence


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
            f"{plural(bad_loss['count'], 'loss value')} {were(bad_loss['count'])} logged as NaN "
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
            f"{plural(integ['unknown_keys'], 'consumed record key')} "
            f"{'is' if integ['unknown_keys'] == 1 else 'are'} not in the manifest "
            f"({plural(integ['unknown_segments'], 'segment')}): the loader read another "
            "corpus, or the manifest is stale", keys=integ["unknown_keys"])
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
            f"{plural(integ['hash_mismatches'], 'consumed record')} "
            f"{'differs' if integ['hash_mismatches'] == 1 else 'differ'} from the manifest's "
            "content hash: the corpus files changed after the manifest was built",
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
            f"{plural(integ['heldout_consumed_records'], 'held-out record')} "
            f"{were(integ['heldout_consumed_records'])} trained on "
            f"({plural(integ['heldout_exposures'], 'exposure')}): held-out loss is no longer "
            "held out",
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


def _exposure_findings(r: dict[str, Any], add: Callable[..., Any]) -> None:
    """Causes, most specific first: what one host or one resume did (its own evidence in the
    steps), then what the whole run's exposure looks like, then where unexplained repeats sit,
    then what each epoch left out."""
    cov = r["coverage"]
    n, total = cov["train_records"], cov["exposures"]
    if not n:
        return
    by_hosts = _host_findings(r, add)
    dups = _duplicates(r)
    excess, missing = _distance(r)
    off = total and (excess or missing or dups)
    # Each domain even by its own ideal is what a mixture read on unsliced hosts looks like
    # too (every domain H times over): no sharding is asked first, and then said alone.
    unsharded = not off and r["domain_ideal"]["weighted"] and _no_sharding(
        r, lambda *a, **k: None)
    if r["domain_ideal"]["weighted"] and not unsharded:
        own, forced = r["domain_ideal"], cov["epoch_duplicates"] - dups
        said = ([f"{cov['excess_exposures']:,} exposures beyond the whole split's ideal and "
                 f"{cov['missing_exposures']:,} below it"]
                if cov["excess_exposures"] or cov["missing_exposures"] else [])
        said += [f"{forced:,} repeats within an epoch, which a domain's share of the epoch "
                 "forces"] if forced else []
        even = not excess and not missing
        partial = even and (own["excess_exposures"] or own["missing_exposures"])
        add("INFO", "domain_weighted",
            f"the domains were read at different rates (passes: {_rates(r)})"
            + (" and each record about as often as its own domain's passes allow" if even
               else "")
            + ": a mixture that weights its domains, measured against each domain's own "
            f"ideal ({'; '.join(said)}: the weights' doing)"
            + (f". Over the run {own['excess_exposures']:,} exposures are beyond their own "
               f"domain's ideal and {own['missing_exposures']:,} below it while each epoch "
               "read each domain evenly: the loader restarts a domain's partial pass every "
               "epoch (interleaving until every source is exhausted does), and the extra "
               "read goes to other records each time" if partial else "")
            + ". If the mixture does not mean these weights, they are the fault",
            passes={d["domain"]: round(d["passes"], 4) for d in r["domains"][:16]},
            split_excess=cov["excess_exposures"], split_missing=cov["missing_exposures"],
            forced_repeats=forced)
    # A resume on the same topology is named only where neither a host nor the whole run's
    # pattern accounts for what its steps did (asked without saying it).
    explained = _resume_findings(r, add, lambda: by_hosts or bool(
        off and _run_findings(r, lambda *a, **k: None))) or by_hosts
    if off and not explained:
        explained = _run_findings(r, add)
    elif unsharded and not explained:
        explained = _no_sharding(r, add)
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
        w = _workers_in_step(spans)
        why = ("a stalled or stuck input pipeline" if not w else
               f"the same batch {w} times in a row, over and over: its DataLoader's {w} workers "
               "each make the same batches (an IterableDataset that does not split its records "
               "between workers by torch.utils.data.get_worker_info(), or a shard list handed "
               "whole to every worker; unless the loop feeds each batch that often on purpose, "
               "data echoing)")
        add("FAIL", "repeated_batches",
            f"host {host} handed the same batch again at {plural(steps, 'step')} ({where}): each "
            f"of those steps consumed exactly the records of the step before it, {why}",
            host=host, steps=steps,
            ranges=[[x["first_step"], x["last_step"]] for x in spans[:RANGES]],
            **({"workers": w} if w else {}),
            **({"ranges_in_all": len(spans)} if len(spans) > RANGES else {}))
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


# Ranges of steps a repeated_batches finding lists, at most (W workers' copies over a
# 1.4M-step run would make 700k a host): the report's hosts.repeated_batches keeps them all.
RANGES = 16


def _workers_in_step(spans: list[dict[str, Any]]) -> int | None:
    """W when a host's repeated batches come in lockstep, W - 1 repeats every W steps, at
    least 4 times and 9 in 10 of them so (W workers each making the same batches, which the
    loader hands out in turn); None for repeats at random (a stalled pipeline)."""
    if len(spans) < 4 or len({x["steps"] for x in spans}) != 1:
        return None
    w = spans[0]["steps"] + 1
    apart = [b["first_step"] - a["first_step"] for a, b in zip(spans, spans[1:], strict=False)]
    return w if sum(d == w for d in apart) >= 0.9 * len(apart) else None


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

    def first(self, lo: int, hi: int) -> int | None:
        """The first step lo <= s <= hi with a repeat (None: none)."""
        at = np.flatnonzero((self.step >= lo) & (self.step <= hi) & (self.repeats > 0))
        return int(self.step[at[0]]) if at.size else None


def _repeats_between(r: dict[str, Any], lo: int, hi: int | None) -> int:
    """Within-epoch repeats at steps lo <= s < hi."""
    return r["_steps"].between(lo, hi)


def _epoch_at(r: dict[str, Any], step: int) -> dict[str, Any] | None:
    """The epoch in progress at `step` (the earliest one whose steps include it)."""
    for e in r.get("epochs", []):
        if e["first_step"] <= step <= e["last_step"]:
            return e
    return None


@dataclasses.dataclass(eq=False)
class _Resume:
    """A resumed attempt and its band: the steps it consumed in the surviving lineage, from its
    resume step to the step a later attempt resumed at (`end`, exclusive; None: the run's
    last), and what the steps just before it (the band it continues, within its epoch when
    that epoch began before it) repeated."""

    attempt: int
    step: int
    end: int | None
    hosts: int
    previous_hosts: int | None
    epoch: dict[str, Any] | None
    repeated: int  # within-epoch repeats at its steps
    repeated_before: int  # ... at the steps it continues
    change: dict[str, Any] | None  # the global batch changed at its step
    last_step: int  # its band's last step (below `step`: rolled back whole)
    own: bool = False  # its consumption went wrong: the epoch's skipped records can be its
    skipped: int | None = None  # records of its epoch charged to it; None: epoch still going
    skipped_by: _Resume | None = None  # the later resume its epoch's skipped records went to

    @property
    def resharded(self) -> bool:
        return self.previous_hosts is not None and self.previous_hosts != self.hosts

    @property
    def steps(self) -> str:
        return "no step" if self.last_step < self.step else _steps(
            {"first_step": self.step, "last_step": self.last_step})

    def lost(self) -> str:
        """What its epoch skipped, as far as it is this resume's."""
        e = self.epoch
        if self.skipped is None or e is None:
            return "its epoch is still going, so records it skips are not known yet"
        if self.skipped_by is not None:
            by = self.skipped_by
            return (f"the {plural(e['skipped'], 'record')} epoch {e['epoch']} skipped are "
                    f"attempt {by.attempt}'s (resumed at step {by.step})")
        if not self.skipped:
            return f"no record of epoch {e['epoch']} skipped"
        return f"{self.skipped:,} records of epoch {e['epoch']} skipped"


def _resumes(r: dict[str, Any]) -> list[_Resume]:
    """Every resumed attempt with its band. A later attempt resumed at step t rolls back every
    earlier row at t or after, so a band ends at the lowest later resume step; the band a
    resume continues is the latest earlier one that began before it."""
    restarts = [x for x in r["restarts"] if x["resumed_from_step"] is not None]
    changes = {c["step"]: c for c in r.get("batch_changes", [])}
    first, last = r["consumption"].get("first_step"), r["consumption"].get("last_step")
    out = []
    for i, rs in enumerate(restarts):
        s = rs["resumed_from_step"]
        end = min((x["resumed_from_step"] for x in restarts[i + 1:]), default=None)
        if end is not None:
            end = max(end, s)  # rolled back whole: an empty band
        lo = max((x["resumed_from_step"] for x in restarts[:i] if x["resumed_from_step"] < s),
                 default=s if first is None else min(first, s))
        epoch = _epoch_at(r, s)
        if epoch is not None and lo < epoch["first_step"] < s:
            lo = epoch["first_step"]
        out.append(_Resume(rs["attempt"], s, end, rs["host_count"],
                           rs.get("previous_host_count"), epoch, _repeats_between(r, s, end),
                           _repeats_between(r, lo, s), changes.get(s),
                           (s - 1 if last is None else last) if end is None else end - 1))
    return out


def _charge(r: dict[str, Any], resumes: list[_Resume], others_explain: Callable[[], bool]
            ) -> None:
    """Which resumes went wrong (`own`) and whose each epoch's skipped records are
    (`skipped`, `skipped_by`).

    A resume on another topology that repeated records went wrong (as before), and so did one
    at another global batch on the same hosts. So did one on the same topology whose steps
    repeated records while the steps it continues repeated none, unless something else
    explains the repeats (`others_explain`: a host's own fault, a pattern of the whole run's
    exposure such as padding at an epoch's end or sampling with replacement): a correct
    resume continues where the checkpoint left off and re-reads nothing.

    The records an epoch skipped were skipped by the last resume in it that went wrong: it
    restored a position that claims as consumed records no earlier band consumed, whatever
    earlier resumes did (a record still unread when it resumed is unread because it jumped
    past it). With none, by the epoch's last reshard (a restore on another topology that
    repeated nothing may still skip); with none either, by a same-topology resume only when
    the epoch ended and the loader is known to skip none on its own: the epochs the run
    finished without a resume skipped nothing, or, with no such epoch to judge by, the epoch
    is the last of a finished run whose loader ran out of data in it with a short batch (it
    gives its remainder rather than drop it)."""
    unexplained: list[bool] = []

    def may_charge() -> bool:
        if not unexplained:
            unexplained.append(not others_explain())
        return unexplained[0]

    for x in resumes:
        if x.resharded:
            x.own = bool(x.repeated)
        elif x.change is not None:  # a position recomputed at another batch: never right
            x.own = True
        elif x.repeated and not x.repeated_before:
            x.own = may_charge()
    at_resume = {id(x.epoch) for x in resumes if x.epoch is not None}
    finished = [e for e in r.get("epochs", []) if e["complete"] and id(e) not in at_resume]
    loader_skips_none = bool(finished) and not any(e["skipped"] for e in finished)
    for e in r.get("epochs", []):
        here = [x for x in resumes if x.epoch is e]
        k = e["skipped"]
        for x in here:
            x.skipped = k
        if not k or not here:
            continue
        # A final epoch is complete with records skipped only when the loader ran out of data
        # in it (tally.audit.reconcile.report._data_ended).
        judged = loader_skips_none or (not finished and e["final"] and e["complete"])
        guilty = [x for x in here if x.own] or [x for x in here if x.resharded] or [
            x for x in here if not x.repeated and e["complete"] and judged
            and may_charge()]
        if not guilty:
            continue
        last = max(guilty, key=lambda x: (x.step, x.attempt))
        last.own = True
        for x in here:
            if x is not last:
                x.skipped, x.skipped_by = 0, last


def _resume_findings(r: dict[str, Any], add: Callable[..., Any],
                     others_explain: Callable[[], bool]) -> bool:
    """What each resume did, counted from the ledger: the repeats at its own steps and the
    records its epoch skipped that are its (`_charge`). A resume on another host count that
    went wrong is `reshard_band`, with a global batch that changed with it reported beside it
    as a consequence; one at another global batch on the same hosts is `batch_changed`; one on
    the same topology is `resume_band`. A reshard the ledger shows to be clean (nothing
    repeated, none of its epoch's skipped records its) is not flagged; one whose epoch is still
    going is a warning until the epoch ends."""
    found = False
    resumes = _resumes(r)
    _charge(r, resumes, others_explain)
    for x in resumes:
        s, prev, now, change = x.step, x.previous_hosts, x.hosts, x.change
        repeated, skipped, epoch = x.repeated, x.skipped, x.epoch
        if x.resharded:
            if x.own:
                add("FAIL", "reshard_band",
                    f"attempt {x.attempt} resumed at step {s} on {now} hosts (was {prev}): "
                    "per-host loader states were restored on another topology; "
                    f"{repeated:,} exposures repeated records already seen in their epoch, "
                    f"{x.lost()}", attempt=x.attempt, step=s, hosts=now, previous_hosts=prev,
                    repeated=repeated, skipped=skipped)
                found = True
            elif skipped is None:
                add("WARN", "resharded",
                    f"attempt {x.attempt} resumed at step {s} on {now} hosts (was {prev}); "
                    "nothing repeated so far, but a skipped band only shows when its epoch "
                    "ends: check it with tally preflight", attempt=x.attempt, step=s,
                    hosts=now, previous_hosts=prev)
            elif x.skipped_by is not None:
                add("INFO", "resharded",
                    f"attempt {x.attempt} resumed at step {s} on {now} hosts (was {prev}); "
                    f"nothing it consumed ({x.steps}) repeated a record, and {x.lost()}: the "
                    "reshard itself was clean", attempt=x.attempt, step=s)
            else:
                add("INFO", "resharded",
                    f"attempt {x.attempt} resumed at step {s} on {now} hosts (was {prev}); "
                    f"its epoch ({epoch['epoch']}) ended with every record seen once: the "
                    "reshard was clean", attempt=x.attempt, step=s)
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
        elif x.own:
            hosts = f"the same {plural(now, 'host')}" if prev == now else plural(now, "host")
            if repeated:
                said = (f"{repeated:,} exposures at its {x.steps} repeated records already "
                        f"seen in their epoch, where the steps before it repeated none; "
                        f"{x.lost()}: its loader did not continue where the checkpoint left "
                        "off (no state restored, or a stale or partial one)")
            else:
                why = ("while the epochs the run finished without a resume skipped none" if any(
                    e["complete"] and e["epoch"] != (x.epoch or {}).get("epoch")
                    for e in r.get("epochs", [])) else "although its loader gave the epoch's "
                    "remainder as a short last batch, so it drops none on its own")
                said = (f"nothing it consumed repeated a record, but {x.lost()} {why}: its "
                        "restored position was ahead of what had been consumed (a state saved "
                        "after batches were read ahead, a shuffle buffer not restored, or from "
                        "a later step)")
            add("FAIL", "resume_band",
                f"attempt {x.attempt} resumed at step {s} on {hosts}: {said}",
                attempt=x.attempt, step=s, hosts=now, previous_hosts=prev, repeated=repeated,
                skipped=skipped)
            found = True
    return found


def _no_sharding(r: dict[str, Any], add: Callable[..., Any]) -> bool:
    """Every host saw (almost) everything any host saw: no sharding at all."""
    hosts = r["hosts"]
    overlap = hosts["overlap_matrix"]  # rows and columns in per_host's order
    at = [i for i, p in enumerate(hosts["per_host"]) if p["exposures"]]
    active = [hosts["per_host"][i] for i in at]
    # Where epochs are known, each host then reads each record in every epoch: (H - 1)/H of
    # the exposures repeat within their epoch. Over several epochs a few correctly sharded
    # hosts come to share most records too (2 hosts over 4 epochs: 7 in 8 expected,
    # 1 - 2/2^4; 365 of 383 in a probe of HF interleaving), with no such repeats.
    if len(active) > 1 and not (r.get("epochs") and not _repeated_as_unsharded(r, len(active))):
        diag = [overlap[i][i] for i in at]
        off = [overlap[i][j] for i in at for j in at if i != j]
        if min(off) >= 0.95 * max(diag):
            add("FAIL", "no_sharding",
                f"each of {len(active)} hosts saw the same records ({min(off):,} of "
                f"{max(diag):,} shared by every pair): no sharding — every record is seen "
                f"{len(active)} times per epoch", hosts=len(active))
            return True
    return False


def _run_findings(r: dict[str, Any], add: Callable[..., Any]) -> bool:
    """Patterns of the whole run's exposure: no sharding, sampling with replacement, files
    never read, sampler padding, plain within-epoch repeats or an uneven spread."""
    cov, hosts = r["coverage"], r["hosts"]
    n, total, h = cov["train_records"], cov["exposures"], hosts["count"]
    dups = cov["epoch_duplicates"]
    seen2 = cov["histogram_fraction"]["2"] + cov["histogram_fraction"]["3+"]
    unseen = cov["never_seen_fraction"]
    at = [i for i, p in enumerate(hosts["per_host"]) if p["exposures"]]
    active = [hosts["per_host"][i] for i in at]

    if _no_sharding(r, add):
        return True
    # Hosts in groups that each read one shard: a sampler rank or shard index taken from the
    # rank within a node (LOCAL_RANK on every node), or one host's index given to another.
    shared = _shared_shards(r, at) if len(active) > 2 else []
    if shared:
        grouped = sum(len(g) for g in shared)
        said = "; ".join(f"hosts {listed(g, 'host')}" for g in shared[:4])
        said += "; ..." if len(shared) > 4 else ""
        if cov["missing_exposures"]:
            why = ("hosts given one shard between them (a sampler rank or shard index taken "
                   "from the rank within a node, or one host's index given to another): in "
                   "each epoch every host of a group reads each record of its shard, and the "
                   "shards those hosts were meant to read are not read at all")
        else:  # the groups still read every record: fewer shards than hosts
            why = ("every record was still read, by every host of a group: fewer data-parallel "
                   "shards than hosts (a sampler's num_replicas or shard count below the host "
                   "count), or the processes of one data-parallel replica (tensor- or "
                   "pipeline-parallel ranks) audited as hosts of their own, where one process "
                   "of each replica should write")
        add("FAIL", "shared_shard",
            f"{plural(grouped, 'host')} of {len(active)} read the same records as another host "
            f"({said}): {why}", hosts=grouped, groups=[g[:16] for g in shared[:16]])
        return True
    # Every host read each record of its share W times an epoch, on its own: W copies made
    # within the host (identical batches in lockstep are named by repeated_batches first).
    copies = _worker_copies(r)
    if copies:
        w, share = copies
        add("FAIL", "worker_copies",
            f"{_pct(share)} of the records a host read in an epoch it read {w} times in that "
            f"epoch, each time on that same host ({dups:,} exposures repeat a record within its "
            f"epoch): the host's data pipeline makes {w} copies of its share (an "
            f"IterableDataset in a DataLoader with {w} workers that does not split its records "
            "between them by torch.utils.data.get_worker_info(), or a shard list handed whole "
            "to every worker)", workers=w, duplicates=dups)
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
    domains = _unread_domains(r)
    passed = total >= n or any(e["complete"] for e in r.get("epochs") or [])
    # Files left out by file-level sharding (files % hosts of them) may hold whole domains.
    sharding_rest = bool(unread) and len(unread) == len(r["sources"]) % h
    if domains and passed and not sharding_rest:
        k = sum(d["records"] for d in domains)
        add("FAIL", "domain_unread",
            f"{_domains_text(domains)} {were(len(domains))} never read ({k:,} train records, "
            f"{_pct(k / n)} of the split) while the other domains were, over "
            + (f"{total / n:.1f} epochs' worth of exposures" if total >= n else
               "a finished epoch")
            + ": the loader's sources or mixture left "
            + ("it" if len(domains) == 1 else "them") + " out"
            + ("" if r["run"]["finished"] else
               " (or a stage of a curriculum the run has not reached yet)"),
            domains=[d["domain"] for d in domains[:16]], records=k)
        return True
    if unread and len(unread) < len(r["sources"]):
        k = sum(s["records"] for s in unread)
        add("FAIL", "files_unread",
            f"{plural(len(unread), 'corpus file')} {were(len(unread))} never read ({k:,} records: "
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
    return _drop_remainder(r, add)


def _worker_copies(r: dict[str, Any]) -> tuple[int, float] | None:
    """(W, share) when 9 in 10 of the (record, epoch) pairs read were read exactly W >= 2
    times, every record repeated within an epoch was repeated on one host only, and in each
    epoch the repeats began within its first 1/(2W) of steps (W copies read side by side);
    None otherwise: a run that weights its domains (its repeats are its weights'), or the
    same share read W times one pass after the other under one epoch number (an epoch
    counter that did not advance: the first repeat comes only after a whole pass)."""
    cov, per = r["coverage"], r["hosts"]["per_host"]
    groups = cov["epoch_duplicate_records"]
    epochs = r.get("epochs") or []
    times = [e.get("times_seen") for e in epochs]
    if not groups or r["domain_ideal"]["weighted"] or None in times or not times or \
            sum(p.get("epoch_duplicated_records", 0) for p in per) != groups:
        return None
    seen = np.zeros(max(len(t) for t in times), np.int64)
    for t in times:
        seen[:len(t)] += t
    w = int(np.argmax(seen)) + 1  # the commonest times seen
    share = float(seen[w - 1] / seen.sum())
    if w < 2 or share < 0.9:
        return None
    for e in epochs:
        first = r["_steps"].first(e["first_step"], e["last_step"])
        span = e["last_step"] - e["first_step"] + 1
        if first is not None and first - e["first_step"] >= span / (2 * w):
            return None
    return w, share


SHARED_SHARD = 0.95  # two hosts whose record sets agree this much read one shard
APART = 0.5  # hosts of different groups share at most this much (epochs unknown)
MIN_SHARD = 16  # records a grouped host read at least: fewer agree by chance


def _shared_shards(r: dict[str, Any], at: list[int]) -> list[list[int]]:
    """Groups of the active hosts (`at`, indices into per_host) that read the same records
    as each other, of two hosts or more, when the run has more than one group; [] otherwise.
    The groups must account for the within-epoch repeats where epochs are known (a group of g
    hosts repeats (g - 1)/g of what its hosts consumed in each epoch), else hosts of different
    groups must share at most half of the smaller host's records (sharding works between the
    groups). Over many epochs a correctly sharded host reads most of the corpus and most pairs
    of hosts agree to ~95%: that has no within-epoch repeats to account for, and this runs
    only for a run whose exposure is off."""
    hosts = r["hosts"]
    m = np.asarray(hosts["overlap_matrix"], np.int64)[np.ix_(at, at)]
    d = np.diag(m)
    same = m >= SHARED_SHARD * np.maximum.outer(d, d)
    label = np.full(len(at), -1)
    for i in range(len(at)):  # connected components of `same`
        if label[i] >= 0:
            continue
        label[i], todo = i, [i]
        while todo:
            k = todo.pop()
            new = np.flatnonzero(same[k] & (label < 0))
            label[new] = i
            todo += new.tolist()
    groups = [np.flatnonzero(label == g) for g in np.unique(label)]
    shared = [g for g in groups if len(g) > 1]
    if len(groups) < 2 or not shared or min(int(d[g].min()) for g in shared) < MIN_SHARD:
        return []
    per = hosts["per_host"]
    if r.get("epochs"):
        due = sum(per[at[i]]["exposures"] * (len(g) - 1) / len(g) for g in shared for i in g)
        if r["coverage"]["epoch_duplicates"] < 0.8 * due:
            return []
    else:
        apart = label[:, None] != label[None, :]
        if (m[apart] > APART * np.minimum.outer(d, d)[apart]).any():
            return []
    return [[per[at[i]]["host"] for i in g] for g in shared]


def _plain_findings(r: dict[str, Any], add: Callable[..., Any]) -> bool:
    """What is wrong when no mechanism explains it: repeats within an epoch, or exposure
    spread unevenly around the ideal."""
    cov = r["coverage"]
    (excess, missing), dups = _distance(r), _duplicates(r)
    first_bad = r["first_bad_step"]
    where = f" from step {first_bad}" if first_bad is not None else ""
    if dups and not excess and not missing:
        add("FAIL", "epoch_duplicates",
            f"{dups:,} exposures repeat a record within the same epoch{where}", duplicates=dups)
        return True
    if excess or missing:
        seen2 = cov["histogram_fraction"]["2"] + cov["histogram_fraction"]["3+"]
        if r["domain_ideal"]["weighted"]:
            said = (f"{excess:,} exposures beyond their own domain's ideal and {missing:,} "
                    "below it")
        else:
            said = f"{excess:,} exposures beyond the ideal and {missing:,} below it{where}"
        add("FAIL", "uneven_exposure",
            f"{said}: {_pct(cov['never_seen_fraction'])} never seen, {_pct(seen2)} seen 2+"
            + _domain_rates(r), excess=excess, missing=missing)
        return True
    return False


def _distance(r: dict[str, Any]) -> tuple[int, int]:
    """(excess, missing) exposures against the ideal the run is measured by: each domain's
    own where it weights its domains (none where each epoch read each domain evenly: the
    rest is the loader restarting a domain's partial pass each epoch), else the whole train
    split's."""
    ideal = r["domain_ideal"]
    if not ideal["weighted"]:
        ideal = r["coverage"]
    elif ideal["epochs_even"]:
        return 0, 0
    return ideal["excess_exposures"], ideal["missing_exposures"]


def _repeated_as_unsharded(r: dict[str, Any], hosts: int) -> bool:
    """Whether the within-epoch repeats are what H unsharded hosts make: (H - 1)/H of the
    exposures (four fifths of that, for epochs a loader ends early), in the run and in every
    domain alike. All repeats count, those a mixture's weights force too: a mixture read
    without sharding reads each domain H times an epoch on its own passes, which its own
    ideal takes for an upsampled domain (Grain's `mix` on 2 unsliced hosts: every record of
    each domain exactly twice an epoch, each on both hosts). A correctly sharded mixture
    repeats within epochs only the domains it reads more than once an epoch."""
    due = 0.8 * (hosts - 1) / hosts
    if r["coverage"]["epoch_duplicates"] < due * r["coverage"]["exposures"]:
        return False
    return all(d.get("epoch_duplicates") is None or d["epoch_duplicates"] >= due * d["exposures"]
               for d in r["domains"] if d["exposures"])


def _duplicates(r: dict[str, Any]) -> int:
    """Within-epoch duplicates the run is measured by: where it weights its domains, those
    beyond what each domain's share of an epoch forces; else all of them."""
    ideal = r["domain_ideal"] if r["domain_ideal"]["weighted"] else r["coverage"]
    return ideal["epoch_duplicates"]


def _rates(r: dict[str, Any]) -> str:
    """The domains' passes (exposures per record), most first: "code 2.02, web 1.54"."""
    rates = sorted(((d["passes"], d["domain"]) for d in r["domains"] if d["records"]),
                   reverse=True)
    return ", ".join(f"{name} {rate:.2f}" for rate, name in rates[:4]) + (
        ", ..." if len(rates) > 4 else "")


def _domain_rates(r: dict[str, Any]) -> str:
    """Where the domains were read at clearly different rates but their own ideals do not
    account for the distance (a weighted mixture with a fault of its own, or a fault that
    reads some domains more), what the rates and that distance were."""
    rates = [d["passes"] for d in r["domains"] if d["records"]]
    ideal = r["domain_ideal"]
    if ideal["weighted"] or len(rates) < 2 or min(rates) <= 0 or \
            max(rates) < 1.25 * min(rates):
        return ""
    return (f"; the domains were read at different rates (passes: {_rates(r)}), and against "
            f"each domain's own ideal {ideal['excess_exposures']:,} exposures are beyond it "
            f"and {ideal['missing_exposures']:,} below: more than a mixture's weights explain")


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


def _unread_domains(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The domains of the train split none of whose records was consumed, when another
    domain's were."""
    domains = [d for d in r.get("domains") or [] if d["records"]]
    unread = [d for d in domains if not d["exposures"]]
    return unread if len(unread) < len(domains) else []


def _domains_text(domains: list[dict[str, Any]]) -> str:
    names = [d["domain"] for d in domains]
    return f"domain{'s' if len(names) > 1 else ''} {listed(names, 'domain')}"


def _remainder_unit(r: dict[str, Any], k: int, shards: bool = False
                    ) -> tuple[int, str] | None:
    """The unit whose remainder of the train records is `k`: the global batch (a batch
    sampler or a batch that drops its last part) or the host count (a sampler that trims the
    epoch to a multiple of its replicas, shards of equal size; tried first with `shards`);
    None when neither is."""
    n = r["coverage"]["train_records"]
    units = [(r["consumption"].get("rows_per_step") or 0, "global batch"),
             (r["hosts"]["count"], "host count")]
    for unit, what in units[::-1] if shards else units:
        if k and unit and n % unit == k:
            return unit, what
    return None


def _unread_said(r: dict[str, Any]) -> str:
    """"; domain code was not read at all" where some domain was not, else ""."""
    domains = _unread_domains(r)
    return (f"; {_domains_text(domains)} {'was' if len(domains) == 1 else 'were'} not read "
            "at all" if domains else "")


def _drop_remainder(r: dict[str, Any], add: Callable[..., Any]) -> bool:
    """Every epoch the run finished left out the same k records' worth, k being the train
    records' remainder by the global batch or by the host count, and nothing repeated within
    an epoch: a loader that drops each epoch's remainder (WARN). Over several epochs the
    records dropped twice or more fall below the ideal: that is this, not uneven exposure.
    After two epochs or more, the run's never-seen records tell which records it drops: the
    same k each time (equal shards, the remainder never in any) or others each epoch."""
    cov = r["coverage"]
    done = [e for e in r.get("epochs", []) if e["complete"] and e["skipped"]]
    k = done[0]["skipped"] if done else 0
    same = len(done) > 1 and cov["never_seen"] == k
    unit = _remainder_unit(r, k, shards=same)
    if _duplicates(r) or unit is None or any(e["skipped"] != k for e in done):
        return False
    n = cov["train_records"]
    which = ("drop_last samplers, batch drop_remainder, equal shards" if len(done) == 1 else
             "equal shards, as ShardOptions(drop_remainder=True) makes; the same "
             f"{plural(k, 'record')} every epoch, never trained on" if same else
             "drop_last samplers, batch drop_remainder; different records each epoch")
    add("WARN", "drop_remainder",
        ("the finished epoch" if len(done) == 1 else f"each of {len(done):,} finished epochs")
        + f" left out {plural(k, 'record')}: {n:,} train records do not divide by the "
        f"{unit[1]} of {unit[0]}, and the loader drops each epoch's remainder ({which})",
        epochs=len(done), records=k, same_records=same)
    return True


def _epoch_findings(r: dict[str, Any], add: Callable[..., Any], explained: bool) -> None:
    """Records an epoch never reached. In an epoch the run has left behind, a loader that drops
    each epoch's remainder leaves exactly N mod (global batch or host count) out
    (`_drop_remainder`); other counts are skipped records. The last epoch of a finished run
    may end early by design: said, not flagged."""
    n = r["coverage"]["train_records"]
    done = [e for e in r.get("epochs", []) if e["complete"] and e["skipped"]]
    if done and not explained and not _drop_remainder(r, add):
        skipped = sum(e["skipped"] for e in done)
        add("FAIL", "epoch_skipped",
            f"{plural(skipped, 'record')} {were(skipped)} never consumed in "
            f"{'the epoch' if len(done) == 1 else 'epochs'} the run has finished ("
            + ", ".join(f"epoch {e['epoch']}: {e['skipped']:,}" for e in done[:5])
            + "): the loader skipped them" + _unread_said(r), records=skipped,
            epochs=[e["epoch"] for e in done])
    for e in r.get("epochs", []):
        if e["final"] and not e["complete"] and e["skipped"]:
            unit = _remainder_unit(r, e["skipped"])
            why = (f": {n:,} train records do not divide by the {unit[1]} of {unit[0]}, and "
                   "the run ended with the last full batch" if unit else "")
            add("INFO", "final_epoch_short",
                f"the run finished in epoch {e['epoch']} with {e['skipped']:,} of its records "
                f"never consumed{why}{_unread_said(r)}", epoch=e["epoch"], records=e["skipped"])
