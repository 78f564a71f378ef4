"""Alerts: thresholds over the live numbers, a status per run, and an optional webhook that is
told when an alert starts or stops firing."""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("tally.api")


@dataclass(frozen=True)
class Thresholds:
    """An alert fires when its number goes above the threshold; None turns it off."""

    epoch_duplicates: int | None = 0  # exposures beyond the first of a record within one epoch
    host_overlap: int | None = 0  # records seen by 2+ hosts, while in the first pass (C <= N)
    ingest_lag_seconds: float | None = 300.0  # age of the oldest published, not ingested file
    coverage_behind: float | None = 0.02  # ideal coverage minus coverage (needs N)
    non_finite_losses: int | None = 0  # NaN or infinite loss values logged

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def evaluate(th: Thresholds, *, epoch_duplicates: int, multi_host_records: int,
             first_pass: bool, lag_seconds: float, behind: float | None,
             non_finite_losses: int = 0,
             findings: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every configured alert with its value and whether it fires."""
    checks = [
        ("epoch_duplicates", epoch_duplicates, th.epoch_duplicates,
         "exposures of a record beyond its first within one epoch"),
        ("host_overlap", multi_host_records if first_pass else 0, th.host_overlap,
         "records seen by two or more hosts during the first pass over the corpus"),
        ("ingest_lag", lag_seconds, th.ingest_lag_seconds,
         "seconds since the oldest spool file still waiting for ingest was published"),
        ("coverage_behind_ideal", behind, th.coverage_behind,
         "ideal coverage minus actual coverage"),
        ("non_finite_loss", non_finite_losses, th.non_finite_losses,
         "loss values logged as NaN or infinite (the run diverged)"),
    ]
    if findings is not None and findings["verdict"] is not None:
        fails = [f for f in findings["findings"] if f["severity"] == "FAIL"]
        checks.append(("findings", len(fails), 0,
                       "causes reconcile names as of step "
                       f"{findings['as_of_step']}: " + (", ".join(f["code"] for f in fails)
                                                         or "none")))
        # Integrity against the manifest, with reconcile's own numbers (the same job).
        integ, at = findings["integrity"], findings["as_of_step"]
        checks += [
            ("hash_mismatch", integ["hash_mismatches"], 0,
             f"consumed records whose content hash differs from the manifest's (step {at})"),
            ("unknown_keys", integ["unknown_keys"], 0,
             f"consumed record keys the manifest does not hold (step {at})"),
            ("heldout_leak", integ["heldout_consumed_records"], 0,
             f"held-out records trained on (step {at})"),
        ]
    return [{"name": name, "value": value, "threshold": limit,
             "firing": value is not None and value > limit, "what": what}
            for name, value, limit, what in checks if limit is not None]


def status(alerts: list[dict[str, Any]]) -> str:
    return "alert" if any(a["firing"] for a in alerts) else "ok"


class Webhook:
    """POSTs a JSON body to `url` when a run's set of firing alerts changes."""

    def __init__(self, url: str | None, timeout: float = 5.0) -> None:
        self.url, self.timeout = url, timeout
        self._firing: dict[str, frozenset[str]] = {}
        self._lock = threading.Lock()
        self.sent = 0
        self.failures = 0

    def update(self, run_id: str, alerts: list[dict[str, Any]]) -> None:
        now = frozenset(a["name"] for a in alerts if a["firing"])
        with self._lock:
            before = self._firing.get(run_id, frozenset())
            self._firing[run_id] = now
        if self.url is None or now == before:
            return
        body = {"run_id": run_id, "status": "alert" if now else "ok",
                "started": sorted(now - before), "resolved": sorted(before - now),
                "alerts": alerts}
        req = urllib.request.Request(self.url, data=json.dumps(body, default=str).encode(),
                                     headers={"Content-Type": "application/json"},
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                resp.read()
            self.sent += 1
        except Exception as exc:  # a webhook down must not stop ingest; it is logged and counted
            self.failures += 1
            log.warning("alert webhook %s failed: %s", self.url, exc)
