"""Restart from a snapshot of the per-record state (tally.audit.ledger.snapshot): the state it gives
equals a rebuild from the ledger, a snapshot behind the ledger catches up (restarts included),
an unusable one is ignored with one log line, and a kill -9 of a real process while it writes
one leaves the previous snapshot or none."""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import time

import httpx
import numpy as np
import pytest

from tally.api.app import create_app
from tally.audit.ledger.aggregates import Aggregates
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.ledger.snapshot import Applied, open_snapshot, write_snapshot
from tally.audit.ledger.state import COMPACT
from tests.support.api import Server, free_port, poll, write_steps
from tests.support.cli import tally_popen
from tests.test_api_aggregates import N, assert_same_state, check

COMMON = {"n": N + 3, "flush_every": 4}  # keys N.. are outside the train universe
STAGES = [  # (host, steps, seed, attempt, resumed_from_step)
    *((h, range(0, 30), h, 0, None) for h in (0, 1)),
    *((h, range(20, 40), 10 + h, 1, 20) for h in (0, 1, 2)),  # attempt 0's steps >= 20 roll back
    (2, range(0, 30), 2, 0, None),  # attempt 0's host 2 arrives late: steps < 20 count
    *((h, range(35, 45), 20 + h, 2, 35) for h in (0, 1, 2)),  # attempt 1's steps >= 35 roll back
]


def publish(spool, stages) -> None:
    for host, steps, seed, attempt, resumed in stages:
        write_steps(spool, "r", host=host, hosts=3, steps=steps, seed=seed, attempt=attempt,
                    resumed=resumed, **COMMON)


def same_state(a: Aggregates, b: Aggregates) -> None:
    """Every run's per-record state equal, field by field (rows never seen read as such)."""
    assert set(a.runs) == set(b.runs)
    for run in a.runs:
        assert_same_state(a.runs[run], b.runs[run])


def loaded(path, caplog) -> tuple[Aggregates, list[str]]:
    """The state as a new process loads it, and what it logged about it."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tally.state"), Ledger(path) as ledger:
        agg = Aggregates.load(ledger)
        rebuilt = Aggregates.load(ledger, use_snapshots=False)
    same_state(agg, rebuilt)
    return agg, [r.getMessage() for r in caplog.records if r.name == "tally.state"]


def test_a_restart_from_a_snapshot_behind_the_ledger_catches_up_and_answers_alike(
        tmp_path, caplog):
    spool, path = tmp_path / "spool", tmp_path / "ledger.duckdb"
    publish(spool, STAGES[:2])
    with Ledger(path) as ledger:
        ingest(spool, ledger, final=True)  # the state was built here: its snapshot is due
    snap = path.with_name("ledger.duckdb.state") / "run-1.state"
    assert snap.exists()
    first = snap.read_bytes()

    # Attempt 1 resumes from step 20 and host 2's attempt-0 files arrive late; the process
    # that ingests them restores the snapshot and leaves it behind (too few rows since).
    publish(spool, STAGES[2:6])
    with Ledger(path) as ledger:
        ingest(spool, ledger)
    assert snap.read_bytes() == first
    agg, said = loaded(path, caplog)
    assert len(said) == 1 and "restored from its snapshot" in said[0], said
    assert agg.snapshots.saved[1].applied.lineage == {0: None}  # behind: lineage caught up

    # Served from the restored state, and ingesting on top of it (attempt 2 rolls back
    # attempt 1's steps >= 35): every aggregate endpoint agrees with SQL.
    with Ledger(path) as ledger, Server(create_app(ledger, records=N)) as srv:
        check(srv, ledger, "r")
        publish(spool, STAGES[6:])
        ingest(spool, ledger)
        check(srv, ledger, "r")
    # A clean stop with the lineage moved wrote a new snapshot: it loads alike, up to date.
    agg, said = loaded(path, caplog)
    assert snap.read_bytes() != first and "and 0 rows ingested after it" in said[0], said


def _corrupt(path):
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 48)


def _rewritten(extra: dict | None = None, **change):
    """A snapshot with the same rows and a header (or maps) that says something else."""
    def do(path, ledger_path, other_ledger_id=None):
        with Ledger(ledger_path) as ledger:
            agg = Aggregates.load(ledger)
            applied = Applied.now(ledger.cursor(), 1)
            st = agg.runs[1]
            fields = {"max_file_id": applied.max_file_id, "seg_files": applied.seg_files,
                      "files_digest": applied.files_digest, "lineage": applied.lineage}
            fields.update(change)
            write_snapshot(path.parent, 1, "r", other_ledger_id or ledger.ledger_id,
                           st.data[: st.top + 1], st.top, Applied(**fields),
                           None if extra is None else {**st.extra(), **extra})
    return do


SPOILED = [("corrupt", "checksum mismatch"), ("truncate", "truncated snapshot"),
           ("garbage", "not a snapshot"), ("foreign", "snapshot of another ledger"),
           ("lineage", "another restart lineage"), ("files", "does not hold the files"),
           ("layout", "unreadable snapshot maps")]


def test_an_unusable_snapshot_is_ignored_with_one_line_and_rebuilt(tmp_path, caplog):
    spool, path = tmp_path / "spool", tmp_path / "ledger.duckdb"
    publish(spool, STAGES[:5])
    with Ledger(path) as ledger:
        ingest(spool, ledger, final=True)
    snap = tmp_path / "ledger.duckdb.state" / "run-1.state"
    good = snap.read_bytes()
    for spoil, reason in SPOILED:
        snap.write_bytes(good)
        if spoil == "corrupt":  # one bit of one row
            _corrupt(snap)
        elif spoil == "truncate":
            _truncate(snap)
        elif spoil == "garbage":
            snap.write_bytes(b"\0" * 4096)
        elif spoil == "foreign":
            _rewritten()(snap, path, other_ledger_id="0" * 32)
        elif spoil == "lineage":  # attempt 0 cut at step 5: never so in this ledger
            _rewritten(lineage={0: 5, 1: None})(snap, path)
        elif spoil == "files":  # it says it covers a file the ledger does not hold
            _rewritten(seg_files=999)(snap, path)
        else:  # its rows in a host layout this Tally does not have (a checksum that holds)
            _rewritten(extra={"host_slots": np.array([3], np.int64)})(snap, path)
        agg, said = loaded(path, caplog)  # equal to a rebuild (checked there)
        assert len(said) == 1 and "rebuilt from the ledger" in said[0], said
        assert reason in said[0], (spoil, said)
    with Ledger(path) as ledger, Server(create_app(ledger, records=N)) as srv:
        check(srv, ledger, "r")
    # The clean stop of a service whose state was rebuilt wrote a good one again.
    agg, said = loaded(path, caplog)
    assert len(said) == 1 and "restored from its snapshot" in said[0], said


def test_a_service_that_rebuilt_its_state_snapshots_it_while_it_runs(tmp_path, caplog):
    """Nothing new in the spool: the ingester's idle round still writes the snapshot of a
    state just rebuilt (a kill later would otherwise rebuild it again), without new rows."""
    spool, path = tmp_path / "spool", tmp_path / "ledger.duckdb"
    publish(spool, STAGES[:3])
    with Ledger(path) as ledger:
        ingest(spool, ledger)
    snapshots = tmp_path / "ledger.duckdb.state"
    shutil.rmtree(snapshots)
    with Ledger(path) as ledger, Server(create_app(ledger, spool=spool, records=N,
                                                   interval=0.05)) as srv:
        assert poll(lambda: (snapshots / "run-1.state").exists(), timeout=30)
        check(srv, ledger, "r")
        files = ledger.query("SELECT count(*) AS n FROM segments")[0]["n"]
    with Ledger(path) as ledger:  # the service ingested nothing: the same files
        assert ledger.query("SELECT count(*) AS n FROM segments")[0]["n"] == files
    agg, said = loaded(path, caplog)
    assert len(said) == 1 and "restored from its snapshot" in said[0], said


def test_a_ledger_made_before_ledger_ids_gets_one_and_snapshots(tmp_path, caplog):
    """Ledgers made before ledgers had an id (same schema version) open as before and get
    one; a read-only opening does not need it."""
    spool, path = tmp_path / "spool", tmp_path / "ledger.duckdb"
    publish(spool, STAGES[:2])
    with Ledger(path) as ledger:
        ingest(spool, ledger)
        ledger.con.execute("DELETE FROM meta WHERE key = 'ledger_id'")
    shutil.rmtree(tmp_path / "ledger.duckdb.state")
    with Ledger(path, read_only=True) as ledger:
        assert ledger.ledger_id is None and ledger.overview()["runs"]
    with Ledger(path) as ledger:
        assert len(ledger.ledger_id) == 32
        ingest(spool, ledger, final=True)
    agg, said = loaded(path, caplog)
    assert "restored from its snapshot" in said[0], said


PAUSED = {"TALLY_SNAPSHOT_TEST_PAUSE_S": "0.3", "TALLY_SNAPSHOT_ROWS": "1",
          "TALLY_SNAPSHOT_SECONDS": "0"}


def _kill_at(child: subprocess.Popen, step: str) -> list[str]:
    """SIGKILL the child when its snapshot write logs `step`; the lines it logged."""
    seen = []
    try:
        for line in child.stderr:
            seen.append(line.strip())
            if f"snapshot write: {step}" in line:
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert any(step in s for s in seen), seen
    return seen


@pytest.mark.slow
def test_kill_9_while_a_snapshot_is_written_leaves_the_old_one_or_none(tmp_path, caplog):
    """`tally ingest` killed at each step of its snapshot write (paused there): before the
    rename the previous snapshot is untouched (none at the first write), after it the new one
    is whole; the next start restores or rebuilds, exactly."""
    spool, path = tmp_path / "spool", tmp_path / "ledger.duckdb"
    snap = tmp_path / "ledger.duckdb.state" / "run-1.state"
    publish(spool, STAGES[:1])
    child = tally_popen("ingest", str(spool), "--ledger", str(path), env=PAUSED)
    _kill_at(child, "rows to")  # the very first snapshot, half written
    assert not snap.exists()
    agg, said = loaded(path, caplog)
    assert "rebuilt from the ledger (no snapshot)" in said[0], said
    with Ledger(path) as ledger:
        ingest(spool, ledger, final=True)  # nothing new; the rebuilt state's snapshot is due
    previous = snap.read_bytes()
    for stage, step in zip(STAGES[1:5], ("begun", "rows to", "synced", "renamed"),
                           strict=True):
        publish(spool, [stage])
        _kill_at(tally_popen("ingest", str(spool), "--ledger", str(path), env=PAUSED), step)
        with Ledger(path) as ledger:
            opened = open_snapshot(snap, ledger_id=ledger.ledger_id, run=1, run_id="r",
                                   dtype=COMPACT, cur=ledger.cursor())
            behind = opened.applied.max_file_id
            newest = ledger.query("SELECT max(file_id) AS f FROM segments "
                                  "WHERE kind = 'seg'")[0]["f"]
        del opened
        if step == "renamed":
            assert behind == newest  # the new one, whole
        else:
            assert snap.read_bytes() == previous and behind < newest  # untouched
        # The killed write's temporary file, if it was not renamed yet (each write removes
        # the one before).
        left = list(snap.parent.glob(".run-1.*.tmp"))
        assert len(left) == (0 if step == "renamed" else 1), left
        agg, said = loaded(path, caplog)
        assert "restored from its snapshot" in said[0], said
        previous = snap.read_bytes()
    # The next write clears the killed writes' leftovers.
    with Ledger(path) as ledger:
        Aggregates.load(ledger).save(ledger, final=True)
    assert not list(snap.parent.glob(".*"))


@pytest.mark.slow
def test_kill_9_of_tally_serve_mid_snapshot_then_it_serves_the_same_numbers(tmp_path):
    """A real `tally serve` ingesting the spool, killed while it writes a snapshot; the next
    `tally serve` restores it and answers exactly what a server that rebuilt the state
    answers, diff between two runs included."""
    spool, path = tmp_path / "spool", tmp_path / "ledger.duckdb"
    publish(spool, STAGES[:2])
    for h in (0, 1):
        write_steps(spool, "s", host=h, hosts=2, steps=range(0, 30), seed=40 + h, **COMMON)
    first = tally_popen("ingest", str(spool), "--ledger", str(path), "-q")
    assert first.wait(60) == 0, first.stderr.read()
    publish(spool, STAGES[2:6])
    port = free_port()
    serve = ("serve", "--ledger", str(path), "--records", str(N), "--port", str(port),
             "--log-level", "info")
    run = tally_popen(*serve, "--spool", str(spool), "--interval", "0.05", env=PAUSED)
    seen = _kill_at(run, "rows to")
    assert any("restored from its snapshot" in s for s in seen), seen

    urls = ["/v1/runs/r", "/v1/runs/r/coverage", "/v1/runs/r/coverage?step=25",
            "/v1/runs/r/steps?bucket=1", "/v1/runs/r/hosts", "/v1/diff?a=r&b=s&points=50"]

    def get(base: str) -> dict:
        out = {u: httpx.get(base + u, timeout=30).json() for u in urls}
        for a in out.values():  # what differs between two servers, whatever their state
            if isinstance(a, dict):
                a.pop("ingest_lag_seconds", None)
        return out

    run = tally_popen(*serve)
    try:
        assert poll(lambda: _up(f"http://127.0.0.1:{port}"), timeout=60), run.stderr.read()
        restored = get(f"http://127.0.0.1:{port}")
    finally:
        run.send_signal(signal.SIGTERM)
        _, said = run.communicate(timeout=60)
    assert "restored from its snapshot" in said and "rebuilt" not in said, said
    assert restored["/v1/runs/r"]["rows_ingested"] > 0
    # The same answers from a state rebuilt from the ledger.
    with Ledger(path) as ledger:
        ledger._aggregates = Aggregates.load(ledger, use_snapshots=False)
        with Server(create_app(ledger, records=N)) as srv:
            assert get(srv.url) == restored


def _up(base: str) -> bool:
    try:
        return httpx.get(base + "/healthz", timeout=5).status_code == 200
    except httpx.TransportError:
        time.sleep(0.1)
        return False


@pytest.mark.parametrize("how", ["direct", "no O_DIRECT here", "refused at the first write"])
def test_a_file_written_past_the_page_cache_is_byte_for_byte_what_was_written(
        tmp_path, monkeypatch, how):
    """`Uncached` (the snapshot's writer): writes of every size, across its buffer's edge and
    ending mid-block, give the same bytes as a plain file; where O_DIRECT does not exist, or
    the kernel refuses the first direct write (here: a buffer of 1000 bytes, not whole
    blocks, EINVAL for real), the same writes go through the cache."""
    from tally.audit.core import paths
    from tally.audit.core.paths import Uncached, atomic_write

    if how == "no O_DIRECT here":
        monkeypatch.delattr(paths.os, "O_DIRECT", raising=False)
    elif how == "refused at the first write":
        monkeypatch.setattr(paths, "DIRECT_BUFFER", 1000)
    rng = np.random.default_rng(7)
    block, buffer = paths.DIRECT_BLOCK, paths.DIRECT_BUFFER
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in
             (10, block - 10, buffer - 1, 3, buffer * 2 + 5, 0, 777)]
    final = tmp_path / "out.bin"
    with atomic_write(final, tmp_path / ".out.tmp", page_cache=False) as f:
        assert isinstance(f, Uncached)
        for p in parts:
            f.write(p)
        assert (f.buf is not None) == (how == "direct")  # past the cache only where allowed
    assert final.read_bytes() == np.concatenate(parts).tobytes()
    assert not (tmp_path / ".out.tmp").exists()
    with Uncached(tmp_path / "again.bin") as f:
        f.write(b"x" * 5)
        f.flush()
        if how == "direct":
            with pytest.raises(ValueError, match="after its last block"):
                f.write(b"y")  # its padded last block is on disk: it would land after it
    assert (tmp_path / "again.bin").read_bytes() == b"xxxxx"
    with pytest.raises(FileNotFoundError):  # a real fault is not taken for a refusal
        Uncached(tmp_path / "no such directory" / "x.bin")
