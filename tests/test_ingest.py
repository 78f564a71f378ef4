"""Ingest: exactly once, quarantine of bad files, restart lineage, ledger versioning."""

import shutil
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tally.audit.core.errors import TallyError
from tally.audit.hook import spool as sp
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tests.support.batches import unpacked_batch
from tests.support.processes import popen_py


def _write(spool, run, steps, *, hosts=2, attempt=0, resumed=None, flush_every=5):
    for h in range(hosts):
        with LedgerWriter(spool, run, host=h, host_count=hosts, attempt=attempt,
                          resumed_from_step=resumed, flush_every=flush_every) as w:
            for s in steps:
                w.write_batch(s, unpacked_batch(s, host=h, hosts=hosts))


def _count(ledger, table="consumption"):
    return ledger.query(f"SELECT count(*) AS n FROM {table}")[0]["n"]


def test_empty_spool_and_missing_spool_ingest_nothing(tmp_path):
    (tmp_path / "spool").mkdir()
    with Ledger(tmp_path / "l.duckdb") as ledger:
        assert ingest(tmp_path / "spool", ledger).files == 0
        assert ingest(tmp_path / "nope", ledger).files == 0
        assert ledger.overview() == {"runs": [], "quarantine": []}


def test_rerun_is_a_noop(spool, tmp_path):
    _write(spool, "r", range(20))
    with Ledger(tmp_path / "l.duckdb") as ledger:
        first = ingest(spool, ledger)
        assert first.files == 8 and first.rows == 2 * 20 * 4
        again = ingest(spool, ledger)
        assert (again.files, again.rows, again.already) == (0, 0, 8)
        assert _count(ledger) == 160
    # And after reopening the file.
    with Ledger(tmp_path / "l.duckdb") as ledger:
        assert ingest(spool, ledger).files == 0
        assert _count(ledger) == 160


def test_two_runs_with_restarts_lineage(spool, tmp_path):
    _write(spool, "a", range(0, 30))
    _write(spool, "a", range(20, 40), attempt=1, resumed=20)
    _write(spool, "a", range(35, 50), attempt=2, resumed=35)
    _write(spool, "b", range(0, 10), hosts=4)
    with Ledger(tmp_path / "l.duckdb") as ledger:
        res = ingest(spool, ledger)
        assert res.quarantined == []
        ov = {r["run_id"]: r for r in ledger.overview()["runs"]}
        a = ov["a"]["attempts"]
        assert [(x["attempt"], x["resumed_from_step"], x["rolled_back_from_step"]) for x in a] \
            == [(0, None, 20), (1, 20, 35), (2, 35, None)]
        # Attempt 0 steps 20..29 and attempt 1 steps 35..39 are rolled back.
        assert [x["rolled_back_segments"] for x in a] == [10 * 8, 5 * 8, 0]
        assert [(h["host"], h["first_step"], h["last_step"]) for h in a[1]["hosts"]] == [
            (0, 20, 39), (1, 20, 39)]
        eff = ledger.query("""SELECT step, count(*) AS n FROM effective_consumption
            JOIN runs USING (run) WHERE run_id = 'a' GROUP BY step ORDER BY step""")
        assert [e["step"] for e in eff] == list(range(50))  # every step exactly once
        assert {e["n"] for e in eff} == {8}
        assert len(ov["b"]["attempts"][0]["hosts"]) == 4
        # Rolled-back rows are kept, so the replay can be compared with what it replaced.
        assert _count(ledger, "rolled_back_consumption") == 120
        assert _count(ledger) == 30 * 8 + 20 * 8 + 15 * 8 + 10 * 16


def test_attempt_ingested_before_its_predecessor_still_rolls_back(spool, tmp_path):
    # Attempt 0's files reach the spool only after attempt 1's were ingested (a slow copy).
    _write(tmp_path / "elsewhere", "late", range(0, 15))
    _write(spool, "late", range(10, 20), attempt=1, resumed=10)
    with Ledger(tmp_path / "l.duckdb") as ledger:
        ingest(spool, ledger)
        shutil.move(tmp_path / "elsewhere" / "late" / "attempt=0", spool / "late")
        ingest(spool, ledger)
        assert ledger.query("SELECT count(*) AS n FROM effective_consumption")[0]["n"] == 20 * 8


def _bad_files(spool):
    d = sp.host_dir(spool, "r", 0, 0)
    good = sorted(d.glob("seg-*.parquet"))
    # Truncated: a published file cut short (e.g. copied by a broken tool).
    trunc = d / sp.file_name("seg", 900, 900)
    trunc.write_bytes(good[0].read_bytes()[:-100])
    # Wrong schema: right name, alien columns.
    pq.write_table(pa.table({"a": [1, 2]}), d / sp.file_name("seg", 901, 901))
    # Right schema but lying metadata (host 3 in host=0's directory).
    t = pq.read_table(good[1])
    md = {k: v for k, v in t.schema.metadata.items()}
    md[b"tally.host"] = b"3"
    pq.write_table(t.replace_schema_metadata(md), d / sp.file_name("seg", 902, 902))
    # Not Parquet at all, and a stray name.
    (d / sp.file_name("seg", 903, 903)).write_text("hello")
    (spool / "notes.txt").write_text("stray")
    return good


def test_corrupt_wrong_schema_and_alien_files_are_quarantined_others_ingest(spool, tmp_path):
    _write(spool, "r", range(10), hosts=1)
    good = _bad_files(spool)
    with Ledger(tmp_path / "l.duckdb") as ledger:
        res = ingest(spool, ledger)
        reasons = {k.rsplit("/", 1)[-1]: v for k, v in res.quarantined}
        assert res.files == len(good) and res.rows == 40
        assert "unreadable Parquet footer" in reasons["seg-000000000900-000900.parquet"]
        assert "schema mismatch" in reasons["seg-000000000901-000901.parquet"]
        assert reasons["seg-000000000902-000902.parquet"] == (
            "metadata host=3 but the path says 0")
        assert "unreadable" in reasons["seg-000000000903-000903.parquet"]
        assert "not a spool file" in reasons["notes.txt"]
        assert len(ledger.overview()["quarantine"]) == 5
        # Unchanged bad files are not reported again; a repaired one ingests.
        assert ingest(spool, ledger).quarantined == []
        fixed = spool / "r/attempt=0/host=0/seg-000000000900-000900.parquet"
        fixed.unlink()
        time.sleep(0.01)
        t = pq.read_table(good[0])
        md = dict(t.schema.metadata)
        md.update({b"tally.first_step": b"900", b"tally.last_step": b"904"})
        t = t.set_column(0, "step", pa.array([s + 900 for s in t["step"].to_pylist()], pa.int64()))
        pq.write_table(t.replace_schema_metadata(md), fixed)
        res = ingest(spool, ledger)
        assert res.files == 1 and res.quarantined == []
        assert len(ledger.overview()["quarantine"]) == 4


def test_metadata_conflicting_with_its_attempt_is_quarantined(spool, tmp_path):
    _write(spool, "c", range(10), hosts=1)  # two files, steps 0..4 and 5..9
    f = sorted(sp.host_dir(spool, "c", 0, 0).glob("seg-*"))[-1]
    t = pq.read_table(f)
    md = dict(t.schema.metadata)
    md[b"tally.host_count"] = b"8"
    pq.write_table(t.replace_schema_metadata(md), f)
    with Ledger(tmp_path / "l.duckdb") as ledger:
        res = ingest(spool, ledger)
        assert res.files == 1
        assert "earlier files of it say" in res.quarantined[0][1]


def test_ledger_with_another_schema_version_is_refused(tmp_path):
    path = tmp_path / "l.duckdb"
    with Ledger(path) as ledger:
        ledger.con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(TallyError, match="schema version 99.*reads version 4"):
        Ledger(path)


def test_non_ledger_files_are_refused_clearly(tmp_path):
    junk = tmp_path / "junk.duckdb"
    junk.write_text("not a database")
    with pytest.raises(TallyError, match="junk.duckdb"):
        Ledger(junk)
    with pytest.raises(TallyError, match="no ledger"):
        Ledger(tmp_path / "missing.duckdb", read_only=True)
    import duckdb
    duckdb.connect(str(tmp_path / "other.duckdb")).execute("CREATE TABLE t(x INT)").close()
    with pytest.raises(TallyError, match="not a Tally ledger"):
        Ledger(tmp_path / "other.duckdb")


def test_a_ledger_held_by_another_process_is_a_clear_error(tmp_path):
    path = tmp_path / "l.duckdb"
    Ledger(path).close()
    holder = popen_py(
        "import sys, time; from tally.audit.ledger.database import Ledger\n"
        "l = Ledger(sys.argv[1]); print('open', flush=True); time.sleep(60)", str(path))
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(TallyError, match="held by another process"):
            Ledger(path)
    finally:
        holder.kill()
        holder.wait()


def test_temporaries_of_a_running_writer_are_invisible(spool, tmp_path):
    _write(spool, "tmp", range(5), hosts=1)
    d = sp.host_dir(spool, "tmp", 0, 0)
    shutil.copy(next(d.glob("seg-*")), d / sp.temp_name(sp.file_name("seg", 5, 1)))
    with Ledger(tmp_path / "l.duckdb") as ledger:
        res = ingest(spool, ledger)
        assert (res.files, res.quarantined) == (1, [])


def test_records_per_epoch_is_kept_per_attempt_and_checked(spool, tmp_path):
    for attempt, resumed, n in ((0, None, 1000), (1, 3, 1000), (2, 6, None)):
        with LedgerWriter(spool, "n", attempt=attempt, resumed_from_step=resumed,
                          records_per_epoch=n, flush_every=1) as w:
            for s in range(resumed or 0, (resumed or 0) + 4):
                w.write_batch(s, unpacked_batch(s))
    files = sorted(sp.host_dir(spool, "n", 1, 0).glob("seg-*"))
    for f, n in ((files[0], b"0"), (files[-1], b"999")):  # 999: not the corpus its attempt said
        t = pq.read_table(f)
        pq.write_table(t.replace_schema_metadata({**t.schema.metadata,
                                                  b"tally.records_per_epoch": n}), f)
    with Ledger(tmp_path / "l.duckdb") as ledger:
        res = ingest(spool, ledger)
        reasons = sorted(r for _, r in res.quarantined)
        assert len(reasons) == 2
        assert "records_per_epoch=0 is outside 1.." in reasons[0]
        assert "cycles through 999 records per epoch, but earlier files of it say 1000" in \
            reasons[1]
        got = ledger.query("SELECT attempt, records_per_epoch FROM attempts ORDER BY attempt")
        assert [(r["attempt"], r["records_per_epoch"]) for r in got] == [
            (0, 1000), (1, 1000), (2, None)]


class _StopAfter(threading.Event):
    """A stop that is set once the ingest has looked at it `n` times (mid-backlog)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def is_set(self) -> bool:
        self.n -= 1
        return self.n < 0 or super().is_set()


def test_a_stopped_ingest_ends_after_its_batch_and_the_next_takes_the_rest_once(tmp_path):
    """`tally serve`'s stop: the ingest ends between two batches, each whole, and the next
    ingest takes exactly the files left; the aggregates equal a rebuild from the ledger."""
    from tally.audit.ledger.aggregates import Aggregates
    from tests.test_api_aggregates import assert_same_state

    spool = tmp_path / "spool"
    _write(spool, "r", range(40), flush_every=2)  # 2 hosts x 20 files
    with Ledger(tmp_path / "l.duckdb") as ledger:
        first = ingest(spool, ledger, batch_rows=1, stop=_StopAfter(7))
        assert 0 < first.files < 40 and _count(ledger, "segments") == first.files
        rest = ingest(spool, ledger, batch_rows=1)
        assert first.files + rest.files == 40 and rest.already == first.files
        assert _count(ledger) == first.rows + rest.rows == sum(
            pq.read_metadata(p).num_rows for p in spool.rglob("*.parquet"))
        assert_same_state(ledger._aggregates.runs[1],
                          Aggregates.load(ledger, use_snapshots=False).runs[1])


@pytest.mark.parametrize("in_order", [True, False])
def test_a_files_per_step_counts_are_a_group_by_of_its_rows(in_order):
    """agg_steps' rows of one file (tally.audit.ledger.ingest._per_step, reduced over each step's
    run of rows) against pyarrow's group_by, for a writer's file (steps in order) and for a
    file of another writer with its rows in any order."""
    import numpy as np

    from tally.audit.core.exposure import starts
    from tally.audit.ledger.ingest import _per_step

    rng = np.random.default_rng(3)
    n = 5000
    step = np.sort(rng.integers(2**40, 2**40 + 50, n)).astype(np.int64)
    offset = rng.choice([0, 0, 7], n).astype(np.int32)
    tokens = rng.integers(1, 100, n).astype(np.int32)
    if not in_order:
        p = rng.permutation(n)
        step, offset, tokens = step[p], offset[p], tokens[p]
    t = pa.table({"step": step, "host": np.full(n, 3, np.int32), "offset": offset,
                  "n_tokens": tokens})
    want = t.append_column("start", pa.array(starts(offset).astype(np.int64))).group_by(
        ["host", "step"]).aggregate([("n_tokens", "count"), ("n_tokens", "sum"),
                                     ("start", "sum")]).sort_by("step")
    got = _per_step(t, 3)
    assert got.select(want.column_names).to_pylist() == want.to_pylist()
    assert len(got) == len(np.unique(step)) > 40


def test_a_ledgers_duckdb_memory_is_bounded(tmp_path, monkeypatch):
    """DuckDB's buffer pool of a ledger: a quarter of the machine by default (DuckDB's own
    80% let a long ingest's pages pile up), TALLY_DUCKDB_MEMORY_GB when set."""
    import os

    from tally.audit.ledger.database import memory_limit_mb

    def limit() -> str:
        with Ledger(tmp_path / "l.duckdb") as ledger:
            return ledger.con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]

    monkeypatch.delenv("TALLY_DUCKDB_MEMORY_GB", raising=False)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory_limit_mb() == max(1024, total // 4 // 2**20)
    assert float(limit().split()[0]) < total / 2**30 / 2  # GiB: well below DuckDB's 80%
    monkeypatch.setenv("TALLY_DUCKDB_MEMORY_GB", "0.5")
    assert limit() == "512.0 MiB"
    monkeypatch.setenv("TALLY_DUCKDB_MEMORY_GB", "lots")  # a user's mistake: one clear error
    with pytest.raises(TallyError, match="TALLY_DUCKDB_MEMORY_GB='lots' is not a number"):
        limit()
