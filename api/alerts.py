"""Alerts: thresholds over the live numbers, a status per run, and an optional webhook that is
told when an alert starts or stops firing."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import socket
import threading
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from tally.audit.core.errors import TallyError

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
             non_finite_losses: int = 0, findings: dict[str, Any] | None = None,
             catching_up: bool = False, at_ingest: dict[str, Any] | None = None
             ) -> list[dict[str, Any]]:
    """Every configured alert with its value and whether it fires. `catching_up`: the service
    is still ingesting the backlog it found at start, whose wait is not lag (no ingest_lag).
    `at_ingest`: the run's integrity checked at ingest (tally.audit.ledger.integrity.totals);
    the integrity alerts take its numbers, newer than the live reconcile's, when it checked
    the run."""
    checks = [
        ("epoch_duplicates", epoch_duplicates, th.epoch_duplicates,
         "exposures of a record beyond its first within one epoch"),
        ("host_overlap", multi_host_records if first_pass else 0, th.host_overlap,
         "records seen by two or more hosts during the first pass over the corpus"),
        ("ingest_lag", lag_seconds, th.ingest_lag_seconds,
         "catching up: ingesting the files found at start (not an alert meanwhile)"
         if catching_up else
         "seconds since the service first saw the oldest spool file still waiting for ingest"),
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
    checked = at_ingest is not None and at_ingest["skipped"] is None and \
        at_ingest["files_checked"] > 0
    if checked or (findings is not None and findings["verdict"] is not None):
        # Integrity against the manifest: as checked at ingest (the rows ingested so far), or
        # with reconcile's own numbers (the same job, as of its step).
        integ = at_ingest if checked else findings["integrity"]
        when = "as ingested" if checked else f"step {findings['as_of_step']}"
        checks += [
            ("hash_mismatch", integ["hash_mismatches"], 0,
             f"consumed records whose content hash differs from the manifest's ({when})"),
            ("unknown_keys", integ["unknown_keys"], 0,
             f"consumed record keys the manifest does not hold ({when})"),
            ("heldout_leak", integ["heldout_consumed_records"], 0,
             f"held-out records trained on ({when})"),
        ]
    # A run that weights its domains is off the split's ideal by design: the alerts measured
    # against it defer to the live reconcile, which measures each domain against its own
    # (its FAILs fire the `findings` alert).
    weighted = findings is not None and any(f["code"] == "domain_weighted"
                                            for f in findings["findings"])
    if weighted:
        checks = [(name, value, limit, what + (
            "; not alerted: the run weights its domains (the live reconcile as of step "
            f"{findings['as_of_step']} measures each against its own ideal)"
            if name in _SPLIT_IDEAL else "")) for name, value, limit, what in checks]
    return [{"name": name, "value": value, "threshold": limit,
             "firing": value is not None and value > limit
             and not (catching_up and name == "ingest_lag")
             and not (weighted and name in _SPLIT_IDEAL), "what": what}
            for name, value, limit, what in checks if limit is not None]


# Alerts measured against the whole train split's ideal (one pass, each record once an epoch).
_SPLIT_IDEAL = ("epoch_duplicates", "host_overlap", "coverage_behind_ideal")


def status(alerts: list[dict[str, Any]]) -> str:
    return "alert" if any(a["firing"] for a in alerts) else "ok"


def check_webhook(url: str | None) -> None:
    """An alert receiver is an http:// or https:// URL with a host; anything else is refused
    at start (TallyError). urllib took `file:///...` as delivered, and a URL it could not parse
    killed the sender thread at the first alert while /healthz said ok."""
    if url is None:
        return
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError as exc:
        raise TallyError(f"--webhook {url!r} is not a URL: {exc}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise TallyError(f"--webhook {url!r} is not an http:// or https:// URL with a host")


def _log_changes(run_id: str, alerts: list[dict[str, Any]], started: frozenset[str],
                 stopped: frozenset[str]) -> None:
    """One log line for each alert that starts or stops firing (webhook or not): what an
    operator reading the service's log needs, with the number and its threshold."""
    for a in alerts:
        if a["name"] in started or a["name"] in stopped:
            on = a["name"] in started
            log.log(logging.WARNING if on else logging.INFO,
                    "run %s: alert %s %s (value %s, threshold %s)", run_id, a["name"],
                    "started firing" if on else "stopped firing", a.get("value"),
                    a.get("threshold"),
                    extra={"run": run_id, "alert": a["name"], "value": a.get("value"),
                           "threshold": a.get("threshold"),
                           "event": "alert_started" if on else "alert_stopped"})
    for name in sorted(stopped - {a["name"] for a in alerts}):  # turned off or gone
        log.info("run %s: alert %s stopped firing", run_id, name,
                 extra={"run": run_id, "alert": name, "event": "alert_stopped"})


class Webhook:
    """POSTs a JSON body to `url` when a run's set of firing alerts changes, from a thread of
    its own: the ingest thread only records the change. A body that fails is tried again with
    backoff (`first_retry` seconds, doubling up to `max_retry`) until the receiver takes one:
    each try tells the change since the last delivered state, so a firing alert whose send
    failed is sent again, and changes made meanwhile are folded into the next try.

    Delivered means a 2xx answer from `url` itself: a redirect is never followed (a 3xx is a
    failure, retried; following one posted the alert to another URL, or fetched it, and counted
    it sent), and each POST has `timeout` seconds in all, however slowly the receiver answers
    (a socket timeout bounds each read only: a byte every 3 s held the sender for minutes)."""

    def __init__(self, url: str | None, timeout: float = 5.0, first_retry: float = 1.0,
                 max_retry: float = 60.0) -> None:
        check_webhook(url)
        self.url, self.timeout = url, timeout
        self.first_retry, self.max_retry = first_retry, max_retry
        self._firing: dict[str, frozenset[str]] = {}  # run -> firing now
        self._alerts: dict[str, list[dict[str, Any]]] = {}  # run -> the alerts, newest
        self._told: dict[str, frozenset[str]] = {}  # run -> firing as last delivered
        self._changed = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.failures = 0
        self.error: str | None = None  # why the sender thread died, if it did

    @property
    def pending(self) -> int:
        """Runs whose latest change is not delivered yet."""
        with self._changed:
            return sum(self._firing[r] != self._told.get(r, frozenset())
                       for r in self._firing) if self.url else 0

    @property
    def alive(self) -> bool:
        """False once the sender thread has died (no alert would be delivered again)."""
        return self._thread is None or self._thread.is_alive() or self._stop

    def update(self, run_id: str, alerts: list[dict[str, Any]]) -> None:
        now = frozenset(a["name"] for a in alerts if a["firing"])
        with self._changed:
            before = self._firing.get(run_id, frozenset())
            moved = now != before
            if moved:
                _log_changes(run_id, alerts, now - before, before - now)
            self._firing[run_id], self._alerts[run_id] = now, alerts
            # Wake the sender only for a change: an undelivered state waits out its backoff.
            if self.url is None or not moved or now == self._told.get(run_id, frozenset()):
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tally-webhook",
                                                daemon=True)
                self._thread.start()
            self._changed.notify()

    def close(self, timeout: float = 5.0) -> None:
        with self._changed:
            self._stop = True
            self._changed.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._deliver()
        except BaseException as exc:  # said in /healthz (degraded), never silently
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("alert webhook sender stopped; no alert will be delivered")

    def _deliver(self) -> None:
        delay = self.first_retry
        while True:
            with self._changed:
                due = [r for r in self._firing if self._firing[r] != self._told.get(r, frozenset())]
                if self._stop:
                    return
                if not due:
                    self._changed.wait()
                    continue
                bodies = [(r, self._firing[r], self._body(r)) for r in due]
            failed = False
            for run_id, firing, body in bodies:
                if self._post(body):
                    with self._changed:
                        self._told[run_id] = firing
                else:
                    failed = True
            if not failed:
                delay = self.first_retry
                continue
            with self._changed:  # back off; a stop or a newer change is taken on waking
                if not self._stop:
                    self._changed.wait(delay)
            delay = min(self.max_retry, delay * 2)

    def _body(self, run_id: str) -> dict[str, Any]:
        now, before = self._firing[run_id], self._told.get(run_id, frozenset())
        return {"run_id": run_id, "status": "alert" if now else "ok",
                "started": sorted(now - before), "resolved": sorted(before - now),
                "alerts": self._alerts[run_id]}

    def _post(self, body: dict[str, Any]) -> bool:
        try:
            status = self._send(json.dumps(body, default=str).encode())
            if not 200 <= status < 300:  # a 3xx too: never followed
                raise OSError(f"answered HTTP {status}")
            self.sent += 1
            return True
        except Exception as exc:  # a receiver down must not stop the service: logged, retried
            self.failures += 1
            log.warning("alert webhook %s failed (will retry): %s", self.url, exc)
            return False

    def _connection(self) -> tuple[http.client.HTTPConnection, str, dict[str, str]]:
        """A connection for a POST to `url`, the request's target and its extra headers:
        straight to the receiver, or through the proxy the environment names for it
        (HTTP_PROXY, HTTPS_PROXY, NO_PROXY, as urllib took them)."""
        assert self.url is not None
        parts = urllib.parse.urlsplit(self.url)
        scheme = parts.scheme.lower()
        https = scheme == "https"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        where = parts.netloc.rpartition("@")[2]
        proxy = urllib.request.getproxies().get(scheme)
        if not proxy or urllib.request.proxy_bypass(where):
            kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
            return kind(parts.hostname, parts.port, timeout=self.timeout), target, {}
        via = urllib.parse.urlsplit(proxy if "//" in proxy else f"http://{proxy}")
        auth = {}
        if via.username is not None:
            who = f"{urllib.parse.unquote(via.username)}:{urllib.parse.unquote(via.password or '')}"
            auth = {"Proxy-Authorization": "Basic " + base64.b64encode(who.encode()).decode()}
        if https:  # a CONNECT tunnel through the proxy, TLS to the receiver inside it
            conn = http.client.HTTPSConnection(via.hostname, via.port or 80,
                                               timeout=self.timeout)
            conn.set_tunnel(parts.hostname, parts.port, headers=auth)
            return conn, target, {}
        conn = http.client.HTTPConnection(via.hostname, via.port or 80, timeout=self.timeout)
        return conn, urllib.parse.urlunsplit(parts._replace(fragment="")), auth

    def _send(self, data: bytes) -> int:
        """One POST of `data`, within `timeout` seconds in all; the answer's status."""
        conn, target, headers = self._connection()
        expired = threading.Event()

        def cut() -> None:  # the deadline: a blocked read or handshake returns at once
            expired.set()
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):  # closed meanwhile
                    sock.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(self.timeout, cut)
        timer.daemon = True
        timer.start()
        try:
            conn.connect()  # itself bounded by the socket timeout, before a socket exists
            if expired.is_set():
                raise TimeoutError(f"no answer within {self.timeout:g} s")
            conn.request("POST", target, body=data,
                         headers={"Content-Type": "application/json", **headers})
            resp = conn.getresponse()
            resp.read(65536)  # the receiver's answer is not used: read a little, then close
            if expired.is_set():  # cut at the deadline: http.client may take a cut head
                raise TimeoutError(f"no complete answer within {self.timeout:g} s")
            return resp.status
        except (OSError, http.client.HTTPException) as exc:
            if expired.is_set():
                raise TimeoutError(f"no complete answer within {self.timeout:g} s") from exc
            raise
        finally:
            timer.cancel()
            conn.close()
