"""Crash safety with real processes killed by SIGKILL, mid-write and mid-ingest."""

import random
import signal
import time

import numpy as np

from audit.hook import spool as sp
from audit.hook.segments import Segments
from audit.hook.writer import LedgerWriter
from audit.ledger.database import Ledger
from audit.ledger.ingest import ingest
from tests.conftest import popen_py

ROWS = 256

WRITER = f"""
import sys
from audit.hook.writer import LedgerWriter
from tests.conftest import unpacked_batch
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
import audit.ledger.ingest
write = audit.ledger.ingest._write_batch
def announced(*args):
    write(*args)
    print("batch", flush=True)
audit.ledger.ingest._write_batch = announced
from audit.cli import main
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
    partial = []
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
    assert any(0 < f < 120 for f in partial), partial  # some kill did land mid-ingest

    with Ledger(path) as ledger:
        ingest(spool, ledger)
        assert ledger.query("SELECT count(*) AS f FROM segments")[0]["f"] == 120
        assert ledger.query("SELECT count(*) AS n FROM consumption")[0]["n"] == total
        # Each file's rows exactly once.
        assert ledger.query("""SELECT max(n) AS m FROM (SELECT file_id, step, count(*) AS n
            FROM consumption GROUP BY ALL)""")[0]["m"] == 20_000
        assert ledger.query("SELECT count(DISTINCT step) AS s FROM consumption")[0]["s"] == 120
