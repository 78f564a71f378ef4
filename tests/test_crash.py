"""Crash safety with real processes killed by SIGKILL, mid-write and mid-ingest."""

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from tally.audit.core.errors import NotFound
from tally.audit.hook import spool as sp
from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger import queries as q
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.ledger.lookup import LookupIndex
from tests.support import ROOT
from tests.support.processes import popen_py

# kill -9 of real writer, ingest and serve processes; the soak alone is ~50 s.
pytestmark = pytest.mark.slow

ROWS = 256

WRITER = f"""
import sys
from tally.audit.hook.writer import LedgerWriter
from tests.support.batches import unpacked_batch
w = LedgerWriter(sys.argv[1], "crash", flush_every=int(sys.argv[2]))
last = None
for step in range(10**6):
    w.write_batch(step, unpacked_batch(step, rows={ROWS}, length=64))
    if w.durable_step != last:
        last = w.durable_step
        print("durable", last, flush=True)
"""


def test_sigkill_mid_write_loses_nothing_durable_and_shows_no_partial_file(tmp_path):
    rnd = random.Random(1)
    for trial in range(4):
        spool = tmp_path / f"spool{trial}"
        child = popen_py(WRITER, str(spool), str(rnd.choice([1, 3, 10])))
        target, durable = rnd.randint(5, 120), -1
        try:
            for line in child.stdout:
                durable = int(line.split()[1])
                if durable >= target:
                    break
            time.sleep(rnd.random() * 0.05)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        assert durable >= target, child.stderr.read()

        with Ledger(tmp_path / f"l{trial}.duckdb") as ledger:
            res = ingest(spool, ledger)
            assert res.quarantined == []  # every visible file is whole
            steps = ledger.query(
                "SELECT step, count(*) AS n FROM consumption GROUP BY step ORDER BY step")
            # Steps form 0..last with no hole, each complete and counted once, and nothing at
            # or before the last completed flush is missing.
            assert [s["step"] for s in steps] == list(range(len(steps)))
            assert {s["n"] for s in steps} == {ROWS}
            assert len(steps) - 1 >= durable
        # The next writer for that host clears a killed writer's temporaries.
        LedgerWriter(spool, "crash", attempt=1, resumed_from_step=durable + 1).close()
        assert not list(sp.host_dir(spool, "crash", 0, 0).glob(".*"))


INGEST = """
import sys
import tally.audit.ledger.ingest
import tally.audit.ledger.lookup
tally.audit.ledger.lookup.MEMORY_ROWS = 0  # each batch's run to disk at once: kills land among them
write = tally.audit.ledger.ingest._write_batch
def announced(*args):
    committed = write(*args)
    print("batch", flush=True)
    return committed
tally.audit.ledger.ingest._write_batch = announced
from tally.audit.cli import main
sys.exit(main(["ingest", sys.argv[1], "--ledger", sys.argv[2], "-q", "--batch-rows", "60000"]))
"""


def _big_spool(spool, files=120, rows=20_000):
    rng = np.random.default_rng(0)
    with LedgerWriter(spool, "big", flush_every=1, fsync=False, queue_size=64) as w:
        for step in range(files):
            w.write_segments(step, Segments.build(
                row=np.arange(rows) % 512, record_key=rng.integers(0, 10**6, rows),
                n_tokens=np.full(rows, 100), content_hash=rng.integers(0, 2**63, rows),
                epoch=np.zeros(rows)))
    return files * rows


def test_sigkill_mid_ingest_never_counts_twice_nor_half(tmp_path):
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    total = _big_spool(spool)
    rnd = random.Random(2)
    partial, covered = [], []
    for _ in range(4):
        child = popen_py(INGEST, str(spool), str(path))
        # Some batches (3 files each) in, then a kill at a random moment of the next ones.
        for _ in range(rnd.randint(1, 4)):
            if child.stdout.readline() != "batch\n":
                break
        time.sleep(rnd.random() * 0.3)
        child.send_signal(signal.SIGKILL)
        child.wait()
        with Ledger(path) as ledger:
            files, in_files = ledger.query(
                "SELECT count(*) AS f, coalesce(sum(n_rows), 0) AS r FROM segments")[0].values()
            rows = ledger.query("SELECT count(*) AS n FROM consumption")[0]["n"]
            agg = ledger.query("SELECT coalesce(sum(segments), 0) AS n FROM agg_steps")[0]["n"]
            applied = ledger.query("SELECT coalesce(sum(seg_files), 0) AS n FROM agg_runs")[0]["n"]
            # Whatever the kill interrupted, the ledger holds whole batches of whole files only,
            # and the aggregates count exactly those files.
            assert rows == in_files == agg and applied == files
            partial.append(files)
            # The record lookup index the killed process was writing: what it kept answers as
            # a scan does (tally.audit.ledger.lookup).
            cur = ledger.cursor()
            index = LookupIndex.open(ledger.path, cur)
            covered.append(index.coverage.upto)
            for key in range(0, 10**6, 99_991):
                try:
                    want = q.record(cur, 1, record_key=key)
                except NotFound:
                    continue
                assert q.record(cur, 1, record_key=key, index=index) == want
            cur.close()
    assert any(0 < f < 120 for f in partial), partial  # some kill did land mid-ingest
    assert any(covered), covered  # and the index had runs to check

    with Ledger(path) as ledger:
        ingest(spool, ledger)
        assert ledger.query("SELECT count(*) AS f FROM segments")[0]["f"] == 120
        assert ledger.query("SELECT count(*) AS n FROM consumption")[0]["n"] == total
        # Each file's rows exactly once.
        assert ledger.query("""SELECT max(n) AS m FROM (SELECT file_id, step, count(*) AS n
            FROM consumption GROUP BY ALL)""")[0]["m"] == 20_000
        assert ledger.query("SELECT count(DISTINCT step) AS s FROM consumption")[0]["s"] == 120


def _soak_spool(stage):
    """A run with a restart (attempt 1 resumed at step 40, so attempt 0's steps >= 40 roll
    back), many small files, and copies of some of them under other sequence numbers."""
    rng = np.random.default_rng(5)
    for attempt, steps in ((0, range(0, 60)), (1, range(40, 80))):
        for h in range(2):
            with LedgerWriter(stage, "soak", host=h, host_count=2, attempt=attempt,
                              resumed_from_step=40 if attempt else None, flush_every=2,
                              records_per_epoch=5000, fsync=False) as w:
                for step in steps:
                    w.write_segments(step, Segments.build(
                        row=np.arange(64) // 2, record_key=rng.integers(0, 5000, 64),
                        n_tokens=np.full(64, 10), content_hash=rng.integers(0, 2**63, 64),
                        epoch=np.zeros(64)))
    files = sorted(p for p in stage.rglob("seg-*.parquet"))
    copies = []
    for i, f in enumerate(files[::9]):  # a copy of every ninth file, under another sequence
        copy = f.with_name(sp.file_name("seg", int(f.name.split("-")[1]), 500 + i))
        shutil.copy(f, copy)
        copies.append(copy)
    return files, copies


def test_kill_9_soak_of_ingest_and_serve_loses_nothing_and_counts_nothing_twice(tmp_path):
    """Sixteen kill -9s, at random moments, of `tally ingest` and `tally serve` in turn,
    while the spool grows (files published in stages, copies among them): the ledger then holds
    every original file exactly once and no copy, and its aggregates match it."""
    stage, spool, path = tmp_path / "stage", tmp_path / "spool", tmp_path / "l.duckdb"
    files, copies = _soak_spool(stage)
    everything = sorted(files + copies, key=lambda p: p.name)
    rnd = random.Random(7)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    published, mid_work = 0, 0
    for kill in range(16):  # 24 until 12-06: ~2 s each, the suite at its time budget
        # Publish a few more files (with their directories) before each round.
        for f in everything[published: published + rnd.randint(3, 12)]:
            target = spool / f.relative_to(stage)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, target.with_name(f".{target.name}.tmp"))
            os.rename(target.with_name(f".{target.name}.tmp"), target)
            published += 1
        cmd = (["ingest", str(spool), "--ledger", str(path), "-q", "--batch-rows", "100"]
               if kill % 2 == 0 else
               ["serve", "--spool", str(spool), "--ledger", str(path), "--records", "5000",
                "--interval", "0.01", "--port", "0"])
        before = _files_in(path)
        child = subprocess.Popen([sys.executable, "-m", "tally.audit.cli", *cmd], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rnd.uniform(1.0, 3.0))  # from before its imports are done to well after
        still_running = child.poll() is None
        child.send_signal(signal.SIGKILL)
        child.wait()
        after = _files_in(path)
        mid_work += still_running and after > before
        _consistent(path)
    assert mid_work >= 3, mid_work  # kills that landed while files were going in
    for f in everything[published:]:
        target = spool / f.relative_to(stage)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, target)
    with Ledger(path) as ledger:
        ingest(spool, ledger)
        held = {r["path"] for r in ledger.query("SELECT path FROM segments WHERE kind = 'seg'")}
        assert held == {f.relative_to(stage).as_posix() for f in files}
        quarantined = {r["path"]: r["reason"] for r in ledger.query(
            "SELECT path, reason FROM quarantine")}
        assert set(quarantined) == {c.relative_to(stage).as_posix() for c in copies}
        assert all(r.startswith("duplicate:") for r in quarantined.values())
        written = sum(pq.read_metadata(f).num_rows for f in files)
        assert ledger.query("SELECT count(*) AS n FROM consumption")[0]["n"] == written
        # No host-step row twice: a copy never went in.
        assert ledger.query("""SELECT count(*) AS n FROM (SELECT attempt, host, step, "row",
            "offset", count(*) AS c FROM consumption GROUP BY ALL HAVING c > 2)""")[0]["n"] == 0
        # Effective rows: attempt 0 below step 40, attempt 1 from it, 2 hosts x 64 each step.
        assert ledger.query("SELECT count(*) AS n FROM effective_consumption")[0]["n"] == \
            80 * 2 * 64
    _consistent(path)


def _files_in(path) -> int:
    if not path.exists():
        return 0
    with Ledger(path, read_only=True) as ledger:
        return ledger.query("SELECT count(*) AS n FROM segments")[0]["n"]


def _consistent(path) -> None:
    """Whole files only, each once; aggregates equal to the rows they count."""
    if not path.exists():
        return
    with Ledger(path, read_only=True) as ledger:
        per_file = ledger.query("""SELECT count(*) AS bad FROM segments g LEFT JOIN (
            SELECT file_id, count(*) AS n FROM consumption GROUP BY ALL) c USING (file_id)
            WHERE g.kind = 'seg' AND coalesce(c.n, 0) <> g.n_rows""")[0]["bad"]
        assert per_file == 0
        twice = ledger.query("SELECT count(*) - count(DISTINCT path) AS n FROM segments")
        assert twice[0]["n"] == 0
        rows = ledger.query("SELECT count(*) AS n FROM consumption")[0]["n"]
        agg = ledger.query("SELECT coalesce(sum(segments), 0) AS n FROM agg_steps")[0]["n"]
        assert rows == agg
        files = ledger.query("SELECT count(*) AS n FROM segments WHERE kind = 'seg'")[0]["n"]
        applied = ledger.query("SELECT coalesce(sum(seg_files), 0) AS n FROM agg_runs")[0]["n"]
        assert applied == files
        in_quarantine = ledger.query("""SELECT count(*) AS n FROM quarantine q
            JOIN segments g USING (path)""")[0]["n"]
        assert in_quarantine == 0
