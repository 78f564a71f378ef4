"""Live API latency on a large ledger while ingestion goes on.

Writes a spool of `--rows` consumption rows through the real writer (a healthy loader: each
epoch a fresh permutation of `--records` keys, cut across `--hosts` hosts, `--batch` segments
per host and step), ingests it with `tally.audit.ledger.ingest` (aggregates included), then times
the
reference: the same answers computed by one SQL query each over `effective_consumption`
(coverage, the per-step series, per-host unique records). Then starts `tally serve` on the
ledger in its own process, keeps writing more spool files (about `--live-rows-per-s` rows per
second, ingested by the server as they appear) and times `--requests` sequential requests per
endpoint, then the same from `--clients` client processes at once (each its own order of the
endpoints; record lookups by a random key each). Prints p50 and p99 per endpoint, sequential and
concurrent, and each aggregate-backed endpoint's p50 against its reference.

    python -m bench.api_latency [--rows 50000000] [--records 10000000] [--dir bench/out/api]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq

from tally.audit.hook import spool as sp
from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest

RUN = "bench"
_A = 2_654_435_761  # multiplier of the per-epoch permutation: coprime to the record count


class Loader:
    """Step s of host h: `batch` keys of a pseudo-random permutation of the records, a new one
    each epoch (key = (A * i + B * epoch) mod N, A coprime to N)."""

    def __init__(self, records: int, hosts: int, batch: int) -> None:
        self.n, self.hosts, self.batch = records, hosts, batch
        self.a = _A % records
        while np.gcd(self.a, records) != 1:
            self.a += 1
        self.rng = np.random.default_rng(0)

    def segments(self, step: int, host: int) -> Segments:
        pos = (step * self.hosts + host) * self.batch + np.arange(self.batch, dtype=np.int64)
        epoch, i = np.divmod(pos, self.n)
        keys = (self.a * i + 7_919 * epoch) % self.n
        return Segments.build(row=np.arange(self.batch) % 512, record_key=keys,
                              n_tokens=self.rng.integers(1, 8192, self.batch),
                              content_hash=keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15),
                              epoch=epoch)


def write(spool: Path, loader: Loader, steps: range, flush_every: int,
          pace_rows_per_s: float | None = None, stop: threading.Event | None = None,
          count: dict[str, int] | None = None) -> int:
    """All hosts' rows for `steps`; paced when asked (rows per second, all hosts together).
    `loader`: anything with `hosts` and `segments(step, host)` (bench.seed_scale's packed loader
    too); returns the segments written, and keeps `count["rows"]` at the rows handed to the
    writers so far."""
    writers = [LedgerWriter(spool, RUN, host=h, host_count=loader.hosts, flush_every=flush_every,
                            fsync=False, queue_size=4) for h in range(loader.hosts)]
    rows, t0 = 0, time.perf_counter()
    try:
        for step in steps:
            if stop is not None and stop.is_set():
                break
            for h, w in enumerate(writers):
                segments = loader.segments(step, h)
                w.write_segments(step, segments)
                rows += len(segments)
                if count is not None:
                    count["rows"] = rows
                if step % 10 == 0:
                    w.log_metric(step, "train_loss", 3.0 + 1.0 / (1 + step))
            if count is not None:  # when each step was handed over (a finding's age)
                count.setdefault("step_at", {})[step] = time.time()
            if pace_rows_per_s:
                ahead = rows / pace_rows_per_s - (time.perf_counter() - t0)
                if ahead > 0:
                    time.sleep(ahead)
    finally:
        for w in writers:
            w.close()
    return rows


def references(ledger: Ledger, repeats: int) -> dict[str, float]:
    """Seconds for one SQL query over `effective_consumption` per answer (median)."""
    sql = {
        "coverage": """SELECT count(*), count(DISTINCT record_key) FROM effective_consumption
                       WHERE run = 1 AND "offset" = 0""",
        "steps": """WITH s AS (SELECT * FROM effective_consumption WHERE run = 1),
            f AS (SELECT record_key, min(step) AS step FROM s WHERE "offset" = 0 GROUP BY ALL),
            n AS (SELECT step, count(*) AS new FROM f GROUP BY ALL)
            SELECT step, count(*), sum(n_tokens), any_value(new) FROM s LEFT JOIN n USING (step)
            GROUP BY step ORDER BY step""",
        "hosts": """WITH seen AS (SELECT DISTINCT record_key, host FROM effective_consumption
                    WHERE run = 1 AND "offset" = 0)
            SELECT host, count(*) FROM seen GROUP BY host""",
    }
    out = {}
    cur = ledger.cursor()
    for name, q in sql.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            cur.execute(q).fetchall()
            times.append(time.perf_counter() - t0)
        out[name] = float(np.median(times))
    cur.close()
    return out


_SERVE = """
import sys, uvicorn
from tally.api.app import create_app
from tally.audit.ledger.database import Ledger
ledger, spool, port, records, mem, manifest, every = sys.argv[1:8]
with Ledger(ledger) as led:
    led.con.execute(f"SET memory_limit = '{mem}'")
    app = create_app(led, spool=spool, records=int(records), interval=0.5,
                     **({"manifest": manifest, "findings_every": float(every)} if manifest
                        else {}))
    print("ready", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="warning")
"""


def _build(args: argparse.Namespace, loader: Loader, spool: Path, path: Path
           ) -> tuple[int, int, dict[str, float]]:
    steps = -(-args.rows // (args.hosts * args.batch))
    t0 = time.perf_counter()
    rows = write(spool, loader, range(steps), args.flush_every)
    print(f"spool: {rows:,} rows ({steps} steps x {args.hosts} hosts x {args.batch}) in "
          f"{time.perf_counter() - t0:.1f} s")
    with Ledger(path) as ledger:
        ledger.con.execute(f"SET memory_limit = '{args.memory_limit}'")
        t0 = time.perf_counter()
        res = ingest(spool, ledger)
        ingest_s = time.perf_counter() - t0
        assert not res.quarantined
        assert ledger.query("SELECT count(*) AS n FROM consumption")[0]["n"] == rows
        print(f"ingest with aggregates: {rows:,} rows in {ingest_s:.1f} s "
              f"({rows / ingest_s / 1e6:.2f} M rows/s)")
        ref = references(ledger, args.ref_repeats)
    return rows, steps, ref


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=50_000_000)
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4096, help="segments per host and step")
    ap.add_argument("--flush-every", type=int, default=50)
    ap.add_argument("--live-flush-every", type=int, default=5,
                    help="steps per spool file while timing (small: the server ingests a "
                         "batch every second or two during the requests)")
    ap.add_argument("--requests", type=int, default=200, help="per endpoint (and client)")
    ap.add_argument("--clients", type=int, default=4,
                    help="then the same requests from this many client processes at once "
                         "(1: sequential only)")
    ap.add_argument("--live-rows-per-s", type=float, default=100_000)
    ap.add_argument("--clients-seconds", type=float, default=0.0,
                    help="the clients go on at least this long (the live ingest beside them "
                         "is timed over that window)")
    ap.add_argument("--ref-repeats", type=int, default=3)
    ap.add_argument("--memory-limit", default="6GB", help="DuckDB memory limit")
    ap.add_argument("--dir", default="bench/out/api")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the spool and ledger of an earlier run in --dir (and its "
                         "reference times): only the live part runs again")
    args = ap.parse_args(argv)
    out = Path(args.dir)
    spool, path = out / "spool", out / "ledger.duckdb"
    loader = Loader(args.records, args.hosts, args.batch)
    saved = out / "build.json"
    if args.reuse and saved.exists():
        built = json.loads(saved.read_text())
        rows, ref = built["rows"], built["ref"]
        steps = 1 + max(int(pq.read_schema(f.path).metadata[b"tally.last_step"])
                        for f, _ in sp.scan(spool) if getattr(f, "kind", None) == "seg")
        print(f"reusing {out}: {rows:,} rows built, spool up to step {steps - 1}")
    else:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        rows, steps, ref = _build(args, loader, spool, path)
        saved.write_text(json.dumps({"rows": rows, "ref": ref}))
    print("reference (one SQL query over effective_consumption): "
          + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in ref.items()))

    res = serve_and_time(path, spool, loader, steps, ref, records=args.records,
                         requests=args.requests, clients=args.clients,
                         live_rows_per_s=args.live_rows_per_s,
                         live_flush_every=args.live_flush_every,
                         min_seconds=args.clients_seconds,
                         memory_limit=args.memory_limit)
    return {"rows": rows, **res}


def serve_and_time(path: Path, spool: Path, loader: Loader, steps: int, ref: dict[str, float],
                   *, records: int, requests: int, clients: int, live_rows_per_s: float,
                   live_flush_every: int, memory_limit: str, min_seconds: float = 0.0,
                   manifest: Path | None = None, findings_every: float = 10.0) -> dict:
    """Start the service on the ledger at `path` in its own process, keep writing spool files
    from step `steps` on (about `live_rows_per_s` rows a second), time `requests` requests per
    endpoint sequentially, then from `clients` processes at once; print p50 and p99 per
    endpoint against the references (`ref`: seconds per scan, from `references`). The clients
    go on for `min_seconds` at least; the writer's and the service's ingest rates are timed
    over their window (the service's from its /healthz row count). With a `manifest`, the
    service keeps live findings (a live reconcile every `findings_every` seconds): the window
    opens once they are as of a step the writer wrote, and the findings' age is sampled each
    second through it (now minus when the step they are as of was handed to the writers),
    with the live reconcile's rounds and CPU seconds."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    t0 = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-c", _SERVE, str(path), str(spool), str(port),
                               str(records), memory_limit, str(manifest or ""),
                               str(findings_every)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said: list[str] = []  # read as it comes: a full pipe would block the server's next line
    reader = threading.Thread(target=lambda: said.extend(server.stdout), daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    live = {"rows": 0}
    writer = None
    try:
        client = httpx.Client(base_url=base, timeout=60)
        while True:
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                if server.poll() is not None:
                    reader.join(60)
                    raise RuntimeError("".join(said)) from None
                time.sleep(0.2)
        start_s = time.perf_counter() - t0
        print(f"server up in {start_s:.1f} s")
        def keep_writing() -> None:
            try:
                live["rows"] = write(spool, loader, range(steps, 10**9), live_flush_every,
                                     live_rows_per_s, stop, count=live)
            except BaseException as exc:  # raised below: timings without a writer are void
                live["error"] = exc

        writer = threading.Thread(target=keep_writing)
        writer.start()
        last = steps - 1
        endpoints = {
            "summary": f"/v1/runs/{RUN}",
            "coverage": f"/v1/runs/{RUN}/coverage",
            "coverage_at_step": f"/v1/runs/{RUN}/coverage?step={last // 2}",
            "steps_full_range": f"/v1/runs/{RUN}/steps?points=500",
            "steps_range_bucketed": f"/v1/runs/{RUN}/steps?start={last // 4}&end={last // 2}"
                                    "&bucket=10",
            "hosts": f"/v1/runs/{RUN}/hosts",
            "host_steps": f"/v1/runs/{RUN}/hosts/{loader.hosts - 1}/steps?points=500",
            "metrics": f"/v1/runs/{RUN}/metrics",
            "prometheus": "/metrics",
            "record_by_key": f"/v1/runs/{RUN}/records/{records // 3}",
        }
        # Record lookups ask for a different key each time (a repeated key would time the
        # service's answer cache, not the lookup index).
        keys = np.random.default_rng(1).integers(0, records, 100_000)
        record = f"/v1/runs/{RUN}/records/{{}}"
        lat: dict[str, np.ndarray] = {}
        for name, url in endpoints.items():
            times = []
            for i in range(requests):
                u = record.format(keys[i]) if name == "record_by_key" else url
                t = time.perf_counter()
                r = client.get(u)
                times.append(time.perf_counter() - t)
                assert r.status_code in (200, 404), (u, r.text)
            lat[name] = np.array(times) * 1e3
        together: dict[str, np.ndarray] = {}
        window: dict[str, float] = {}
        ages = FindingsAge(client, server.pid, Path(f"{path}.findings") / RUN, live, steps) \
            if manifest is not None else None
        if ages is not None:
            ages.wait_live(timeout=3600)
            ages.start()
        if clients > 1:
            # The same requests from `--clients` processes at once, each walking the endpoints
            # in its own order, while the writer goes on.
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(clients) as pool:
                pool.map(abs, range(clients))  # the clients started before the window opens
                t_open, w_open = time.perf_counter(), live["rows"]
                i_open = client.get("/healthz").json()["ingest"]["rows"]
                until = time.time() + min_seconds
                jobs = [(base, endpoints, requests, record, keys[(c + 1) * requests:], c, until)
                        for c in range(clients)]
                for got in pool.starmap(_client, jobs):
                    for name, t in got.items():
                        together[name] = np.r_[together.get(name, np.zeros(0)), t]
                i_close = client.get("/healthz").json()["ingest"]["rows"]
                span = time.perf_counter() - t_open
                window = {"seconds": span, "written_rows_per_s": (live["rows"] - w_open) / span,
                          "ingested_rows_per_s": (i_close - i_open) / span}
        health = client.get("/healthz").json()
        summary = client.get(f"/v1/runs/{RUN}").json()
        rss_bytes = _peak_rss_bytes(server.pid)
        findings = ages.stop() if ages is not None else None
    finally:
        stop.set()
        server.terminate()
        server.wait(60)
        if writer is not None:
            writer.join(60)
    if "error" in live:
        raise RuntimeError(f"the live writer failed: {live['error']}") from live["error"]
    print(f"while timing: the writer published {live['rows']:,} more rows; the server ingested "
          f"{health['ingest']['rows']:,} of them in {health['ingest']['files']} files; ledger now "
          f"{summary['rows_ingested']:,} rows; "
          f"lag at the end {health['ingest']['lag_seconds']:.1f} s"
          + (f"; server peak RSS {rss_bytes / 2**30:.1f} GiB" if rss_bytes else ""))
    if window:
        print(f"beside {clients} clients, over {window['seconds']:.1f} s: the writer published "
              f"{window['written_rows_per_s']:,.0f} rows/s, the service ingested "
              f"{window['ingested_rows_per_s']:,.0f} rows/s")
    if findings:
        print(f"live findings: age p50 {findings['age_p50_s']:.1f} s, max "
              f"{findings['age_max_s']:.1f} s over {findings['samples']} samples; "
              f"{findings['rounds']} rounds of the live reconcile, "
              f"{findings['round_s_mean']:.2f} s (max {findings['round_s_max']:.2f}) and "
              f"{findings['cpu_per_round_s']:.2f} CPU s a round")
    conc = f" {clients} clients p50 / p99 ms" if together else ""
    print(f"{'endpoint':24s} {'p50 ms':>8s} {'p99 ms':>8s} {conc:>30s}  reference / p50")
    ratios = {}
    for name, t in lat.items():
        p50, p99 = np.percentile(t, 50), np.percentile(t, 99)
        key = {"coverage": "coverage", "summary": "coverage", "steps_full_range": "steps",
               "hosts": "hosts"}.get(name)
        note = ""
        if key:
            ratios[name] = ref[key] * 1e3 / p50
            note = f"  {ratios[name]:,.2f} ({key} scan {ref[key] * 1e3:,.0f} ms)"
        c = together.get(name)
        both = "" if c is None else \
            f"{np.percentile(c, 50):14.1f} / {np.percentile(c, 99):8.1f}      "
        print(f"{name:24s} {p50:8.1f} {p99:8.1f} {both:>30s}{note}")
    target = ("summary", "coverage", "coverage_at_step", "steps_full_range",
              "steps_range_bucketed", "hosts", "record_by_key")
    worst = max(np.percentile(lat[k], 99) for k in target)
    print(f"worst sequential p99 of summary/coverage/steps/hosts/record: {worst:.1f} ms "
          "(target <= 50 ms)")
    if together:
        worst_c = max(np.percentile(together[k], 99) for k in target)
        print(f"worst p99 with {clients} clients at once: {worst_c:.1f} ms "
              "(target <= 150 ms)")
    return {"p50": {k: float(np.percentile(v, 50)) for k, v in lat.items()},
            "p99": {k: float(np.percentile(v, 99)) for k, v in lat.items()},
            "p50_concurrent": {k: float(np.percentile(v, 50)) for k, v in together.items()},
            "p99_concurrent": {k: float(np.percentile(v, 99)) for k, v in together.items()},
            "ratios": ratios, "live_rows": live["rows"], "ingested_live": health["ingest"]["rows"],
            "lag_s": health["ingest"]["lag_seconds"], "server_start_s": start_s,
            "window": window, "findings": findings,
            "peak_rss_bytes": rss_bytes}


class FindingsAge:
    """Samples, once a second, how old the service's live findings are: now minus the time the
    step they are as of was handed to the writers (`live["step_at"]`), and the live
    reconcile's rounds (its follow.json) and CPU seconds (its process, a child of the
    service's)."""

    def __init__(self, client: httpx.Client, server_pid: int, work: Path, live: dict,
                 first_live_step: int) -> None:
        self.client, self.pid, self.work, self.live = client, server_pid, work, live
        self.first = first_live_step
        self.ages: list[float] = []
        self.round_s: dict[int, float] = {}  # round -> its seconds, of the rounds sampled
        self.first_round: dict = {}  # the first round's follow.json (the full pass)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _as_of(self) -> int | None:
        got = self.client.get(f"/v1/runs/{RUN}").json().get("findings") or {}
        return got.get("as_of_step")

    def wait_live(self, timeout: float) -> None:
        """Until the findings are as of the step the live writer had reached when this wait
        began: the backlog's full pass done, and the rounds that fold in what the writer
        published meanwhile (the steady state the window then measures)."""
        t0 = time.time()
        goal = max(self.live.get("step_at", {}), default=self.first)
        first_round = None
        while time.time() - t0 < timeout:
            st = self._status()
            if first_round is None and st["round"] >= 1:
                first_round = st
                how = "resumed from its checkpoint" if st.get("resumed_from_round") else \
                    "the full pass over the backlog"
                print(f"live reconcile: first round ({how}) {st['seconds']:.1f} s, "
                      f"{st['rows']:,} rows kept")
                with contextlib.suppress(OSError):  # why a checkpoint was set aside, if one was
                    first_round["log"] = (self.work / "follow.log").read_text()[-2000:]
            at = self._as_of()
            if at is not None and at >= goal:
                print(f"live findings as of step {at} (the writer's step {goal} when the wait "
                      f"began) after {time.time() - t0:.0f} s, round {st['round']}")
                self.first_round = first_round or {}
                return
            time.sleep(1.0)
        raise RuntimeError("the live findings never caught up with the writer")

    def _follower(self):
        import psutil

        for p in psutil.Process(self.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "--follow" in p.cmdline():
                    return p
        return None

    def _status(self) -> dict:
        try:
            return json.loads((self.work / "follow.json").read_text())
        except (OSError, ValueError):
            return {"round": 0}

    def _cpu(self) -> float:
        p = self._follower()
        if p is None:
            return 0.0
        t = p.cpu_times()
        return t.user + t.system

    def start(self) -> None:
        self.round0, self.cpu0, self.t0 = self._status()["round"], self._cpu(), time.time()
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            at = self._as_of()
            when = self.live.get("step_at", {}).get(at)
            if when is not None:
                self.ages.append(time.time() - when)
            st = self._status()
            if st["round"] > self.round0:
                self.round_s[st["round"]] = st["seconds"]

    def stop(self, round_wait_s: float = 120.0) -> dict:
        """The window's figures, once a round at least has ended in it (waiting for the one
        under way up to `round_wait_s`): a short window on a busy box (the bench's test) could
        close before any, and the age and CPU a round would be void."""
        deadline = time.time() + round_wait_s
        while self._status()["round"] <= self.round0 and time.time() < deadline:
            time.sleep(0.2)
        self._stop.set()
        self._t.join()
        rounds = self._status()["round"] - self.round0
        span = time.time() - self.t0
        a = np.array(self.ages or [float("nan")])
        first = self.first_round
        return {"age_p50_s": float(np.percentile(a, 50)), "age_max_s": float(a.max()),
                "first_round_s": first.get("seconds"),  # the full pass, unless resumed
                "resumed_from_round": first.get("resumed_from_round"),
                "follow_log": first.get("log"),  # the live reconcile's stderr, first round
                "samples": len(self.ages), "rounds": rounds, "seconds": span,
                "round_s_mean": float(np.mean(list(self.round_s.values()) or [np.nan])),
                "round_s_max": float(max(self.round_s.values(), default=np.nan)),
                # (no round finished in the window: no CPU a round to say)
                "cpu_per_round_s": (self._cpu() - self.cpu0) / rounds if rounds else np.nan}


def _client(base: str, endpoints: dict[str, str], requests: int, record: str,
            keys: np.ndarray, seed: int, until: float = 0.0) -> dict[str, np.ndarray]:
    """One client process: `requests` requests per endpoint, the endpoints interleaved in a
    random order (so that the clients ask for different things at the same moment); more such
    rounds while the clock is before `until`."""
    rng = np.random.default_rng(seed)
    times: dict[str, list[float]] = {n: [] for n in endpoints}
    i = 0
    with httpx.Client(base_url=base, timeout=60) as client:
        while i == 0 or time.time() < until:
            names = np.repeat(np.array(list(endpoints)), requests)
            rng.shuffle(names)
            for name in names.tolist():
                u = record.format(keys[i % len(keys)]) if name == "record_by_key" \
                    else endpoints[name]
                i += 1
                t = time.perf_counter()
                r = client.get(u)
                times[name].append(time.perf_counter() - t)
                assert r.status_code in (200, 404), (u, r.text)
    return {n: np.array(t) * 1e3 for n, t in times.items()}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss_bytes(pid: int) -> int | None:
    """The process's peak resident memory (VmHWM), while it still runs."""
    try:
        hwm = [x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
               if x.startswith("VmHWM")]
    except OSError:
        return None
    return int(hwm[0].split()[1]) * 1024 if hwm else None


if __name__ == "__main__":
    main()
