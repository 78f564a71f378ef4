"""`tally train --hosts H`: real jax.distributed processes (gloo on CPU), audited, killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tally.audit.core.hashing import content_hash
from tally.audit.hook.segments import segments_from_batch
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.pipeline.corpus import TokenSource
from tally.pipeline.loader import KeyedLoader
from tally.trainer.config import TrainConfig
from tally.trainer.loop import loader_config
from tests.support import ROOT
from tests.support.cli import tally

# Multi-process training runs (jax.distributed), ~40 s each.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(corpora) -> Path:
    return corpora.corpus(records=600, seed=3, length_scale=0.2, max_len=512)


def expected_rows(cfg: TrainConfig, hosts: int, steps: range) -> set[tuple]:
    """What each host's loader hands out at those steps, recomputed independently."""
    source = TokenSource(cfg.corpus)
    want = set()
    for h in range(hosts):
        with KeyedLoader(source, loader_config(cfg), h, hosts) as loader:
            for step in range(steps.stop):
                batch = next(loader)
                if step not in steps:
                    continue
                segs = segments_from_batch(batch, records_per_epoch=len(source))
                for r, k, o, n in zip(segs.row, segs.record_key, segs.offset, segs.n_tokens,
                                      strict=True):
                    tokens = source[int(k)][o:o + n]
                    want.add((h, step, int(r), int(k), int(o), int(n), content_hash(tokens)))
    return want


def test_four_hosts_write_exactly_the_segments_each_step_consumed(corpus, tmp_path):
    cfg = TrainConfig(run_id="h4", corpus=str(corpus), spool=str(tmp_path / "spool"), steps=4,
                      flush_every=2, eval_every=4, eval_records=16)
    args = [f"{k}={v}" for k, v in (("run_id", cfg.run_id), ("corpus", cfg.corpus),
                                    ("spool", cfg.spool), ("steps", 4), ("flush_every", 2),
                                    ("eval_every", 4), ("eval_records", 16))]
    done = tally("train", "--hosts", "4", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    with Ledger(tmp_path / "l.duckdb") as ledger:
        assert not ingest(cfg.spool, ledger).quarantined
        got = ledger.query('SELECT host, step, "row", record_key, "offset", n_tokens, '
                           "content_hash FROM consumption")
        metrics = {m["name"] for m in ledger.query("SELECT DISTINCT name FROM metrics")}
        hosts = {r["host"] for r in ledger.query(
            "SELECT DISTINCT host FROM metrics WHERE name <> 'tally/finished'")}
        finished = {r["host"] for r in ledger.query(
            "SELECT host FROM metrics WHERE name = 'tally/finished' AND step = 3")}
        # Each segment carries its own training loss: weighted by the predictions inside
        # it, the segments of all four hosts give back the step's mean loss the loop logged.
        by_step = ledger.query("""
            WITH s AS (SELECT step, sum(loss * (n_tokens - 1)) FILTER (WHERE n_tokens > 1)
                                  / sum(n_tokens - 1) AS mean FROM consumption GROUP BY step)
            SELECT s.step, s.mean, m.value FROM s JOIN metrics m USING (step)
            WHERE m.name = 'train_loss' ORDER BY s.step""")
        assert ledger.query("SELECT count(*) AS n FROM consumption WHERE loss IS NULL OR "
                            "(n_tokens > 1 AND isnan(loss))")[0]["n"] == 0
    assert [r["step"] for r in by_step] == [0, 1, 2, 3]
    assert [r["mean"] for r in by_step] == pytest.approx([r["value"] for r in by_step],
                                                         rel=1e-4)
    got_rows = [tuple(r.values()) for r in got]
    assert len(got_rows) == len(set(got_rows))  # one ledger row per consumed segment
    assert set(got_rows) == expected_rows(cfg, 4, range(4))
    assert {"train_loss", "heldout_loss"} <= metrics
    assert any(m.startswith("ppl/") for m in metrics) and hosts == {0}
    assert finished == {0, 1, 2, 3}  # every host's writer finished at the last step


def _host_pid(spool: Path, host: int) -> int | None:
    """The training host process `host` of the job writing to `spool` (the launcher runs in a
    supervised child, so hosts are its grandchildren: found by their command line)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tally.trainer.host" in cmd and cmd[cmd.index(b"--host") + 1] == str(host).encode() \
                and any(str(spool).encode() in part for part in cmd):
            return int(pid)
    return None


def _last_published_step(spool: Path, host: int) -> int:
    """First step of the newest published segment file of attempt 0 (-1: none yet)."""
    files = spool.glob(f"*/attempt=0/host={host}/seg-*.parquet")
    return max((int(f.name.split("-")[1]) for f in files), default=-1)


def test_sigkill_one_host_then_resume_rolls_back_and_replays_exactly(corpus, tmp_path):
    from tally.audit.reconcile import reconcile
    from tally.pipeline.manifest import build_manifest

    spool, ckpt = tmp_path / "spool", tmp_path / "ckpt"
    common = ["run_id=k", f"corpus={corpus}", f"spool={spool}", f"checkpoint_dir={ckpt}",
              "checkpoint_every=6", "flush_every=2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen([sys.executable, "-m", "tally.audit.cli", "train", "--hosts", "2",
                                 "steps=24", *common], cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    # Kill host 1 once it has published steps past the second checkpoint (step 12).
    while _last_published_step(spool, 1) < 14:
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    pid = _host_pid(spool, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode != 0 and "host 1 ended with signal 9" in err

    # The session's compilation cache (tests/conftest.py) holds the step the first start's
    # host 0 compiled: both hosts of the resume read it (trainer/distributed.py; before, JAX
    # keyed host 1's entry apart and host 1 compiled its own every start).
    done = tally("train", "--hosts", "2", "--resume", "steps=24", *common,
                 env={"JAX_DEBUG_LOG_MODULES": "jax._src.compiler"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("Persistent compilation cache hit for 'jit_train_step'") == 2
    build_manifest(corpus, tmp_path / "m.parquet")
    report = reconcile(run_id="k", manifest=tmp_path / "m.parquet", out=tmp_path / "rep",
                       spool=spool)
    (back,) = [r for r in report["restarts"] if r["attempt"] == 0]
    assert back["rolled_back_from_step"] >= 12 and back["rolled_back_from_step"] % 6 == 0
    assert back["rolled_back_steps"] > 0 and back["exact"] is True
    assert report["consumption"]["last_step"] == 23 and report["verdict"] == "PASS"
    with Ledger(tmp_path / "l.duckdb") as ledger:
        ingest(spool, ledger)
        steps = ledger.query("SELECT host, count(DISTINCT step) AS n FROM "
                             "effective_consumption GROUP BY host ORDER BY host")
    assert [s["n"] for s in steps] == [24, 24]


def test_resume_on_another_host_count_runs_preflight_and_refuses_unless_forced(corpus,
                                                                               tmp_path):
    from tally.pipeline.manifest import build_manifest

    build_manifest(corpus, tmp_path / "m.parquet")
    ledger = tmp_path / "l.duckdb"
    common = ["run_id=r", f"corpus={corpus}", f"spool={tmp_path / 'spool'}",
              f"checkpoint_dir={tmp_path / 'ckpt'}", "checkpoint_every=4", "flush_every=2",
              f"manifest={tmp_path / 'm.parquet'}"]
    assert tally("train", "--hosts", "2", "steps=5", *common).returncode == 0
    done = tally("train", "--hosts", "1", "--resume", "steps=6", *common)
    assert done.returncode == 2 and "set ledger=PATH" in done.stderr
    done = tally("train", "--hosts", "1", "--resume", "steps=6", f"ledger={ledger}", *common)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "refusing to resume step 5 on 1 host(s) (checkpoint: 2 host(s)" in done.stderr
    assert "says unsafe" in done.stderr and "UNSAFE" in done.stderr
    done = tally("train", "--hosts", "1", "--resume", "--force", "steps=6", f"ledger={ledger}",
                 *common)
    assert done.returncode == 0, done.stderr[-2000:]
    with Ledger(ledger) as led:
        ingest(tmp_path / "spool", led)
        verdicts = led.query("SELECT status, forced, requested_by, old_hosts, new_hosts "
                             "FROM preflight_verdicts ORDER BY id")
        resumed = led.query("SELECT attempt, host_count, resumed_from_step FROM attempts "
                            "ORDER BY attempt")
    assert verdicts == [
        {"status": "unsafe", "forced": False, "requested_by": "trainer", "old_hosts": 2,
         "new_hosts": 1},
        {"status": "unsafe", "forced": True, "requested_by": "trainer", "old_hosts": 2,
         "new_hosts": 1}]
    assert resumed == [{"attempt": 0, "host_count": 2, "resumed_from_step": None},
                       {"attempt": 1, "host_count": 1, "resumed_from_step": 5}]


def test_elastic_reshard_passes_preflight_through_the_api_service(corpus, tmp_path):
    import json
    import urllib.error
    import urllib.request

    from tally.pipeline.manifest import build_manifest
    from tally.trainer.launch import free_port

    build_manifest(corpus, tmp_path / "m.parquet")
    spool = tmp_path / "spool"
    spool.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "tally.audit.cli", "serve", "--spool", str(spool), "--ledger",
         str(tmp_path / "l.duckdb"), "--manifest", str(tmp_path / "m.parquet"), "--port",
         str(port), "--interval", "0.2"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        common = ["run_id=e", f"corpus={corpus}", f"spool={spool}", "elastic=true",
                  "packing=none", f"checkpoint_dir={tmp_path / 'ckpt'}", "checkpoint_every=4",
                  "flush_every=2", f"manifest={tmp_path / 'm.parquet'}", f"api={url}"]
        assert tally("train", "--hosts", "2", "steps=5", *common).returncode == 0
        deadline = time.monotonic() + 60
        while True:  # the service must have ingested the checkpoint's steps
            try:
                with urllib.request.urlopen(f"{url}/v1/runs/e", timeout=5) as r:
                    if json.loads(r.read())["last_step"] >= 4:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.3)
        done = tally("train", "--hosts", "1", "--resume", "steps=7", *common)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "SAFE to resume step 5 on 1 host(s) (was 2)" in done.stderr
        with urllib.request.urlopen(f"{url}/v1/runs/e/preflight", timeout=5) as r:
            history = json.loads(r.read())
        assert [(h["status"], h["requested_by"], h["old_hosts"], h["new_hosts"], h["forced"])
                for h in history] == [("safe", "trainer", 2, 1, False)]
        # Under the run's recorded checkpoint directory: no checkpoint at that path is 404, one
        # that cannot be read 422; outside it, 403. No answer echoes the path.
        ckpt = tmp_path / "ckpt"
        (ckpt / "broken" / "3" / "meta").mkdir(parents=True)
        (ckpt / "broken" / "3" / "meta" / "metadata").write_text("{not json")
        for path, code in ((ckpt / "nope", 404), (ckpt / "broken" / "3", 422),
                           (tmp_path / "nope", 403)):
            bad = urllib.request.Request(f"{url}/v1/runs/e/preflight", json.dumps(
                {"checkpoint": str(path), "hosts": 2}).encode(),
                {"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(bad, timeout=30)
            assert (err.value.code, str(tmp_path) in err.value.read().decode()) == (code, False)
    finally:
        server.terminate()
        server.wait(30)
