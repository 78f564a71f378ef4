"""The service's ingest loop lists a host directory's files only while they can still change:
a settled directory is skipped until its mtime moves, and never settles on one listing."""

import os
import shutil
from pathlib import Path

from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest_loop import IngestLoop
from tests.support.api import write_steps


def test_settled_directories_are_skipped_until_they_change(tmp_path, monkeypatch):
    monkeypatch.setattr("tally.audit.hook.spool.SETTLE_S", 0.0)  # rounds here are ms apart
    batches, rows = [], []
    stage = tmp_path / "stage" / "r" / "attempt=0" / "host=0"
    for i in range(4):  # four batches of published files, staged outside the spool
        # One host's spool written on (a writer continuing it keeps its spool id), each
        # batch's new files set aside to publish.
        rows.append(write_steps(tmp_path / "stage", "r", host=0, hosts=1,
                                steps=range(5 * i, 5 * i + 5), n=100, seed=i, flush_every=2))
        held = tmp_path / f"stage{i}"
        held.mkdir()
        seen = {f.name for batch in batches for f in batch}
        batches.append([Path(shutil.copy2(f, held / f.name)) for f in sorted(stage.iterdir())
                        if f.name not in seen])
    live = tmp_path / "spool" / "r" / "attempt=0" / "host=0"
    live.mkdir(parents=True)

    def publish(i: int, keep_mtime: bool = False) -> None:
        before = live.stat()
        (live / ".seg-tmp").unlink(missing_ok=True)  # the writer's temporary, renamed
        for f in batches[i]:
            shutil.move(f, live / f.name)
        if keep_mtime:  # as if all this happened within the tick of the last change
            os.utime(live, ns=(before.st_atime_ns, before.st_mtime_ns))

    with Ledger(tmp_path / "l.duckdb") as ledger:
        loop = IngestLoop(ledger, tmp_path / "spool")

        def ingested() -> int:
            return ledger.query("SELECT count(*) AS n FROM consumption")[0]["n"]

        publish(0)
        loop.run_once()
        assert ingested() == rows[0]
        loop.run_once()  # listed again, same mtime, nothing pending: settled
        # A writer's temporary file moves the mtime; a listing then finds nothing new. Its
        # rename within the same tick would leave that mtime: one listing must not settle.
        (live / ".seg-tmp").write_bytes(b"")
        loop.run_once()
        publish(1, keep_mtime=True)
        loop.run_once()
        assert ingested() == sum(rows[:2]), "a directory settled on one listing"
        loop.run_once()  # settled again
        publish(2, keep_mtime=True)
        loop.run_once()
        assert ingested() == sum(rows[:2]), "a settled directory was listed"
        publish(3)  # a real publish moves the mtime: listed again, nothing left behind
        loop.run_once()
        assert ingested() == sum(rows)


def test_listings_less_than_a_tick_apart_do_not_settle(tmp_path):
    # Default SETTLE_S: two listings milliseconds apart may share the coarsest file systems'
    # timestamp tick, so the directory stays listed.
    stage = tmp_path / "stage"
    rows = write_steps(stage, "r", host=0, hosts=1, steps=range(5), n=100, seed=0)
    live = tmp_path / "spool" / "r" / "attempt=0" / "host=0"
    live.mkdir(parents=True)
    with Ledger(tmp_path / "l.duckdb") as ledger:
        loop = IngestLoop(ledger, tmp_path / "spool")
        loop.run_once()
        loop.run_once()
        before = live.stat()
        for f in (stage / "r" / "attempt=0" / "host=0").iterdir():
            shutil.move(f, live / f.name)
        os.utime(live, ns=(before.st_atime_ns, before.st_mtime_ns))
        loop.run_once()
        assert ledger.query("SELECT count(*) AS n FROM consumption")[0]["n"] == rows


def test_quarantined_files_and_full_listings_keep_late_files_in_view(tmp_path, monkeypatch):
    monkeypatch.setattr("tally.audit.hook.spool.SETTLE_S", 0.0)
    stage = tmp_path / "stage"
    rows = write_steps(stage, "r", host=0, hosts=1, steps=range(5), n=100, seed=0,
                       flush_every=5)
    good = sorted((stage / "r" / "attempt=0" / "host=0").glob("seg-*.parquet"))[0]
    first = set((stage / "r" / "attempt=0" / "host=0").iterdir())
    # Written on in the same host spool (its writer keeps the spool id), set aside to publish.
    late = write_steps(stage, "r", host=0, hosts=1, steps=range(5, 9), n=100, seed=1,
                       flush_every=4)
    live = tmp_path / "spool" / "r" / "attempt=0" / "host=0"
    live.mkdir(parents=True)
    (live / good.name).write_bytes(b"not parquet")
    with Ledger(tmp_path / "l.duckdb") as ledger:
        loop = IngestLoop(ledger, tmp_path / "spool")

        def ingested() -> int:
            return ledger.query("SELECT count(*) AS n FROM consumption")[0]["n"]

        for _ in range(3):
            loop.run_once()
        assert (ingested(), loop.quarantined) == (0, 1)
        # Fixed in place: same name, the directory's mtime unchanged. Still listed, because
        # a directory holding a quarantined file never settles.
        (live / good.name).write_bytes(good.read_bytes())
        loop.run_once()
        assert ingested() == rows
        loop.run_once()
        loop.run_once()  # settled now
        # A directory whose mtime does not move (as on some FUSE mounts): the periodic full
        # listing still finds what appears in it.
        before = live.stat()
        for f in set((stage / "r" / "attempt=0" / "host=0").iterdir()) - first:
            shutil.move(f, live / f.name)
        os.utime(live, ns=(before.st_atime_ns, before.st_mtime_ns))
        loop.run_once()
        assert ingested() == rows
        monkeypatch.setattr("tally.audit.hook.spool.FULL_LISTING_S", 0.0)
        loop.run_once()
        assert ingested() == rows + late


def test_ingested_files_are_stat_ed_a_slice_a_round_and_another_file_there_is_found(
        tmp_path, monkeypatch):
    """Listings leave ingested names out by name (no stat: 8 s a full listing at 512,000
    files before); a sweep stats them at most SWEEP_FILES a round, every one in turn, so a file
    rewritten in place (its directory's mtime unmoved) still reaches ingest, once."""
    monkeypatch.setattr("tally.audit.hook.spool.SETTLE_S", 0.0)
    monkeypatch.setattr("tally.audit.hook.spool.FULL_LISTING_S", 0.0)  # no pacing
    spool = tmp_path / "spool"
    rows = sum(write_steps(spool, "r", host=h, hosts=2, steps=range(8), n=50, seed=h,
                           flush_every=1) for h in range(2))
    files = sorted(spool.rglob("*.parquet"))
    budget = 5
    with Ledger(tmp_path / "l.duckdb") as ledger:
        loop = IngestLoop(ledger, spool)
        monkeypatch.setattr(loop, "SWEEP_FILES", budget)

        def ingested() -> int:
            return ledger.query("SELECT count(*) AS n FROM consumption")[0]["n"]

        loop.run_once()
        assert (ingested(), loop.swept) == (rows, 0)
        victim = files[len(files) // 2]
        before = victim.parent.stat()
        victim.write_bytes(b"not parquet")
        os.utime(victim.parent, ns=(before.st_atime_ns, before.st_mtime_ns))
        passes = -(-len(files) // budget)
        for _ in range(passes):
            swept = loop.swept
            loop.run_once()
            assert loop.swept - swept <= budget
        assert loop.swept >= len(files)  # every ingested file stat-ed once in those rounds
        assert loop.quarantined == 1
        row = ledger.query("SELECT path, reason FROM quarantine")
        assert [r["path"] for r in row] == [victim.relative_to(spool).as_posix()]
        assert row[0]["reason"].startswith("a different file at a path already ingested")
        for _ in range(passes):  # sent once: later passes find it as they left it
            loop.run_once()
        assert (loop.quarantined, ingested()) == (1, rows)
