"""The `tally` command line, run as a real process."""

import json
import subprocess
from pathlib import Path

import pytest

from tally.audit.hook.writer import LedgerWriter
from tests.support.batches import unpacked_batch
from tests.support.cli import tally

# Each test runs the CLI in child processes; the demo trains two 4-host runs (~2 min).
pytestmark = pytest.mark.slow


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


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("demo") / "demo"
    return out, tally("demo", "--out", str(out), "--records", "640")


def test_demo_trains_two_four_host_runs_and_tells_them_apart(demo):
    out, r = demo
    assert r.returncode == 0, r.stderr[-3000:]
    reports = {run: json.loads((out / "reports" / run / "report.json").read_text())
               for run in ("demo-ok", "demo-per-host-seed")}
    assert reports["demo-ok"]["verdict"] == "PASS"
    assert reports["demo-per-host-seed"]["verdict"] == "FAIL"
    assert {x["code"] for x in reports["demo-per-host-seed"]["findings"]} >= {
        "with_replacement", "loss_flattered"}  # repeats scored lower than due exposures
    assert "loss_flattered" not in {x["code"] for x in reports["demo-ok"]["findings"]}
    table = r.stdout[r.stdout.index("correct  per-host seeds"):]
    row = {line[:36].strip(): line[36:].split() for line in table.splitlines()[1:8]}
    flattered = reports["demo-per-host-seed"]["loss"]["test"]
    assert row["train loss, repeats vs due (nats)"] == ["-", "(no", "repeats)",
                                                        f"{-flattered['difference']:+.3f}",
                                                        "(z", f"{flattered['z']:.1f})"]
    for run, col in (("demo-ok", 0), ("demo-per-host-seed", 1)):
        c = reports[run]["coverage"]
        assert row["coverage"][col] == f"{100 * c['coverage']:.1f}%"
        assert row["never seen"][col] == f"{100 * c['histogram_fraction']['0']:.1f}%"
        assert reports[run]["hosts"]["count"] == 4
    assert row["host overlap (records x host pairs)"][0] == "0"
    assert int(row["host overlap (records x host pairs)"][1].replace(",", "")) > 0
    assert r.stdout.count("train / held-out loss") == 3
    assert "dashboard: http://127.0.0.1:" in r.stdout
    for run in reports:
        assert (out / "reports" / run / "report.html").exists()


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


def test_reconcile_command_on_the_demo_run(demo, tmp_path):
    demo, _ = demo
    out = tmp_path / "report"
    r = tally("reconcile", "--spool", str(demo / "spool"), "--manifest",
              str(demo / "manifest.parquet"), "--run", "demo-ok", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("run demo-ok: PASS")
    assert f"report: {out / 'report.html'}" in r.stdout
    data = json.loads((out / "report.json").read_text())
    assert data["coverage"] == json.loads(
        (demo / "reports" / "demo-ok" / "report.json").read_text())["coverage"]
    assert not (out / ".work").exists()
    r = tally("ingest", str(demo / "spool"), "--ledger", str(tmp_path / "l.duckdb"), "-q")
    assert r.returncode == 0, r.stderr
    r = tally("reconcile", "--ledger", str(tmp_path / "l.duckdb"), "--manifest",
              str(demo / "manifest.parquet"), "--run", "demo-ok", "-o", str(tmp_path / "r2"),
              "--at-step", "20")
    assert r.returncode == 0 and "(as of step 20)" in r.stdout, r.stderr
    r = tally("reconcile", "--spool", str(demo / "spool"), "--manifest",
              str(demo / "manifest.parquet"), "--run", "nope", "-o", str(tmp_path / "r3"))
    assert r.returncode == 2 and "no segment files for run 'nope'" in r.stderr
    seg = next((demo / "spool").rglob("seg-*.parquet"))
    r = tally("reconcile", "--spool", str(demo / "spool"), "--manifest", str(seg), "--run",
              "demo-ok", "-o", str(tmp_path / "r4"))
    assert r.returncode == 2 and "is not a Tally manifest" in r.stderr
    assert "Traceback" not in r.stderr
    r = tally("manifest", str(demo / "corpus"), "-o", str(tmp_path / "m.parquet"), "-q",
              "--runner", "NoSuchRunner")
    assert r.returncode == 2 and "Beam runner 'NoSuchRunner'" in r.stderr
    assert "Traceback" not in r.stderr
