"""Integrity at ingest (tally.audit.ledger.integrity): each file's rows checked against the
manifest in the file's own transaction, with reconcile's numbers, and the service's integrity
alerts firing within one ingest round of the file that carries a fault."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tally.api.app import create_app
from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.ledger.integrity import IngestIntegrity
from tally.pipeline.manifest_file import ManifestKeyIndex, manifest_info, write_manifest_table
from tests.support.api import Server, poll
from tests.support.cli import tally, tally_popen
from tests.support.manifest import content_hash_of, keyed_manifest

TRAIN, HELDOUT, TOKENS = 400, 20, 10
NUMBERS = ("hash_checked", "hash_mismatches", "unknown_keys", "unknown_segments",
           "heldout_consumed_records", "heldout_exposures")


def manifest(tmp: Path) -> tuple[Path, str]:
    m = keyed_manifest(tmp / "m.parquet", TRAIN, HELDOUT, hashes=content_hash_of,
                       tokens=TOKENS, fingerprint=None)
    return m, manifest_info(m)["manifest_fingerprint"]


def write(spool: Path, fingerprint: str, *, steps: range, faults: dict | None = None,
          hosts: int = 2, run: str = "r", per_step: int = 8, flush_every: int = 3) -> None:
    """Each host's `per_step` rows a step: whole records, distinct across hosts and steps
    (wrapping over the train split), hashed as the manifest says. `faults`: {(step, host):
    "mismatch" | "unknown" | "heldout" | "cut"} changes row 2 of that step: another hash, a key
    past the manifest, a held-out key, or a segment cut from its record (offset > 0: not a start,
    never hash-checked)."""
    faults = faults or {}
    for h in range(hosts):
        with LedgerWriter(spool, run, host=h, host_count=hosts, fsync=False,
                          manifest_fingerprint=fingerprint, flush_every=flush_every) as w:
            for step in steps:
                keys = (np.arange(per_step) + (step * hosts + h) * per_step) % TRAIN
                hashes, offset = content_hash_of(keys), np.zeros(per_step, np.int64)
                kind = faults.get((step, h))
                if kind == "mismatch":
                    hashes[2] ^= np.uint64(4)
                elif kind == "unknown":
                    keys[2] = TRAIN + HELDOUT + 77
                elif kind == "heldout":
                    keys[2] = TRAIN + 5
                    hashes[2] = content_hash_of(keys[2:3])[0]
                elif kind == "cut":
                    offset[2], hashes[2] = 3, np.uint64(12345)
                w.write_segments(step, Segments.build(
                    row=np.arange(per_step), record_key=keys, offset=offset,
                    n_tokens=np.full(per_step, TOKENS), content_hash=hashes,
                    epoch=np.zeros(per_step, np.int64)))


def ingest_json(spool: Path, ledger: Path, *extra: object) -> dict:
    out = tally("ingest", spool, "--ledger", ledger, "-q", "--json", *extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


FAULTS = {(2, 1): "mismatch", (4, 0): "unknown", (5, 1): "heldout", (6, 0): "cut",
          (8, 1): "mismatch"}


@pytest.mark.slow
def test_ingest_says_reconciles_integrity_numbers_file_by_file(tmp_path):
    m, fp = manifest(tmp_path)
    spool = tmp_path / "spool"
    write(spool, fp, steps=range(10), faults=FAULTS)
    got = ingest_json(spool, tmp_path / "l.duckdb", "--manifest", m)["integrity"]["r"]
    rep = tmp_path / "rep"
    out = tally("reconcile", "--spool", spool, "--manifest", m, "--run", "r", "-o", rep, "-q")
    assert out.returncode == 0, out.stderr
    report = json.loads((rep / "report.json").read_text())
    assert report["verdict"] == "FAIL"
    want = report["integrity"]
    assert {k: got[k] for k in NUMBERS} == {k: want[k] for k in NUMBERS}
    assert (got["hash_mismatches"], got["unknown_keys"], got["heldout_consumed_records"]) == \
        (2, 1, 1)
    assert got["files_checked"] == got["files"] > 0 and got["skipped"] is None
    assert got["examples"]["mismatch"] == [{"record_key": int((2 * 2 + 1) * 8 + 2), "step": 2,
                                            "host": 1},
                                           {"record_key": int((8 * 2 + 1) * 8 + 2) % TRAIN,
                                            "step": 8, "host": 1}]
    assert got["examples"]["unknown"] == [{"record_key": TRAIN + HELDOUT + 77, "step": 4,
                                           "host": 0}]


def test_a_clean_run_checks_every_row_and_finds_nothing(tmp_path):
    """The trap beside the faults: segments cut from their record (offset > 0) are not
    hash-checked, keys wrap over the whole train split, and nothing is counted."""
    m, fp = manifest(tmp_path)
    spool = tmp_path / "spool"
    write(spool, fp, steps=range(60), faults={(6, 0): "cut", (30, 1): "cut"})
    out = tally("ingest", spool, "--ledger", tmp_path / "l.duckdb", "--manifest", m, "-q")
    assert out.returncode == 0, out.stderr
    line = [s for s in out.stdout.splitlines() if s.startswith("integrity of r")]
    assert line == ["integrity of r: 0 hash mismatches of 958 records checked; 0 unknown keys; "
                    "0 held-out records trained on (40 of 40 files checked)"], out.stdout


def test_files_ingested_without_the_manifest_are_checked_afterwards(tmp_path):
    m, fp = manifest(tmp_path)
    spool, ledger = tmp_path / "spool", tmp_path / "l.duckdb"
    write(spool, fp, steps=range(10), faults=FAULTS)
    assert "integrity" not in ingest_json(spool, ledger)
    later = ingest_json(spool, ledger, "--manifest", m)
    assert later["files"] == 0 and later["already"] > 0
    got = later["integrity"]["r"]
    assert got["files_checked"] == got["files"]
    assert (got["hash_mismatches"], got["unknown_keys"], got["heldout_consumed_records"],
            got["hash_checked"]) == (2, 1, 1, 10 * 2 * 8 - 2)  # the unknown and the cut
    again = ingest_json(spool, ledger, "--manifest", m)["integrity"]["r"]
    assert again == got  # checked once: a second pass adds nothing


def test_a_run_of_another_manifest_is_skipped_not_flooded(tmp_path):
    m, _ = manifest(tmp_path)
    spool = tmp_path / "spool"
    write(spool, "0123456789abcdef", steps=range(4), faults={(1, 0): "mismatch"})
    got = ingest_json(spool, tmp_path / "l.duckdb", "--manifest", m)["integrity"]["r"]
    assert got["skipped"].startswith("the run trained against manifest 0123456789abcdef")
    assert got["hash_checked"] == got["hash_mismatches"] == got["unknown_keys"] == 0


def test_a_damaged_cache_is_built_again(tmp_path):
    m, fp = manifest(tmp_path)
    spool, ledger = tmp_path / "spool", tmp_path / "l.duckdb"
    write(spool, fp, steps=range(3), faults={(1, 1): "mismatch"})
    cache = Path(f"{ledger}.integrity")
    cache.mkdir()
    (cache / f"{fp}.npy").write_bytes(b"damaged")
    got = ingest_json(spool, ledger, "--manifest", m)["integrity"]["r"]
    assert got["hash_mismatches"] == 1 and got["hash_checked"] == 3 * 2 * 8
    assert np.load(cache / f"{fp}.npy").shape == (TRAIN + HELDOUT,)


def test_a_check_that_fails_never_stops_the_ingest(tmp_path):
    m, fp = manifest(tmp_path)
    spool = tmp_path / "spool"
    write(spool, fp, steps=range(3))
    index = ManifestKeyIndex(m, tmp_path / "cache")
    index.hash = index.hash[:10]  # shorter than its records: the check's gather fails
    integrity = IngestIntegrity(lambda: index)
    with Ledger(tmp_path / "l.duckdb") as ledger:
        res = ingest(spool, ledger, integrity=integrity)
        assert res.rows == 3 * 2 * 8 and res.files == 2 and not res.quarantined
        assert integrity.error.startswith("integrity at ingest is off: IndexError")
        assert integrity.ready() is None
        assert ledger.query("SELECT count(*) AS n FROM integrity_files")[0]["n"] == 0


def test_a_manifest_that_cannot_be_read_is_one_line(tmp_path):
    spool = tmp_path / "spool"
    write(spool, "f", steps=range(2))
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    out = tally("ingest", spool, "--ledger", tmp_path / "l.duckdb", "--manifest", bad)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "Traceback" not in out.stderr and "bad.parquet" in out.stderr


def test_a_manifest_without_the_train_split_first_is_refused(tmp_path):
    """Held out is a key past the train records: a manifest whose splits interleave would make
    train records look held out, so it is refused (one line), not checked wrongly."""
    keys = np.arange(30)
    bad = write_manifest_table(pa.table({
        "record_key": keys, "content_hash": content_hash_of(keys),
        "n_tokens": np.full(30, TOKENS, np.int32), "domain": ["web"] * 30,
        "split": ["heldout" if k % 10 == 0 else "train" for k in keys],
        "source": ["s"] * 30, "source_index": keys}), tmp_path / "mixed.parquet")
    spool = tmp_path / "spool"
    write(spool, manifest_info(bad)["manifest_fingerprint"], steps=range(1))
    out = tally("ingest", spool, "--ledger", tmp_path / "l.duckdb", "--manifest", bad)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().endswith("record keys are not 0..N-1 with the train split first "
                                       "(rebuild it with `tally manifest`)"), out.stderr
    assert out.stderr.count("\n") == 1


def summary(srv: Server) -> dict:
    return srv.get("/v1/runs/r").json()


def firing(s: dict) -> set[str]:
    return {a["name"] for a in s.get("alerts", []) if a["firing"]}


def test_served_integrity_alert_fires_within_a_round_of_the_file(tmp_path):
    m, fp = manifest(tmp_path)
    spool = tmp_path / "spool"
    write(spool, fp, steps=range(6))
    with Ledger(tmp_path / "l.duckdb") as ledger, \
            Server(create_app(ledger, spool=spool, manifest=m, interval=0.05)) as srv:
        s = poll(lambda: (x := summary(srv)).get("integrity_at_ingest") and
                 x["integrity_at_ingest"]["files_checked"] == 4 and x, timeout=30)
        assert s, summary(srv)
        assert s["status"] == "ok" and not firing(s), s["alerts"]
        names = {a["name"] for a in s["alerts"]}
        assert {"hash_mismatch", "unknown_keys", "heldout_leak"} <= names  # watched, at 0
        write(spool, fp, steps=range(6, 9), faults={(7, 1): "mismatch"}, run="r")
        s = poll(lambda: "hash_mismatch" in firing(x := summary(srv)) and x, timeout=30)
        assert s, summary(srv)
        integ = s["integrity_at_ingest"]
        assert integ["hash_mismatches"] == 1 and integ["files_checked"] == integ["files"]
        assert integ["examples"]["mismatch"][0]["step"] == 7
        assert {"unknown_keys", "heldout_leak"}.isdisjoint(firing(s))
        text = srv.get("/metrics").text
        assert 'tally_integrity_at_ingest{kind="hash_mismatches",run="r"} 1.0' in text
        assert srv.get("/healthz").json()["ingest"]["integrity_error"] is None


def test_the_service_ingests_new_files_while_it_checks_the_old_ones(tmp_path, monkeypatch):
    """A ledger ingested without the manifest, then served with it: the files ingested before
    are checked a slice a round, and new files go in meanwhile (one unbounded catch-up held
    the ingest of a 500M-row ledger for minutes), the new file's fault firing before the old
    files are all checked; then every file is checked, counted once."""
    from tally.audit.ledger import ingest_loop, integrity

    monkeypatch.setattr(integrity, "CATCH_UP_ROWS", 16)  # two files a transaction
    monkeypatch.setattr(ingest_loop, "CATCH_UP_SECONDS", 0.0)  # one transaction a round
    m, fp = manifest(tmp_path)
    spool = tmp_path / "spool"
    write(spool, fp, steps=range(240), flush_every=1, hosts=1)  # 240 files, checked later
    ingest_json(spool, tmp_path / "l.duckdb")
    with Ledger(tmp_path / "l.duckdb") as ledger, \
            Server(create_app(ledger, spool=spool, manifest=m, interval=0.05)) as srv:
        assert poll(lambda: (summary(srv).get("integrity_at_ingest") or {}).get(
            "files_checked", 0) > 0, timeout=30)
        write(spool, fp, steps=range(240, 241), faults={(240, 0): "mismatch"}, hosts=1)
        s = poll(lambda: "hash_mismatch" in firing(x := summary(srv)) and x, timeout=30)
        assert s, summary(srv)
        integ = s["integrity_at_ingest"]
        assert integ["files"] == 241 and integ["files_checked"] < 241  # the old ones still going
        s = poll(lambda: (x := summary(srv))["integrity_at_ingest"]["files_checked"] == 241
                 and x, timeout=60)
        assert s, summary(srv)
        assert s["integrity_at_ingest"]["hash_mismatches"] == 1


def test_a_failing_check_is_said_in_healthz_and_ingest_goes_on(tmp_path):
    m, fp = manifest(tmp_path)
    spool, ledger_path = tmp_path / "spool", tmp_path / "l.duckdb"
    write(spool, fp, steps=range(3))
    Path(f"{ledger_path}.integrity").write_text("a file where the cache directory goes")
    with Ledger(ledger_path) as ledger, \
            Server(create_app(ledger, spool=spool, manifest=m, interval=0.05)) as srv:
        health = poll(lambda: (h := srv.get("/healthz").json())["files_in_ledger"] == 2 and h)
        assert health, srv.get("/healthz").json()
        assert health["status"] == "degraded"
        assert health["ingest"]["integrity_error"].startswith("integrity at ingest is off: ")
        assert summary(srv)["integrity_at_ingest"] is None


@pytest.mark.slow
def test_a_killed_ingest_counts_each_file_once(tmp_path):
    """kill -9 of `tally ingest --manifest` mid-way, then again to the end: each file's
    integrity counted once (its rows and its check share one transaction)."""
    m, fp = manifest(tmp_path)
    spool, ledger = tmp_path / "spool", tmp_path / "l.duckdb"
    faults = {(s, s % 2): "mismatch" for s in range(0, 400, 7)}
    write(spool, fp, steps=range(400), faults=faults, flush_every=1, per_step=16)
    proc = tally_popen("ingest", spool, "--ledger", ledger, "--manifest", m, "-q",
                       "--batch-rows", "64")  # 2 files a transaction: 400 commits
    cache = Path(f"{ledger}.integrity") / f"{fp}.npy"
    assert poll(lambda: cache.exists() or proc.poll() is not None, timeout=60, every=0.01)
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    with Ledger(ledger, read_only=True) as done:
        before = done.query("SELECT count(*) AS n FROM integrity_files")[0]["n"]
        files = done.query("SELECT count(*) AS n FROM segments WHERE kind = 'seg'")[0]["n"]
    assert 0 < before == files < 800, (before, files)  # mid-way, each file with its check
    got = ingest_json(spool, ledger, "--manifest", m)["integrity"]["r"]
    assert got["files_checked"] == got["files"] == 800
    assert got["segments"] == got["hash_checked"] == 400 * 2 * 16
    assert got["hash_mismatches"] == len(faults)
