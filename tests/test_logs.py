"""Logs fit for a log collector, quiet and truthful output, ingest lag without false alarms
(issue 33, points 3, 9 and 10), run as real processes with stderr a pipe (as in CI, a
container or a service manager's journal), and once on a pseudo-terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import httpx
import pytest

from tally.audit.hook.writer import LedgerWriter
from tests.support import ROOT
from tests.support.api import free_port, poll, write_steps
from tests.support.batches import unpacked_batch
from tests.support.cli import BARE_ENV, tally_bare
from tests.support.manifest import uniform_manifest
from tests.support.processes import popen_py, run_py

STAGES = """
import time
from tally.pipeline.progress import Progress
with Progress("wait", True) as p:
    p.stage("first")
    time.sleep(1.2)
    p.stage("second", total=3, count=lambda: 2)
    time.sleep(1.2)
"""


@pytest.mark.slow
def test_progress_into_a_pipe_is_one_line_per_stage_and_redraws_on_a_terminal():
    r = run_py(STAGES)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr, repr(r.stderr)
    assert r.stderr.splitlines() == ["tally: [info] wait: first",
                                     "tally: [info] wait: second (3 parts)"], r.stderr
    # On a terminal the bar still redraws in place.
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    proc = subprocess.Popen([sys.executable, "-c", STAGES], stderr=side, stdout=side,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    os.close(side)
    seen = b""
    while True:
        ready, _, _ = select.select([main], [], [], 30)
        if not ready:
            break
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        seen += chunk
    proc.wait(30)
    os.close(main)
    assert seen.count(b"\r") >= 4 and b"wait: second 2/3" in seen, seen


@pytest.fixture(scope="module")
def spool(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("logs")
    for h in range(2):
        with LedgerWriter(tmp / "spool", "r", host=h, host_count=2) as w:
            for s in range(10):
                w.write_batch(s, unpacked_batch(s, host=h, hosts=2, n_records=1000))
    return tmp


@pytest.mark.slow
def test_ingest_into_a_pipe_one_line_none_with_json_and_json_log_lines(spool, tmp_path):
    r = tally_bare("ingest", spool / "spool", "--ledger", tmp_path / "a.duckdb")
    assert r.returncode == 0 and "\r" not in r.stderr, r.stderr
    assert r.stderr.count("tally: [info] ingest: ") == 1, r.stderr
    r = tally_bare("ingest", spool / "spool", "--ledger", tmp_path / "b.duckdb", "--json")
    assert r.returncode == 0 and "ingest:" not in r.stderr and "\r" not in r.stderr, r.stderr
    json.loads(r.stdout)
    r = tally_bare("ingest", spool / "spool", "--ledger", tmp_path / "c.duckdb", "--log-format",
                   "json")
    lines = [json.loads(x) for x in r.stderr.splitlines()]
    assert lines and all({"time", "level", "logger", "message"} <= x.keys() for x in lines)
    assert any(x["message"].startswith("ingest: ") for x in lines), lines


def _old_spool(root: Path, files: int) -> Path:
    """A spool of run r, 2 hosts, `files` files a host, all written a day ago: random keys of
    100 records, so that the two hosts overlap (host_overlap fires in a first pass)."""
    spool = root / "spool"
    for h in range(2):
        write_steps(spool, "r", host=h, hosts=2, steps=range(files), n=100, seed=h,
                    flush_every=1, metrics=False, per_step=2)
    old = time.time() - 86400
    for p in spool.rglob("*"):
        os.utime(p, (old, old))
    return spool


@pytest.mark.slow
def test_serve_logs_alerts_reconciles_quarantine_access_in_json_and_no_lag_alarm_on_an_old_spool(
        tmp_path):
    """A service restarted over a spool written a day ago: the files' age is not lag (it fired
    ingest_lag on the first rounds), the summary says "catching up" meanwhile; then the log
    says what an operator needs: alerts starting and stopping with their numbers, live
    reconciles finished, quarantined files, one line a request with --access-log."""
    spool = _old_spool(tmp_path, 200)
    uniform_manifest(tmp_path / "m.parquet", 1500)  # 600 exposures: the first pass
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tally.audit.cli", "serve", "--ledger", tmp_path / "l.duckdb",
         "--spool", spool, "--manifest", tmp_path / "m.parquet", "--port", str(port),
         "--log-format", "json", "--access-log", "--max-epoch-duplicates", "-1",
         "--max-coverage-behind", "-1", "--max-ingest-lag", "5", "--findings-every", "1",
         "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=BARE_ENV, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    seen: list[dict] = []

    def health() -> dict | None:
        try:
            h = httpx.get(f"{url}/healthz?token=s3cret", timeout=5).json()
        except httpx.HTTPError:
            return None
        seen.append(h)
        return h

    try:
        # Every answer while the backlog goes in (~1 s of rounds), polled as fast as it comes.
        poll(lambda: (h := health()) and not h["ingest"]["catching_up"]
             and h["files_in_ledger"] >= 400, timeout=60, every=0.01)
        assert any(h["ingest"]["catching_up"] for h in seen), "no answer while catching up"
        assert all(h["ingest"]["lag_seconds"] < 60 for h in seen), seen
        s = httpx.get(f"{url}/v1/runs/r").json()
        lag = next(a for a in s["alerts"] if a["name"] == "ingest_lag")
        assert s["ingest_state"] == "live" and not lag["firing"], s
        # Past the first pass (1,880 exposures > N): host_overlap stops firing.
        write_steps(spool, "r", host=0, hosts=2, steps=range(200, 380), n=100, seed=7,
                    flush_every=30, metrics=False, per_step=8)
        def overlap() -> dict:
            s = httpx.get(f"{url}/v1/runs/r").json()
            return next(a for a in s["alerts"] if a["name"] == "host_overlap")

        assert poll(lambda: not overlap()["firing"], timeout=30), overlap()
        # A damaged file: quarantined, and said.
        bad = spool / "r" / "attempt=0" / "host=1" / "seg-000000000900-000000.parquet"
        bad.write_bytes(b"not parquet")
        assert poll(lambda: httpx.get(f"{url}/healthz").json()["ingest"]["quarantined"],
                    timeout=30)
        assert poll(lambda: httpx.get(f"{url}/v1/runs/r").json()["findings"]["verdict"],
                    timeout=90)
        # The verdict is served once the live reconcile wrote its report; the service logs
        # `live_reconcile` when it next looks (every second).
        time.sleep(2.5)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    # Every line a JSON object, but the command's own last word (as `tally: error:` would be).
    assert err.splitlines()[-1] == "tally: interrupted", err[-2000:]
    lines = [json.loads(x) for x in err.splitlines()[:-1]]
    started = {x["alert"]: x for x in lines if x.get("event") == "alert_started"}
    stopped = [x for x in lines if x.get("event") == "alert_stopped"]
    assert started["host_overlap"]["run"] == "r" and started["host_overlap"]["value"] > 0 \
        and started["host_overlap"]["threshold"] == 0, started
    assert [(x["run"], x["alert"]) for x in stopped] == [("r", "host_overlap")], stopped
    assert not any(x.get("alert") == "ingest_lag" for x in lines)
    done = [x for x in lines if x.get("event") == "live_reconcile"]
    assert done and done[0]["verdict"] in ("PASS", "WARN", "FAIL") and done[0]["seconds"] > 0
    q = [x for x in lines if x["message"].startswith("quarantined ")]
    assert q and q[0]["path"].endswith(bad.name) and q[0]["level"] == "warning", q
    access = [x for x in lines if x["logger"] == "uvicorn.access"]
    assert access and {"method", "path", "status"} <= access[0].keys()
    assert any(x["path"] == "/healthz?token=***" for x in access), access  # redacted
    assert "s3cret" not in err


@pytest.mark.slow
def test_summary_never_contradicts_the_verdict(tmp_path):
    """Content drift with no repeat: FAIL, and no 'first bad step none' beside it."""
    for h in range(2):
        with LedgerWriter(tmp_path / "spool", "r", host=h, host_count=2) as w:
            for s in range(5):
                w.write_batch(s, unpacked_batch(s, host=h, hosts=2, n_records=1000))
    uniform_manifest(tmp_path / "m.parquet", 1000)  # its hashes are not the records'
    r = tally_bare("reconcile", "--spool", "spool", "--manifest", "m.parquet", "--run", "r", "-o",
                   "rep", "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("run r: FAIL"), r.stdout
    assert "first bad step none" not in r.stdout, r.stdout
    assert "no step is bad by exposure counts; the FAIL comes from" in r.stdout, r.stdout


@pytest.mark.slow
def test_messages_name_what_to_do(spool, tmp_path):
    # Unknown run, from a spool: the runs it holds.
    uniform_manifest(tmp_path / "x.parquet", 1000)
    r = tally_bare("reconcile", "--spool", spool / "spool", "--manifest", tmp_path / "x.parquet",
                   "--run", "nope", "-o", tmp_path / "rep", "-q")
    assert r.returncode == 2 and r.stderr.strip().endswith("runs here: r"), r.stderr
    # Unknown run, from a ledger: the runs it holds.
    ledger = tmp_path / "l.duckdb"
    assert tally_bare("ingest", spool / "spool", "--ledger", ledger, "-q").returncode == 0
    r = run_py("from tally.audit.ledger.database import Ledger\n"
               "from tally.audit.ledger import queries as q\n"
               f"with Ledger({str(ledger)!r}, read_only=True) as l:\n"
               "    q.run_of(l.cursor(), 'nope')\n")
    assert "unknown run 'nope': no segment of it has been ingested; runs here: r" in r.stderr
    # A ledger another process holds: what to use instead.
    holder = popen_py("import sys, time\nfrom tally.audit.ledger.database import Ledger\n"
                      f"l = Ledger({str(ledger)!r})\nprint('open', flush=True)\ntime.sleep(60)")
    try:
        assert holder.stdout.readline().strip() == "open"
        r = tally_bare("ledger", ledger)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "held by another process" in r.stderr and "/v1/runs" in r.stderr \
        and "--spool" in r.stderr, r.stderr


def test_array_record_corpus_without_the_extra_names_it(tmp_path):
    """The base install (array_record absent: its import blocked here) reading an ArrayRecord
    corpus: 'unreadable array_record shard' read as a damaged file."""
    assert tally_bare("corpus", "synth", "corpus", "--records", "50", "--length-scale", "0.1",
                      "--max-len", "64", cwd=tmp_path).returncode == 0
    uniform_manifest(tmp_path / "m.parquet", 50)
    code = ("import sys\nsys.modules['array_record'] = None\n"
            "from tally.audit.cli import main\nsys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "exposure", "--manifest", "m.parquet",
                        "--spool", "spool", "--run", "r", "--docs", "corpus", "-o", "out"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={**BARE_ENV, "TALLY_SUPERVISED": "1"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("tally: error: 'tally exposure' needs the beam extra"), r.stderr
    assert "unreadable" not in r.stderr


def test_tallys_handler_writes_to_the_stderr_of_the_moment(capsys):
    """A command run in-process (tally.audit.cli.main under one capture) sets up Tally's handler;
    the next command's lines in the same process must reach the stderr of its own moment,
    not the stream that was stderr when the handler was made."""
    import io
    import logging

    from tally.audit.core import logs

    log = logging.getLogger("tally.test_handler")
    log.propagate = False
    h = logs.handler()
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        before = sys.stderr
        sys.stderr = io.StringIO()
        try:
            log.info("first")
            first = sys.stderr.getvalue()
        finally:
            sys.stderr = before
        log.info("second")
        assert first == "tally: [info] first\n"
        assert capsys.readouterr().err == "tally: [info] second\n"
    finally:
        log.removeHandler(h)
