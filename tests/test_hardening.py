"""Hardening on the real service and the real CLI: entries that used to hang or stop the live
ingester, non-finite values, failed starts that must create nothing, one line for a user's
mistake, Ctrl-C, and a reused run id."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tally.api.app import create_app
from tally.audit.hook import spool as sp
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tests.support import ROOT
from tests.support.api import Server, poll, write_steps
from tests.support.batches import unpacked_batch
from tests.support.cli import tally
from tests.support.manifest import uniform_manifest

N = 150


def test_a_fifo_and_a_symlink_loop_neither_hang_nor_stop_live_ingest(tmp_path):
    spool = tmp_path / "spool"
    write_steps(spool, "r", host=0, hosts=1, steps=range(10), n=N, seed=0, flush_every=5)
    d = sp.host_dir(spool, "r", 0, 0)
    os.mkfifo(d / sp.file_name("seg", 50, 0))
    os.symlink(sp.file_name("seg", 60, 0), d / sp.file_name("seg", 60, 0))
    os.symlink(tmp_path / "gone", spool / "dangling.parquet")
    with Ledger(tmp_path / "l.duckdb") as ledger:
        app = create_app(ledger, spool=spool, records=N, interval=0.05)
        with Server(app) as srv:
            assert poll(lambda: srv.get("/v1/runs/r").json().get("last_step") == 9, timeout=30)
            write_steps(spool, "s", host=0, hosts=1, steps=range(5), n=N, seed=1)
            assert poll(lambda: srv.get("/v1/runs/s").status_code == 200, timeout=30)
            h = srv.get("/healthz").json()
            assert h["status"] == "ok", h
            assert h["quarantined_files"] == {"dangling.parquet": 1, "r": 2}
            q = srv.get("/v1/runs/r").json()["quarantined_files"]
            assert q["count"] == 2
            assert {x["reason"] for x in q["first"]} == {
                "not a regular file: a FIFO", "not a regular file: a symlink loop"}


def test_a_round_that_overruns_turns_healthz_degraded(tmp_path):
    spool = tmp_path / "spool"
    write_steps(spool, "r", host=0, hosts=1, steps=range(40), n=N, seed=0, flush_every=1)
    with Ledger(tmp_path / "l.duckdb") as ledger:
        app = create_app(ledger, spool=spool, records=N, interval=0.05,
                         max_round_seconds=0.0001)
        with Server(app) as srv:
            h = poll(lambda: (x := srv.get("/healthz").json())["ingest"]["overran"] and x)
            assert h["status"] == "degraded" and h["ingest"]["overran"] > 0.0001


def test_a_nan_loss_is_served_as_null_and_never_breaks_an_answer(tmp_path):
    spool = tmp_path / "spool"
    with LedgerWriter(spool, "nan", records_per_epoch=N, fsync=False) as w:
        for s in range(4):
            w.write_batch(s, unpacked_batch(s, n_records=N))
            w.log_metric(s, "train_loss", [2.0, float("nan"), float("inf"), 1.5][s])
        w.log_metric(3, "heldout_loss", float("-inf"))
    with Ledger(tmp_path / "l.duckdb") as ledger, \
            Server(create_app(ledger, spool=spool, interval=0.05)) as srv:
        assert poll(lambda: srv.get("/v1/runs/nan").json().get("last_step") == 3)
        m = srv.get("/v1/runs/nan/metrics")
        assert m.status_code == 200
        assert m.json()["train_loss"]["value"] == [2.0, None, None, 1.5]
        assert m.json()["milestones"][0]["heldout_loss"] is None
        assert srv.get("/metrics").status_code == 200
        s = srv.get("/v1/runs/nan").json()
        assert s["non_finite_losses"] == {"count": 3, "first_step": 1}
        assert [a["firing"] for a in s["alerts"] if a["name"] == "non_finite_loss"] == [True]
    uniform_manifest(tmp_path / "m.parquet", N)
    from tally.audit.reconcile import reconcile

    for source in ({"spool": spool}, {"ledger": tmp_path / "l.duckdb"}):
        r = reconcile(run_id="nan", manifest=tmp_path / "m.parquet", out=tmp_path / "rep",
                      **source)
        (f,) = [f for f in r["findings"] if f["code"] == "non_finite_loss"]
        assert f["numbers"] == {"count": 3, "first_step": 1}, source


@pytest.mark.slow
def test_a_failed_start_of_serve_creates_nothing(tmp_path):
    ledger = tmp_path / "y.duckdb"
    out = tally("serve", "--spool", str(tmp_path / "nonexistent"), "--ledger", str(ledger))
    assert out.returncode == 2
    assert out.stderr == f"tally: error: spool {tmp_path / 'nonexistent'} is not a directory\n"
    assert not ledger.exists()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = tally("serve", "--ledger", str(ledger), "--port", str(port))
    assert out.returncode == 2 and "cannot listen on 127.0.0.1" in out.stderr
    assert out.stderr.count("\n") == 1 and not ledger.exists()
    out = tally("serve", "--ledger", str(ledger), "--manifest", str(tmp_path / "m.parquet"))
    assert out.returncode == 2 and "cannot read manifest" in out.stderr
    assert not ledger.exists()


@pytest.mark.slow
def test_bad_config_values_print_one_line_naming_key_value_and_what_is_allowed(tmp_path):
    conf = tmp_path / "train.json"
    for overrides, said in ((["steps=abc"], "override steps='abc': expected an integer"),
                            (["packing=bogus"], "packing='bogus': Input should be 'none', "
                                                "'first_fit' or 'concat_split'"),
                            (["nope=1"], "override 'nope=1': expected key=value")):
        out = tally("train", f"spool={tmp_path / 'spool'}", *overrides)
        assert (out.returncode, out.stderr.count("\n")) == (2, 1), out.stderr
        assert said in out.stderr and out.stderr.startswith("tally: error: ")
    for body, said in (({"global_batch": -3}, "global_batch=-3: Input should be greater than "
                                              "or equal to 1"),
                       ({"steps": "30"}, "steps='30': Input should be a valid integer")):
        conf.write_text(json.dumps(body))
        out = tally("train", "--config", str(conf))
        assert (out.returncode, out.stderr.count("\n")) == (2, 1), out.stderr
        assert said in out.stderr


@pytest.mark.slow
def test_a_fresh_train_of_a_run_that_has_a_spool_is_refused(tmp_path):
    spool = tmp_path / "spool"
    write_steps(spool, "exp1", host=0, hosts=1, steps=range(2), n=N, seed=0)
    out = tally("train", f"spool={spool}", "run_id=exp1", "steps=2")
    assert out.returncode == 2
    assert out.stderr == (f"tally: error: run exp1 already has a spool in {spool}: resume it "
                          "(--resume) or choose another run id\n")


def test_ctrl_c_during_reconcile_prints_one_line_and_leaves_no_output(tmp_path):
    spool, out_dir = tmp_path / "spool", tmp_path / "report"
    for h in range(2):
        write_steps(spool, "r", host=h, hosts=2, steps=range(40), n=N, seed=h, flush_every=2)
    uniform_manifest(tmp_path / "m.parquet", N)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tally.audit.cli", "reconcile", "--spool",
                             str(spool), "--manifest", str(tmp_path / "m.parquet"), "--run", "r",
                             "-o", str(out_dir), "--mode", "multi_processing"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group: a terminal's Ctrl-C
    try:
        assert poll(lambda: (out_dir / ".work").exists() or proc.poll() is not None,
                    timeout=60, every=0.01)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends the foreground group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.endswith("tally: interrupted\n") and "Traceback" not in err, err
    assert not out_dir.exists()
    time.sleep(0.5)  # nothing of the job lives on
    left = subprocess.run(["pgrep", "-f", str(out_dir)], capture_output=True, text=True)
    assert left.stdout == ""




@pytest.mark.slow
def test_a_reconcile_over_unreadable_files_fails_and_says_why(tmp_path):
    """Before: a spool whose only file had the wrong columns gave WARN 'nothing consumed' and
    exit 0, the reason only in report.json."""
    spool = tmp_path / "spool"
    d = sp.host_dir(spool, "r", 0, 0)
    d.mkdir(parents=True)
    pq.write_table(pa.table({"step": [0], "x": [1]}), d / sp.file_name("seg", 0, 0))
    uniform_manifest(tmp_path / "m.parquet", N)
    out = tally("reconcile", "--spool", str(spool), "--manifest", str(tmp_path / "m.parquet"),
                 "--run", "r", "-o", str(tmp_path / "rep"), "--strict")
    assert out.returncode == 1, out.stderr
    assert "FAIL: 1 spool file of this run could not be read" in out.stdout
    assert "schema mismatch" in out.stdout


@pytest.mark.slow
def test_a_fifo_named_like_a_segment_is_left_out_of_reconcile_with_its_reason(tmp_path):
    spool = tmp_path / "spool"
    write_steps(spool, "r", host=0, hosts=1, steps=range(10), n=N, seed=0, flush_every=5)
    os.mkfifo(sp.host_dir(spool, "r", 0, 0) / sp.file_name("seg", 50, 0))
    uniform_manifest(tmp_path / "m.parquet", N)
    out = tally("reconcile", "--spool", str(spool), "--manifest", str(tmp_path / "m.parquet"),
                 "--run", "r", "-o", str(tmp_path / "rep"), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "not a regular file: a FIFO" in out.stdout


@pytest.mark.slow
def test_reconcile_from_the_ledger_reports_the_files_ingest_set_aside(tmp_path):
    spool = tmp_path / "spool"
    write_steps(spool, "r", host=0, hosts=1, steps=range(10), n=N, seed=0, flush_every=5)
    d = sp.host_dir(spool, "r", 0, 0)
    first = sorted(d.glob("seg-*"))[0]
    (d / sp.file_name("seg", 0, 77)).write_bytes(first.read_bytes())  # a copy
    (d / sp.file_name("seg", 90, 78)).write_text("not parquet")
    uniform_manifest(tmp_path / "m.parquet", N)
    assert tally("ingest", str(spool), "--ledger", str(tmp_path / "l.duckdb"),
                  "-q").returncode == 0
    from tally.audit.reconcile import reconcile

    r = reconcile(run_id="r", manifest=tmp_path / "m.parquet", out=tmp_path / "rep",
                  ledger=tmp_path / "l.duckdb")
    codes = {f["code"]: f for f in r["findings"]}
    assert codes["files_unreadable"]["numbers"] == {"files": 1}
    assert codes["duplicate_files"]["numbers"] == {"files": 1}
    assert r["verdict"] == "FAIL"


@pytest.mark.slow
def test_live_findings_are_the_findings_reconcile_gives_for_the_same_spool(tmp_path):
    """The service re-runs the reconcile job over its spool: the run summary names the same
    causes with the same numbers as `tally reconcile`, and the findings alert fires."""
    from tally.audit.reconcile import reconcile
    from tests.test_api_live import write_manifest

    spool = tmp_path / "spool"
    for h in range(2):  # host 0 also reads held-out record 155 and unknown key 400
        write_steps(spool, "r", host=h, hosts=2, steps=range(20), n=150, seed=h, flush_every=5,
                    outside={3: 155, 7: 400} if h == 0 else None)
    manifest = write_manifest(tmp_path / "m.parquet")
    with Ledger(tmp_path / "l.duckdb") as ledger, \
            Server(create_app(ledger, spool=spool, manifest=manifest, interval=0.05,
                              findings_every=0.5)) as srv:
        live = poll(lambda: (s := srv.get("/v1/runs/r").json()).get("findings") and
                    s["findings"]["verdict"] and s, timeout=120)
        assert live, srv.get("/v1/runs/r").json()
        want = reconcile(run_id="r", manifest=manifest, out=tmp_path / "rep", spool=spool)
        assert live["findings"]["findings"] == want["findings"]
        assert live["findings"]["verdict"] == want["verdict"] == "FAIL"
        (alert,) = [a for a in live["alerts"] if a["name"] == "findings"]
        assert alert["firing"] and alert["value"] == sum(
            f["severity"] == "FAIL" for f in want["findings"])
        # Integrity against the manifest, live, with reconcile's numbers.
        alerts = {a["name"]: a for a in live["alerts"]}
        integ = want["integrity"]
        assert (alerts["heldout_leak"]["value"], alerts["unknown_keys"]["value"],
                alerts["hash_mismatch"]["value"]) == (
            integ["heldout_consumed_records"], integ["unknown_keys"], integ["hash_mismatches"])
        assert (integ["heldout_consumed_records"], integ["unknown_keys"]) == (1, 1)
        assert alerts["heldout_leak"]["firing"] and alerts["unknown_keys"]["firing"]
        text = srv.get("/metrics").text
        assert (f'tally_integrity{{kind="heldout_consumed_records",run="r"}} '
                f'{float(integ["heldout_consumed_records"])}') in text
        report = srv.get("/v1/runs/r/report").json()  # the live report is served too
        assert report["findings"] == want["findings"]


@pytest.mark.slow
def test_diff_and_exposure_report_unreadable_files_as_reconcile_does(tmp_path):
    """Before: with one truncated spool file, reconcile said FAIL files_unreadable, but `tally
    diff` blamed a divergence at that file's step and `tally exposure` said nothing. Now each
    command that reads a spool (or a ledger's quarantine) names the file, counted alike."""
    spool = tmp_path / "spool"
    for run in ("a", "b"):
        for h in range(2):
            write_steps(spool, run, host=h, hosts=2, steps=range(12), n=N, seed=h, flush_every=4,
                        records_per_epoch=N)
    victim = sp.host_dir(spool, "b", 0, 0) / sp.file_name("seg", 4, 2)
    victim.write_bytes(victim.read_bytes()[:200])
    man = str(tmp_path / "m.parquet")
    uniform_manifest(tmp_path / "m.parquet", N)
    pq.write_table(pa.table({"record_key": list(range(N))}), tmp_path / "docs.parquet")
    assert tally("ingest", str(spool), "--ledger", str(tmp_path / "l.duckdb"),
                  "-q").returncode == 0
    for src in (spool, tmp_path / "l.duckdb"):
        tag = src.name
        rec = tally("reconcile", *(["--spool", str(src)] if src == spool else
                                    ["--ledger", str(src)]), "--manifest", man, "--run", "b",
                     "-o", str(tmp_path / f"rep-{tag}"), "-q", "--json")
        d = tally("diff", "--a", f"{src}:a", "--b", f"{src}:b", "--manifest", man, "-o",
                   str(tmp_path / f"d-{tag}"), "-q", "--strict")
        e = tally("exposure", "--spool" if src == spool else "--ledger", str(src),
                   "--manifest", man, "--run", "a", "--run", "b", "--docs",
                   str(tmp_path / "docs.parquet"), "-o", str(tmp_path / f"e-{tag}"), "-q")
        assert "Traceback" not in rec.stderr + d.stderr + e.stderr
        assert d.returncode == 1 and e.returncode == 0, (d.stderr, e.stderr)
        want = "1 spool file of run B (b) could not be read and was left out"
        assert f"FAIL: {want}" in d.stdout and "seg-000000000004-000002.parquet" in d.stdout
        assert "the divergence may be those files, not the loader" in d.stdout
        assert "FAIL: 1 spool file of run b could not be read" in e.stdout
        report = json.loads((tmp_path / f"rep-{tag}" / "report.json").read_text())
        diffed = json.loads((tmp_path / f"d-{tag}" / "diff.json").read_text())
        exposed = json.loads((tmp_path / f"e-{tag}" / "exposure.json").read_text())
        counts = [report["consumption"]["unreadable_files"], diffed["b"]["unreadable_files"],
                  exposed["runs"]["b"]["unreadable_files"]]
        assert counts == [1, 1, 1], (tag, counts)
        assert diffed["a"]["unreadable_files"] == exposed["runs"]["a"]["unreadable_files"] == 0
        assert {f["code"] for f in exposed["findings"]} == {"files_unreadable"}


@pytest.mark.slow
def test_a_step_far_ahead_is_one_line_not_a_machine_full_of_step_series(tmp_path):
    """Reconcile and diff keep per-step series from a run's first step to its last: one file
    whose step jumps to 3x10^7 made two 2-row runs cost 1.0 GB (reconcile) and 2.4 GB (diff),
    and 2^31 would have needed terabytes. The span is bounded by --memory-gb: one line, exit 2,
    nothing written."""
    spool = tmp_path / "spool"
    for run in ("a", "b"):
        with LedgerWriter(spool, run, host=0, host_count=1, records_per_epoch=N,
                          flush_every=1, fsync=False) as w:
            for s in (0, 30_000_000):
                w.write_batch(s, unpacked_batch(s, n_records=N))
    man = str(uniform_manifest(tmp_path / "m.parquet", N))
    rec = tally("reconcile", "--spool", str(spool), "--manifest", man, "--run", "a", "-o",
                 str(tmp_path / "rep"), "-q")
    d = tally("diff", "--a", f"{spool}:a", "--b", f"{spool}:b", "--manifest", man, "-o",
               str(tmp_path / "d"), "-q")
    for out, job in ((rec, "reconcile"), (d, "diff")):
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert f"steps 0..30,000,000 (30,000,001 steps): the {job}'s per-step series" in \
            out.stderr and "--memory-gb 3 allows" in out.stderr, out.stderr
    assert not (tmp_path / "rep").exists() and not (tmp_path / "d" / "diff.json").exists()
