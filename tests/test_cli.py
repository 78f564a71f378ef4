"""The `tally` command line, run as a real process."""

import json
import subprocess
import sys

from audit.writer import LedgerWriter
from tests.conftest import ROOT, unpacked_batch


def tally(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "audit.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_ingest_and_ledger_commands(spool, tmp_path):
    for h in range(2):
        with LedgerWriter(spool, "cli", host=h, host_count=2, flush_every=4) as w:
            for s in range(10):
                w.write_batch(s, unpacked_batch(s, host=h, hosts=2))
    (spool / "cli" / "attempt=0" / "host=0" / "seg-000000000099-000099.parquet").write_text("x")
    led = str(tmp_path / "l.duckdb")
    r = tally("ingest", str(spool), "--ledger", led)
    assert r.returncode == 0, r.stderr
    assert "ingested 6 files (80 rows)" in r.stdout and "1 quarantined" in r.stdout
    assert "quarantined cli/attempt=0/host=0/seg-000000000099-000099.parquet: unreadable" \
        in r.stderr
    r = tally("ingest", str(spool), "--ledger", led, "-q")
    assert "ingested 0 files" in r.stdout and "6 already in the ledger" in r.stdout

    r = tally("ledger", led)
    assert r.returncode == 0, r.stderr
    assert "run cli" in r.stdout
    assert "attempt 0: fresh start, 2 host(s), 80 segments" in r.stdout
    assert "host 1: steps 0..9, 3 file(s), 40 segments" in r.stdout
    assert "quarantined files (1)" in r.stdout
    data = json.loads(tally("ledger", led, "--json").stdout)
    assert data["runs"][0]["attempts"][0]["hosts"][1]["segments"] == 40


def test_user_mistakes_are_one_line_errors_not_tracebacks(tmp_path):
    r = tally("ledger", str(tmp_path / "missing.duckdb"))
    assert r.returncode == 2 and r.stderr.startswith("tally: error: no ledger at")
    assert "Traceback" not in r.stderr
    r = tally("ingest", str(tmp_path / "nospool"), "--ledger", str(tmp_path / "l.duckdb"))
    assert r.returncode == 2 and "is not a directory" in r.stderr
    bad = tmp_path / "bad.duckdb"
    bad.write_text("garbage")
    r = tally("ledger", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "bad.duckdb" in r.stderr


def test_demo_runs_end_to_end(tmp_path):
    r = tally("demo", "--out", str(tmp_path / "demo"))
    assert r.returncode == 0, r.stderr
    assert "steps >= 30 rolled back" in r.stdout
    assert "run demo: PASS" in r.stdout
    assert (tmp_path / "demo" / "ledger.duckdb").exists()
    assert (tmp_path / "demo" / "report" / "report.html").exists()


def test_corpus_synth_and_manifest_commands(tmp_path):
    r = tally("corpus", "synth", str(tmp_path / "c"), "--records", "500", "--seed", "2",
              "--length-scale", "0.1")
    assert r.returncode == 0, r.stderr
    assert "500 records (490 train, 10 held out, 5 exact duplicates)" in r.stdout
    r = tally("manifest", str(tmp_path / "c"), "-o", str(tmp_path / "m.parquet"), "-q")
    assert r.returncode == 0, r.stderr
    assert "500 records (490 train)" in r.stdout and "fingerprint" in r.stdout
    r = tally("manifest", str(tmp_path / "nope"), "-o", str(tmp_path / "m2.parquet"))
    assert r.returncode == 2 and r.stderr.strip() == (
        f"tally: error: corpus {tmp_path / 'nope'} is not a directory")


def test_reconcile_command_on_the_demo_run(tmp_path):
    demo = tmp_path / "demo"
    assert tally("demo", "--out", str(demo)).returncode == 0
    out = tmp_path / "report"
    r = tally("reconcile", "--spool", str(demo / "spool"), "--manifest",
              str(demo / "manifest.parquet"), "--run", "demo", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("run demo: PASS")
    assert f"report: {out / 'report.html'}" in r.stdout
    data = json.loads((out / "report.json").read_text())
    # Attempt 0's steps 30..44 were rolled back and replayed identically after the resume.
    (restart,) = [x for x in data["restarts"] if x["attempt"] == 0]
    assert (restart["rolled_back_steps"], restart["replayed_steps"], restart["exact"]) == (
        15, 15, True)
    assert not (out / ".work").exists()
    r = tally("ingest", str(demo / "spool"), "--ledger", str(tmp_path / "l.duckdb"), "-q")
    r = tally("reconcile", "--ledger", str(tmp_path / "l.duckdb"), "--manifest",
              str(demo / "manifest.parquet"), "--run", "demo", "-o", str(tmp_path / "r2"),
              "--at-step", "20")
    assert r.returncode == 0 and "(as of step 20)" in r.stdout, r.stderr
    r = tally("reconcile", "--spool", str(demo / "spool"), "--manifest",
              str(demo / "manifest.parquet"), "--run", "nope", "-o", str(tmp_path / "r3"))
    assert r.returncode == 2 and "no segment files for run 'nope'" in r.stderr
    seg = next((demo / "spool").rglob("seg-*.parquet"))
    r = tally("reconcile", "--spool", str(demo / "spool"), "--manifest", str(seg), "--run",
              "demo", "-o", str(tmp_path / "r4"))
    assert r.returncode == 2 and "is not a Tally manifest" in r.stderr
    assert "Traceback" not in r.stderr
    r = tally("manifest", str(demo / "corpus"), "-o", str(tmp_path / "m.parquet"), "-q",
              "--runner", "NoSuchRunner")
    assert r.returncode == 2 and "Beam runner 'NoSuchRunner'" in r.stderr
    assert "Traceback" not in r.stderr
