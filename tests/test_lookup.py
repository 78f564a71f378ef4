"""The record lookup index (tally.audit.ledger.lookup) against a scan of `consumption`: the same
answer
for every key and content hash, whatever the index holds (nothing, part, damaged runs, runs of
another ledger), and merged runs that stay few."""

from __future__ import annotations

import contextlib
import shutil

import numpy as np
import pytest

from tally.audit.core.errors import NotFound
from tally.audit.ledger import lookup
from tally.audit.ledger import queries as q
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.ledger.lookup import LookupIndex, Run
from tests.support.api import write_steps

N = 400


@pytest.fixture(autouse=True)
def runs_on_disk(request, monkeypatch):
    """Every batch's run written at once (no run held in memory), so that these tests see the
    runs and merges on disk that a long ingest makes; the test of the memory tail opts out."""
    if "memory_tail" not in request.keywords:
        monkeypatch.setattr(lookup, "MEMORY_ROWS", 0)


def _stage(spool, stage: int) -> None:
    """Two runs; run r restarts twice (rows of rolled-back attempts stay in the ledger, marked),
    keys beyond N now and then, duplicates (write_steps samples with replacement)."""
    common = {"n": N + 5, "per_step": 16, "flush_every": 3}
    for h in (0, 1):
        if stage == 0:
            write_steps(spool, "r", host=h, hosts=2, steps=range(0, 30), seed=h, **common)
            write_steps(spool, "s", host=h, hosts=2, steps=range(0, 20), seed=50 + h, **common)
        else:
            first, last = ((20, 40), (35, 50))[stage - 1]
            write_steps(spool, "r", host=h, hosts=2, steps=range(first, last),
                        seed=10 * stage + h, attempt=stage, resumed=first, **common)


def _spool(spool) -> None:
    for stage in range(3):
        _stage(spool, stage)


def _answers(ledger: Ledger, index: LookupIndex | None) -> dict:
    cur = ledger.cursor()
    try:
        out = {}
        hashes = [h for (h,) in cur.execute(
            "SELECT DISTINCT content_hash FROM consumption ORDER BY 1 LIMIT 60").fetchall()]
        for run in (1, 2):
            for key in [*range(0, N + 8, 7), 10**12]:
                try:
                    out[run, "key", key] = q.record(cur, run, record_key=key, index=index)
                except NotFound as exc:
                    out[run, "key", key] = str(exc)
            for h in [*hashes, 12345]:
                try:
                    out[run, "hash", h] = q.record(cur, run, content_hash=h, index=index)
                except NotFound as exc:
                    out[run, "hash", h] = str(exc)
        return out
    finally:
        cur.close()


def _check(path, rolled: bool = True) -> LookupIndex:
    """Open the index beside the ledger (as a new process would) and compare with a scan."""
    with Ledger(path) as ledger:
        cur = ledger.cursor()
        index = LookupIndex.open(ledger.path, cur)
        cur.close()
        want, got = _answers(ledger, None), _answers(ledger, index)
        assert got == want
        assert sum(isinstance(v, dict) for v in want.values()) > 50  # lookups that found rows
        assert rolled == any(isinstance(v, dict) and any(s["rolled_back"] for s in v["segments"])
                             for v in want.values())
        return index


@pytest.mark.slow
def test_index_answers_as_a_scan_does_as_it_grows_and_when_behind(tmp_path):
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    for stage in range(3):
        _stage(spool, stage)
        with Ledger(path) as ledger:
            ingest(spool, ledger, batch_rows=200)  # many small batches: many runs to merge
            index = lookup.for_ledger(ledger)
            top = ledger.query("SELECT max(file_id) AS m FROM segments")[0]["m"]
            assert index.coverage.upto == top
        index = _check(path, rolled=stage > 0)
        assert index.coverage.upto == top
        # Few runs (a log-structured merge: fewer than FAN_IN of a size tier), tiling the
        # file ids from the first.
        for runs in index.coverage.runs.values():
            assert runs[0].lo == 0
            assert all(a.hi == b.lo for a, b in zip(runs[:-1], runs[1:], strict=True))
            tiers = [lookup._tier(r) for r in runs]
            assert max(tiers.count(t) for t in tiers) < lookup.FAN_IN, tiers
    # An index behind the ledger (its newest runs lost): the rest is scanned, same answers.
    # A last small ingest (another run's files) leaves a newer run beside the merged ones.
    write_steps(spool, "t", host=0, hosts=1, steps=range(0, 6), seed=99, n=N, flush_every=3)
    with Ledger(path) as ledger:
        ingest(spool, ledger, batch_rows=200)
        top = ledger.query("SELECT max(file_id) AS m FROM segments")[0]["m"]
    newest = max(p for p in (path.parent / "l.duckdb.lookup").iterdir())
    newest.unlink()
    index = _check(path)
    assert 0 < index.coverage.upto < top
    # And the next ingest catches it up.
    with Ledger(path) as ledger:
        ingest(spool, ledger)
        assert lookup.for_ledger(ledger).coverage.upto == top


def test_runs_built_from_the_ingests_columns_equal_runs_read_back_from_the_ledger(
        tmp_path, monkeypatch):
    """The ingest hands the index the columns of the files it just committed (no read back):
    each run holds the codes of the ledger's own rows of its files, exactly, through restarts
    (rows of rolled-back attempts), metric files between segment files and keys beyond the
    manifest."""
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    held = []
    real_held = lookup._held
    monkeypatch.setattr(lookup, "_held", lambda *a: _note(held, real_held(*a)))
    _spool(spool)
    with Ledger(path) as ledger:
        ingest(spool, ledger, batch_rows=200)
        assert sum(g is not None for g in held) > 5  # the columns were used, chunk by chunk
        cur = ledger.cursor()
        try:
            for kind, runs in lookup.for_ledger(ledger).coverage.runs.items():
                assert runs[-1].hi == ledger.query("SELECT max(file_id) m FROM segments")[0]["m"]
                for r in runs:
                    got = lookup._pairs(cur, r.lo, r.hi)
                    want = lookup._codes(kind, np.asarray(got[lookup.KINDS[kind][0]]),
                                         np.asarray(got["file_id"], np.int64), r.lo, r.hi)
                    assert np.array_equal(np.asarray(r.codes), want), (kind, r.lo, r.hi)
        finally:
            cur.close()


def _note(seen: list, value):
    seen.append(value)
    return value


@pytest.mark.parametrize("damage", ["truncated", "garbage", "foreign", "temporary"])
@pytest.mark.slow
def test_a_damaged_or_foreign_index_is_dropped_never_believed(tmp_path, damage):
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    _spool(spool)
    with Ledger(path) as ledger:
        ingest(spool, ledger, batch_rows=300)
    runs = sorted((path.parent / "l.duckdb.lookup").iterdir())
    assert runs
    victim = runs[len(runs) // 2]
    if damage == "truncated":
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size - 5)
    elif damage == "garbage":
        victim.write_bytes(b"\0" * victim.stat().st_size)
    elif damage == "temporary":  # what a writer killed mid-write leaves
        (victim.parent / f".{victim.name}.123.tmp").write_bytes(b"half")
    else:  # the index of another ledger at this path: same names, other contents
        other = tmp_path / "other"
        write_steps(other / "spool", "r", host=0, hosts=1, steps=range(0, 60), seed=99,
                    n=N, per_step=16, flush_every=3)
        with Ledger(other / "l.duckdb") as ledger:
            ingest(other / "spool", ledger, batch_rows=300)
        shutil.rmtree(path.parent / "l.duckdb.lookup")
        shutil.copytree(other / "l.duckdb.lookup", path.parent / "l.duckdb.lookup")
    index = _check(path)  # same answers as a scan whatever it kept
    if damage != "temporary":
        assert index.coverage.upto < max(int(p.name.split("-")[2][:12]) for p in runs)
    assert not [p for p in (path.parent / "l.duckdb.lookup").iterdir()
                if p.name.startswith(".")]
    with Ledger(path) as ledger:  # the next ingest indexes what was dropped
        ingest(spool, ledger)
        assert lookup.for_ledger(ledger).coverage.upto == \
            ledger.query("SELECT max(file_id) AS m FROM segments")[0]["m"]
    _check(path)


def test_a_merge_killed_before_it_removed_its_inputs_counts_nothing_twice(tmp_path):
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    _spool(spool)
    with Ledger(path) as ledger:
        ingest(spool, ledger, batch_rows=200)
    d = path.parent / "l.duckdb.lookup"
    (first,) = [p for p in d.iterdir() if p.name.startswith("key-000000000000-")]
    with Ledger(path) as ledger:
        cur = ledger.cursor()
        owner = lookup._owner(cur)  # runs name their ledger
        cur.close()
    run = lookup._read_run(first, owner)
    # The merge's inputs as they were: the merged run split in two, both kept beside it.
    fids = lookup.file_ids(run, np.asarray(run.codes))
    ids = np.unique(fids)
    mid = int(ids[len(ids) // 2])
    assert 0 < mid < run.hi
    for lo, hi, sel in ((0, mid, fids <= mid), (mid, run.hi, fids > mid)):
        part = Run("key", run.lo, run.hi, 0, 0, run.width, np.asarray(run.codes)[sel], None)
        lookup._write_run(d, "key", lo, hi, 0, lookup._recoded([part], lo, hi), owner)
    index = _check(path)
    assert [r.hi for r in index.coverage.runs["key"]][0] == run.hi  # the widest was kept


@pytest.mark.slow
def test_a_writer_killed_between_the_kinds_leaves_no_gap(tmp_path):
    """catch_up writes the key kind's new run (and merges it) before the hash kind's: a kill in
    between leaves the key runs reaching further, across the hash runs' end, than the hash
    runs. The watermark falls back to where both kinds have whole runs, so nothing between is
    hidden from both the runs and the scan beyond the watermark."""
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    _spool(spool)
    with Ledger(path) as ledger:
        ingest(spool, ledger, batch_rows=200)
    d = path.parent / "l.duckdb.lookup"
    with Ledger(path) as ledger:
        cur = ledger.cursor()
        runs = LookupIndex.open(ledger.path, cur).coverage.runs
        cur.close()
    assert len(runs["key"]) >= 2 and [(r.lo, r.hi) for r in runs["key"]] == \
        [(r.lo, r.hi) for r in runs["hash"]]
    a, b = runs["key"][-2:]
    # The hash kind's newest run never written; the key kind's merged with the one before.
    lookup._path(d, "hash", b.lo, b.hi).unlink()
    lookup._write_run(d, "key", a.lo, b.hi, a.files + b.files,
                      lookup._recoded((a, b), a.lo, b.hi))
    for r in (a, b):
        lookup._path(d, "key", r.lo, r.hi).unlink()
    index = _check(path)  # same answers as a scan
    assert index.coverage.upto == a.lo  # both kinds whole up to there; the rest is scanned


def test_a_lookup_walked_page_by_page_is_the_sql_of_its_definition(tmp_path):
    """The lookup's order, pages, totals and rolled-back marks (worked out in numpy) against
    one plain SQL query each, on a run restarted twice, by key and by content hash."""
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    _spool(spool)
    with Ledger(path) as ledger:
        ingest(spool, ledger, batch_rows=300)
        cur = ledger.cursor()
        index = lookup.for_ledger(ledger)
        hashes = [h for (h,) in cur.execute(
            "SELECT DISTINCT content_hash FROM consumption ORDER BY 1 LIMIT 12").fetchall()]
        asked = [("record_key", k) for k in range(0, N + 5, 37)] + [
            ("content_hash", h) for h in hashes]
        rolled = 0
        for col, val in asked:
            want = cur.execute(f"""
                SELECT c.record_key, c.step, c.host, c.attempt, c.epoch, c."row", c."offset",
                       c.n_tokens, c.content_hash,
                       coalesce(c.step >= a.rolled_back_from_step, false) AS rolled_back
                FROM consumption c JOIN attempts a USING (run, attempt)
                WHERE c.run = 1 AND c.{col} = ?
                ORDER BY c.record_key, c.step, c.host, c.attempt, c."row", c."offset", c.rowid""",
                               [val]).fetchall()
            by_epoch = dict(cur.execute(f"""
                SELECT c.epoch::VARCHAR, count(*) FROM consumption c JOIN attempts a
                USING (run, attempt) WHERE c.run = 1 AND c.{col} = ? AND c."offset" = 0
                AND NOT coalesce(c.step >= a.rolled_back_from_step, false)
                GROUP BY c.epoch ORDER BY c.epoch""", [val]).fetchall())
            if not want:
                continue
            got, cursor, pages = [], None, 0
            while True:
                page = q.record(cur, 1, limit=3, cursor=cursor, index=index,
                                **{col: val})
                assert page["segments_total"] == len(want)
                assert page["exposures_by_epoch"] == by_epoch
                assert page["exposures"] == sum(by_epoch.values())
                assert page["record_keys"] == sorted({r[0] for r in want})
                got += page["segments"]
                pages += 1
                cursor = page["next_cursor"]
                if cursor is None:
                    break
            assert pages == -(-len(want) // 3)
            assert [tuple(s.values()) for s in got] == [
                (*r[:8], f"{r[8]:#018x}", r[9]) for r in want]
            rolled += sum(r[9] for r in want)
        assert rolled > 0
        cur.close()


@pytest.mark.memory_tail
@pytest.mark.slow
def test_runs_held_in_memory_answer_and_reach_disk_when_the_ledger_closes(tmp_path):
    """Below MEMORY_ROWS a run stays in memory, merged there: lookups use it at once, the
    ledger's closing writes it as one run, and a process that ends without closing (a kill)
    leaves nothing on disk for those files, which the next ingest indexes again."""
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    _spool(spool)
    d = path.parent / "l.duckdb.lookup"
    with Ledger(path) as ledger:
        ingest(spool, ledger, batch_rows=200)
        index = lookup.for_ledger(ledger)
        top = ledger.query("SELECT max(file_id) AS m FROM segments")[0]["m"]
        assert index.coverage.upto == top and not any(d.glob("*.run"))
        assert _answers(ledger, index) == _answers(ledger, None)
        ledger._lookup = None  # as if killed: the memory runs are lost, not written
    assert _check(path).coverage.upto == 0  # nothing on disk: every lookup scans
    with Ledger(path) as ledger:
        ingest(spool, ledger)  # no new file; the index catches up from the ledger
        assert lookup.for_ledger(ledger).coverage.upto == top
    index = _check(path)  # written by the close: one run a kind, covering every file
    assert index.coverage.upto == top
    assert [len(t) for t in index.coverage.runs.values()] == [1, 1]


def test_a_batch_committed_while_the_index_lists_files_is_indexed_after_it(tmp_path):
    """The ingester commits beside the index's catch-up. A batch committed right after the
    index listed the files beyond its watermark is indexed by a later listing, never skipped
    nor a failure. (The end of a chunk once came from a query of its own, which saw the new
    batch: with files listed, their rows no longer matched; with none, the watermark moved
    past files never indexed, and their lookups missed rows.)"""
    spool = tmp_path / "spool"
    with _second_index(tmp_path) as (ledger, cur, index):

        class CommitAfterListing:  # the indexer's cursor, a stage committed as it lists files
            def __init__(self, stage: int) -> None:
                self.stage, self.fired = stage, False

            def execute(self, sql, params=None):
                got = cur.execute(sql, params) if params is not None else cur.execute(sql)
                if "FROM segments" in sql and not self.fired:
                    self.fired = True
                    got = _Rows(got.fetchall())
                    _stage(spool, self.stage)
                    ingest(spool, ledger)  # commits on its own cursor, beside this one
                return got

        # First with files listed (the new batch's come after them), then with none listed
        # (the index current when the batch commits).
        for stage in (1, 2):
            before = ledger.query("SELECT max(file_id) AS m FROM segments")[0]["m"]
            proxy = CommitAfterListing(stage)
            index.catch_up(proxy)
            # Stage 1: at least the files listed; stage 2: none listed, the watermark stays.
            assert proxy.fired and (index.coverage.upto >= before if stage == 1
                                    else index.coverage.upto == before)
            while index.catch_up(cur):
                pass
            top = ledger.query("SELECT max(file_id) AS m FROM segments")[0]["m"]
            assert top > before and index.coverage.upto == top
            assert _answers(ledger, index) == _answers(ledger, None)


def test_a_failed_catch_up_leaves_the_cursor_usable_and_the_next_one_indexes_all(tmp_path):
    """A catch-up that fails (a full disk, a read error) ends its read transaction: the same
    cursor catches up next time, and nothing it had listed is skipped."""
    with _second_index(tmp_path) as (ledger, cur, index):

        class FailingRead:
            def execute(self, sql, params=None):
                if "FROM consumption" in sql:
                    raise OSError("read failed")
                return cur.execute(sql, params) if params is not None else cur.execute(sql)

        with pytest.raises(OSError):
            index.catch_up(FailingRead())
        assert index.coverage.upto == 0
        while index.catch_up(cur):  # the same connection: no transaction left open
            pass
        top = ledger.query("SELECT max(file_id) AS m FROM segments")[0]["m"]
        assert index.coverage.upto == top
        assert _answers(ledger, index) == _answers(ledger, None)


@contextlib.contextmanager
def _second_index(tmp_path):
    """A ledger of stage 0, a cursor of it, and an empty index of its own beside the ledger's
    (so that a test drives its catch-up while the ledger's ingest keeps the other)."""
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    _stage(spool, 0)
    with Ledger(path) as ledger:
        ingest(spool, ledger)
        cur = ledger.cursor()
        try:
            yield ledger, cur, LookupIndex(tmp_path / "other.lookup", lookup._owner(cur))
        finally:
            cur.close()


class _Rows:
    def __init__(self, rows: list) -> None:
        self.rows = rows

    def fetchall(self) -> list:
        return self.rows


@pytest.mark.memory_tail
def test_runs_in_memory_before_a_run_on_disk_reach_disk_when_the_ledger_closes(tmp_path,
                                                                              monkeypatch):
    """A catch-up chunk of MEMORY_ROWS or more goes to disk at once, after the runs still held
    in memory (an indexer fallen behind); the closing writes those as their own run, so the
    next process keeps every file indexed (a flush that took the runs on disk to come first
    dropped them and rewrote the disk run: the next open found a gap and indexed it all again)."""
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    monkeypatch.setattr(lookup, "MEMORY_ROWS", 2000)
    _stage(spool, 0)  # 1,600 rows in small batches: runs held (and merged) in memory
    with Ledger(path) as ledger:
        ingest(spool, ledger, batch_rows=200)
        index = lookup.for_ledger(ledger)
        assert not any(r.on_disk for t in index.coverage.runs.values() for r in t)
        for h in (0, 1):  # 3,200 rows more, one chunk: a run on disk after the memory ones
            write_steps(spool, "t", host=h, hosts=2, steps=range(100), seed=70 + h, n=N + 5,
                        per_step=16, flush_every=10)
        ingest(spool, ledger)
        top = ledger.query("SELECT max(file_id) AS m FROM segments")[0]["m"]
        for t in index.coverage.runs.values():  # memory runs, then the chunk's on disk
            assert len(t) > 2 and [r.on_disk for r in t] == [False] * (len(t) - 1) + [True]
    index = _check(path, rolled=False)  # as a new process: nothing to index again
    assert index.coverage.upto == top  # the memory runs as one, then the chunk's
    assert [len(t) for t in index.coverage.runs.values()] == [2, 2]


@pytest.mark.parametrize("kind", ["key", "hash"])
@pytest.mark.parametrize("span", [40, 1 << 24, 1 << 30])
def test_a_runs_codes_name_every_file_that_holds_a_value(kind, span):
    """A run keeps each (value, file) pair as one code: the value's top bits above the file id's.
    Whatever the run's span of file ids (record keys whole up to 2^24 file ids, then their low
    bits dropped; hashes always a prefix), a lookup names every file holding the value, and
    exactly those where the value fits whole; merged runs keep that."""
    rng = np.random.default_rng(span)
    n = 20_000
    values = (rng.integers(0, 1 << 40, n) if kind == "key" else
              rng.integers(0, 2**63, n).astype(np.uint64) * np.uint64(2) + np.uint64(1))
    values[: n // 4] = values[n // 4: n // 2]  # values held by several files
    fids = rng.integers(1, span + 1, n)
    mid = span // 2
    first = fids <= mid
    a = lookup._new_run(None, kind, 0, mid, 1, lookup._codes(kind, values[first], fids[first],
                                                                 0, mid), 0, n, on_disk=False)
    b = lookup._new_run(None, kind, mid, span, 1, lookup._codes(kind, values[~first],
                                                                    fids[~first], mid, span),
                        0, n, on_disk=False)
    whole = lookup._new_run(None, kind, 0, span, 2, lookup._recoded((a, b), 0, span), 0, 2 * n,
                            on_disk=False)
    assert whole.width == (span - 1).bit_length()
    for v in [*values[:300].tolist(), 12345]:
        for run, part in ((a, first), (b, ~first), (whole, slice(None))):
            mine = set(fids[part][values[part] == v].tolist())
            got = set(run.find(int(v)).tolist())
            # Every file that holds it; beyond those, only a prefix shared by chance.
            assert mine <= got and len(got) <= len(mine) + 2, (v, run.width)
            if kind == "key" and run.width <= 24:
                assert got == mine
