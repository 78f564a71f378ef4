"""`/metrics`: the service's numbers for Prometheus, through prometheus_client.

A custom collector reads the live answers at scrape time (prometheus_client's pattern for
numbers kept elsewhere), so nothing is updated twice. Counts that only grow are counters (their
names end `_total`); numbers that can go down (a resumed attempt rolls steps back) are gauges;
shares are named `_ratio`; `tally_build_info` says which Tally answers.

The per-host series are most of a scrape (640 of 693 lines at 128 hosts, 12 ms of a scrape's
13 ms on this box) and change only with the ledger's version: they are a second registry, whose
encoding is kept until the answers it was made from change (`Exposition`). At thousands of
hosts they would be most of Prometheus' series too: `tally serve --metrics-hosts N` keeps those
of the N hosts of each run with the most repeats (0: none).

Also the process' own series (prometheus_client's ProcessCollector: CPU, memory, open files)
and the latency of each request, per route template (`RequestTimer`), so that a scrape names a
bounded set of routes whatever paths clients ask for."""

from __future__ import annotations

import functools
import platform
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import Histogram, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry

from tally.audit.extras import version

OPENMETRICS_EOF = b"# EOF\n"
# Request latency buckets, seconds: answers from the cache take a millisecond, a scan a second,
# a pre-flight check up to its time box (120 s).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 120.0)
UNROUTED = "unrouted"  # the route label of a request no route took (unknown path, 401, 413)

INTEGRITY = ("hash_mismatches", "unknown_keys", "unknown_segments", "heldout_consumed_records",
             "heldout_exposures")


class TallyCollector(Collector):
    def __init__(self, svc: Any) -> None:
        self.svc = svc

    def collect(self) -> Iterator[Metric]:
        svc = self.svc
        yield InfoMetricFamily("tally_build", "The Tally that serves these numbers",
                               value=_build())
        yield GaugeMetricFamily("tally_ingest_lag_seconds",
                                "Age of the oldest spool file waiting for ingest",
                                value=svc.loop.lag_seconds() if svc.loop is not None else 0.0)
        if svc.loop is not None:
            yield CounterMetricFamily("tally_ingest_rounds", "Ingest rounds of this process",
                                      value=svc.loop.rounds)
            yield CounterMetricFamily("tally_quarantined_files",
                                      "Files quarantined by this process",
                                      value=svc.loop.quarantined)
        if svc.webhook.url is not None:
            yield CounterMetricFamily("tally_webhook_sent", "Alert bodies the webhook took",
                                      value=svc.webhook.sent)
            yield CounterMetricFamily("tally_webhook_failures",
                                      "Failed webhook tries (each is retried)",
                                      value=svc.webhook.failures)
        yield from self._runs()

    def _runs(self) -> Iterator[Metric]:
        svc = self.svc
        run = ["run"]
        m = {
            "coverage": GaugeMetricFamily("tally_coverage_ratio",
                                          "Share of train records seen at least once",
                                          labels=run),
            "ideal": GaugeMetricFamily("tally_ideal_coverage_ratio",
                                       "Coverage a perfect loader would have now", labels=run),
            "exposures": GaugeMetricFamily("tally_exposures", "Effective record exposures",
                                           labels=run),
            "seen": GaugeMetricFamily("tally_records_seen", "Distinct records seen", labels=run),
            "repeat": GaugeMetricFamily(
                "tally_repeat_ratio", "Share of exposures that repeat a record already seen",
                labels=run),
            "dup_ratio": GaugeMetricFamily(
                "tally_epoch_duplicate_ratio",
                "Share of exposures that repeat a record within one epoch", labels=run),
            "dups": GaugeMetricFamily("tally_epoch_duplicates",
                                      "Exposures beyond the first of a record in one epoch",
                                      labels=run),
            "multi": GaugeMetricFamily("tally_multi_host_records",
                                       "Records seen by two or more hosts", labels=run),
            "rows": CounterMetricFamily("tally_rows_ingested", "Segment rows in the ledger",
                                        labels=run),
            "last": GaugeMetricFamily("tally_last_step", "Latest effective step", labels=run),
            "alert": GaugeMetricFamily("tally_alert", "1 when the alert fires",
                                       labels=["run", "alert"]),
            "integrity": GaugeMetricFamily(
                "tally_integrity", "Integrity against the manifest, as the live reconcile "
                "found it", labels=["run", "kind"]),
            "at_ingest": GaugeMetricFamily(
                "tally_integrity_at_ingest", "Integrity against the manifest, checked as the "
                "run's files were ingested", labels=["run", "kind"]),
        }

        def add(key: str, labels: list[str], value: float | None) -> None:
            if value is not None:
                m[key].add_metric(labels, value)

        for run_id in svc.live.run_ids():
            s = svc.summary(run_id)
            c, ex = s["coverage"], max(1, s["exposures"])
            add("coverage", [run_id], c["coverage"])
            add("ideal", [run_id], (c.get("ideal") or {}).get("coverage"))
            add("exposures", [run_id], c["exposures"])
            add("seen", [run_id], s["records_seen"])
            add("repeat", [run_id], (s["exposures"] - s["records_seen"]) / ex)
            add("dup_ratio", [run_id], s["epoch_duplicates"] / ex)
            add("dups", [run_id], s["epoch_duplicates"])
            add("multi", [run_id], s["multi_host_records"])
            add("rows", [run_id], s["rows_ingested"])
            add("last", [run_id], s["last_step"])
            for a in s["alerts"]:
                add("alert", [run_id, a["name"]], int(a["firing"]))
            integ = (s.get("findings") or {}).get("integrity")
            for kind in INTEGRITY if integ else ():
                add("integrity", [run_id, kind], integ[kind])
            checked = s.get("integrity_at_ingest")
            for kind in INTEGRITY if checked and checked["skipped"] is None else ():
                add("at_ingest", [run_id, kind], checked[kind])
        yield from (family for family in m.values() if family.samples)


class HostCollector(Collector):
    """The per-host series of every run, from the answers given (`Exposition` sets them): of
    every host, or of the `top` hosts of each run with the most repeats (exposures beyond the
    distinct records the host saw)."""

    def __init__(self, top: int | None = None) -> None:
        self.answers: tuple = ()  # (run id, its hosts answer, its rows per host) for each run
        self.top = top

    def collect(self) -> Iterator[Metric]:
        host = ["run", "host"]
        m = {
            "rows": CounterMetricFamily("tally_host_rows_ingested",
                                        "Segment rows in the ledger, per host", labels=host),
            "exp": GaugeMetricFamily("tally_host_exposures", "Effective exposures per host",
                                     labels=host),
            "unique": GaugeMetricFamily("tally_host_unique_records",
                                        "Distinct records per host", labels=host),
            "shared": GaugeMetricFamily("tally_host_shared_records",
                                        "Records a host saw that another host saw too",
                                        labels=host),
            "last": GaugeMetricFamily("tally_host_last_step",
                                      "Latest effective step per host", labels=host),
        }
        for run_id, hs, host_rows in self.answers:
            for h in self.chosen(hs["per_host"]):
                lab = [run_id, str(h["host"])]
                m["rows"].add_metric(lab, host_rows.get(h["host"], 0))
                for key, name in (("exp", "exposures"), ("unique", "unique"),
                                  ("shared", "overlap_with_others"), ("last", "last_step")):
                    if h[name] is not None:
                        m[key].add_metric(lab, h[name])
        yield from (family for family in m.values() if family.samples)

    def chosen(self, per_host: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The hosts whose series are exported, ascending."""
        if self.top is None or len(per_host) <= self.top:
            return per_host
        ranked = sorted(per_host, key=lambda h: (-(h["exposures"] - h["unique"]), h["host"]))
        return sorted(ranked[:self.top], key=lambda h: h["host"])


class RequestTimer:
    """Each request's latency into `histogram` (labels method, route, status): the route is the
    template that answered (`/v1/runs/{run_id}`), else UNROUTED. A plain ASGI middleware, as
    tally.api.app's others; inside errors' catch-all, so a request that failed counts as a 500."""

    def __init__(self, app: Any, histogram: Histogram) -> None:
        self.app, self.histogram = app, histogram

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        began = time.perf_counter()
        status = 500

        async def watched(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            # The router sets the route in the scope it was given, which is this one.
            route = getattr(scope.get("route"), "path", None) or UNROUTED
            self.histogram.labels(scope["method"], route, str(status)).observe(
                time.perf_counter() - began)


class Exposition:
    """The scrape: the service's and each run's series encoded now, then the per-host series,
    encoded again only when the answers they come from are other objects (cached answers are
    the same object for as long as the ledger's version holds)."""

    def __init__(self, svc: Any, hosts: int | None = None) -> None:
        self.svc = svc
        self.live = CollectorRegistry(auto_describe=False)
        self.live.register(TallyCollector(svc))
        ProcessCollector(registry=self.live)
        self.latency = Histogram(
            "tally_http_request_duration_seconds", "Time to answer a request, per route",
            ["method", "route", "status"], buckets=LATENCY_BUCKETS, registry=self.live)
        self.hosts = HostCollector(hosts)
        self.host_registry = CollectorRegistry(auto_describe=False)
        self.host_registry.register(self.hosts)
        self._encoded: dict[str, tuple[tuple, bytes]] = {}  # content type -> (answers, body)
        self._lock = threading.Lock()  # one encoding of the per-host series at a time

    def __call__(self, accept: str | None) -> tuple[bytes, str]:
        """The scrape body and its content type: OpenMetrics when the scraper asks for it (as
        Prometheus does), else the text format."""
        encode, content_type = choose_encoder(accept or "")
        live = self.svc.live
        answers = tuple((run_id, live.hosts(run_id), live.host_rows(run_id))
                        for run_id in live.run_ids())
        head = encode(self.live)
        with self._lock:
            kept = self._encoded.get(content_type)
            if kept is not None and _same(kept[0], answers):
                tail = kept[1]
            else:
                self.hosts.answers = answers
                tail = encode(self.host_registry)
                self._encoded[content_type] = (answers, tail)
        if head.endswith(OPENMETRICS_EOF) and tail.endswith(OPENMETRICS_EOF):
            head = head[:-len(OPENMETRICS_EOF)]  # one EOF, at the end
        return head + tail, content_type


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] is y[1] and x[2] is y[2] for x, y in zip(a, b, strict=True))


@functools.cache
def _build() -> dict[str, str]:
    return {"version": version(), "python": platform.python_version()}
