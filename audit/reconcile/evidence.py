"""What each finding points at: the steps, hosts and records that show it, a few of each, each
with the live API's path that shows it (`/v1/runs/{run}/steps?start=&end=`,
`/v1/runs/{run}/hosts/{h}/steps`, `/v1/runs/{run}/records/{key}`) and, for a report read with no
service at hand, the anchor of its row in report.html's Evidence tables (`anchor`).

Everything here reads what the job already computed: the steps table's per-step repeats, the
per-host counts, and the records the buckets kept as examples (the most repeated train records
with where they were seen, never-seen ones, unknown keys, hash mismatches, held-out records
consumed; tally.audit.reconcile.bucket_stats). No finding's message or numbers change.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any
from urllib.parse import quote

import numpy as np

from tally.audit.buckets.partials import EVIDENCE
from tally.audit.core.exposure import Finding

# Findings about records exposed more often than due: their evidence is where the repeats are.
REPEATS = {"with_replacement", "no_sharding", "shared_shard", "worker_copies", "padding",
           "epoch_duplicates",
           "uneven_exposure", "loss_flattered", "repeats_on_hosts", "repeats_in_steps",
           "reshard_band", "resharded", "batch_changed", "resume_band"}
# ... and about records never consumed.
SKIPS = {"with_replacement", "shared_shard", "uneven_exposure", "reshard_band", "resume_band",
         "epoch_skipped", "drop_remainder", "final_epoch_short", "files_unread", "domain_unread",
         "host_gap"}
# Integrity findings and the report's examples that show them.
EXAMPLES = {"unknown_keys": "unknown", "hash_mismatch": "hash_mismatch",
            "heldout_leak": "heldout"}

Items = list[dict[str, Any]]
_HOST_STEPS = re.compile(r"/hosts/(\d+)/steps")


def anchor(item: dict[str, Any]) -> str:
    """The id of an evidence item's row in report.html's Evidence tables: `ev-record-K`,
    `ev-steps-A[-B]` (`ev-host-H-steps-A[-B]` for one host's steps) or `ev-host-H`; one row per
    target, however many findings name it."""
    return "ev-" + _target(item)


def _target(item: dict[str, Any]) -> str:
    if "record_key" in item:
        return f"record-{item['record_key']}"
    if "step" in item:
        span = f"steps-{item['step']}" + (f"-{item['last_step']}" if "last_step" in item else "")
        host = step_host(item)
        return span if host is None else f"host-{host}-{span}"
    return f"host-{item['host']}"


def step_host(item: dict[str, Any]) -> int | None:
    """The host whose steps a step item names (its API path is that host's series), or None
    for all hosts' steps."""
    m = _HOST_STEPS.search(item.get("api", ""))
    return None if m is None else int(m.group(1))


def attach(found: list[Finding], r: dict[str, Any], steps: Any) -> list[Finding]:
    """The findings, each with its evidence (None where there is nothing to point at)."""
    ev = _Evidence(r, steps)
    return [dataclasses.replace(f, evidence=ev.of(f)) for f in found]


class _Evidence:
    def __init__(self, r: dict[str, Any], steps: Any) -> None:
        self.r = r
        self.base = f"/v1/runs/{quote(r['run_id'], safe='')}"
        if steps is None or not steps.num_rows:
            self.step = self.repeats = self.all_repeats = np.zeros(0, np.int64)
        else:
            self.step = steps["step"].to_numpy()
            self.repeats = steps["epoch_repeats"].to_numpy()
            self.all_repeats = steps["repeats"].to_numpy()

    def of(self, f: Finding) -> dict[str, Items] | None:
        n, code = f.numbers, f.code
        out: dict[str, Items] = {"steps": [], "hosts": [], "records": []}
        if code in REPEATS:
            lo, hi = None, None
            if code == "repeats_in_steps":
                lo, hi = n["first_step"], n["last_step"]
            elif code in ("reshard_band", "resharded", "batch_changed", "resume_band"):
                lo = n.get("step")
            out["steps"] = self.top_steps(lo, hi)
            named = n.get("hosts") if code == "repeats_on_hosts" else None
            out["hosts"] = self.top_hosts(named)
            out["records"] = self.most_repeated()
        if code in SKIPS:
            out["records"] += self.never_seen()
        if code in ("repeated_batches", "host_gap") and "host" in n:
            h = n["host"]
            ranges = (n["ranges"] if code == "repeated_batches"
                      else [[n["first_step"], n["last_step"]]])
            out["hosts"] = [self.host(h)]
            out["steps"] = [self.step_range(a, b, host=h) for a, b in ranges[:EVIDENCE]]
        elif code == "host_gap":  # hosts that consumed nothing at all: the first few
            out["hosts"] = [self.host(h) for h in n["examples"][:EVIDENCE]]
            out["steps"] = [self.step_range(n["first_step"], n["last_step"])]
        if code == "replay_inexact" and n.get("step") is not None:
            out["steps"] = [self.step_range(n["step"], n["step"])]
        if code == "non_finite_loss":
            out["steps"] = [self.step_range(n["first_step"], n["first_step"])]
        if code in EXAMPLES:
            self.from_examples(self.r.get("examples", {}).get(EXAMPLES[code], []), out)
        out = {k: v for k, v in out.items() if v}
        return out or None

    def step_range(self, a: int, b: int, host: int | None = None, **numbers: Any
                   ) -> dict[str, Any]:
        """Steps a..b; with a host, that host's series from the step before to the step after
        (a gap or a repeat shows against its neighbours)."""
        item: dict[str, Any] = {"step": int(a), **({} if a == b else {"last_step": int(b)}),
                                **numbers}
        if host is None:
            item["api"] = f"{self.base}/steps?start={a}&end={b}&bucket=1"
        else:
            item["api"] = (f"{self.base}/hosts/{host}/steps?start={max(0, a - 1)}"
                           f"&end={b + 1}&bucket=1")
        return item

    def top_steps(self, lo: int | None = None, hi: int | None = None) -> Items:
        """The steps with the most within-epoch repeats (lo..hi when given); where epochs are
        unknown, the most repeats of records seen before, from the first bad step on."""
        values = self.repeats
        keep = np.ones(len(self.step), bool)
        if not values.any():
            values = self.all_repeats
            first_bad = self.r.get("first_bad_step")
            keep &= self.step >= (first_bad if first_bad is not None else np.iinfo(np.int64).max)
        if lo is not None:
            keep &= self.step >= lo
        if hi is not None:
            keep &= self.step <= hi
        at = np.flatnonzero(keep & (values > 0))
        at = at[np.lexsort((self.step[at], -values[at]))][:EVIDENCE]
        return [self.step_range(int(self.step[i]), int(self.step[i]), repeats=int(values[i]))
                for i in at]

    def host(self, h: int, **numbers: Any) -> dict[str, Any]:
        return {"host": int(h), **numbers, "api": f"{self.base}/hosts/{h}/steps"}

    def top_hosts(self, named: list[int] | None = None) -> Items:
        """The hosts with the most within-epoch repeats (only the `named` ones when given)."""
        per = [p for p in self.r["hosts"]["per_host"]
               if (p["host"] in named if named is not None else p.get("epoch_repeats"))]
        per.sort(key=lambda p: (-p.get("epoch_repeats", 0), p["host"]))
        return [self.host(p["host"], repeats=p.get("epoch_repeats", 0),
                          repeated_records=p.get("epoch_duplicated_records", 0))
                for p in per[:EVIDENCE]]

    def record(self, key: int, **numbers: Any) -> dict[str, Any]:
        return {"record_key": int(key), **numbers, "api": f"{self.base}/records/{key}"}

    def most_repeated(self) -> Items:
        return [self.record(x["record_key"], **{k: v for k, v in x.items() if k != "record_key"})
                for x in self.r.get("examples", {}).get("most_repeated", [])]

    def never_seen(self) -> Items:
        return [self.record(k, exposures=0)
                for k in self.r.get("examples", {}).get("never_seen", [])]

    def from_examples(self, rows: list[dict[str, int]], out: dict[str, Items]) -> None:
        """Rows (record_key, step, host) -> a few records with where each was seen, and the
        steps and hosts they name most."""
        by_key: dict[int, list[dict[str, int]]] = {}
        for x in rows:
            by_key.setdefault(x["record_key"], []).append({"step": x["step"], "host": x["host"]})
        out["records"] = [self.record(k, seen=v) for k, v in list(by_key.items())[:EVIDENCE]]
        for what, make in (("step", lambda s, c: self.step_range(s, s, examples=c)),
                           ("host", lambda h, c: self.host(h, examples=c))):
            counts: dict[int, int] = {}
            for x in rows:
                counts[x[what]] = counts.get(x[what], 0) + 1
            best = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:EVIDENCE]
            out[f"{what}s"] = [make(k, c) for k, c in best]
