"""The ledger writer: spool files, flush policy, back-pressure, error hand-over, round trip."""

import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from tally.audit.core.hashing import content_hash
from tally.audit.hook import spool as sp
from tally.audit.hook.segments import Segments, segments_from_batch
from tally.audit.hook.writer import LedgerWriter, WriterError, publish
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tests.support.batches import record_tokens, unpacked_batch
from tests.support.processes import popen_py


def _published(spool):
    return [f for f, _ in sp.scan(spool) if isinstance(f, sp.SpoolFile)]


def test_round_trip_writer_spool_ingest_holds_exactly_the_rows_written(spool, tmp_path):
    expected = []
    with LedgerWriter(spool, "rt", host=1, host_count=2, records_per_epoch=1000,
                      manifest_fingerprint="fp1", flush_every=7) as w:
        for step in range(50):
            b = unpacked_batch(step, host=1, hosts=2)
            w.write_batch(step, b)
            s = segments_from_batch(b, records_per_epoch=1000)
            expected += [(step, 1, int(s.row[i]), int(s.record_key[i]), int(s.offset[i]),
                          int(s.n_tokens[i]), int(s.content_hash[i]), int(s.epoch[i]))
                         for i in range(len(s))]
            w.log_metric(step, "train_loss", 1.0 / (step + 1))
    files = _published(spool)
    # 50 steps at 7 per file -> 8 segment files, plus metric files published alongside.
    assert len([f for f in files if f.kind == "seg"]) == 8
    assert all(f.run_id == "rt" and f.host == 1 and f.attempt == 0 for f in files)
    md = pq.read_schema(files[0].path).metadata
    assert md[b"tally.host_count"] == b"2" and md[b"tally.manifest_fingerprint"] == b"fp1"
    assert md[b"tally.records_per_epoch"] == b"1000"

    with Ledger(tmp_path / "l.duckdb") as ledger:
        res = ingest(spool, ledger)
        assert res.quarantined == [] and res.rows == len(expected) + 50
        got = ledger.cursor().execute(
            'SELECT step, host, "row", record_key, "offset", n_tokens, content_hash, epoch '
            'FROM consumption ORDER BY step, "row"').fetchall()
        assert got == sorted(expected)
        metrics = ledger.cursor().execute(
            "SELECT step, value FROM metrics WHERE name = 'train_loss' ORDER BY step").fetchall()
        assert metrics == [(s, 1.0 / (s + 1)) for s in range(50)]
        assert ledger.query("SELECT manifest_fingerprint FROM runs") == [
            {"manifest_fingerprint": "fp1"}]


def test_segment_hashes_match_the_records_tokens(spool):
    with LedgerWriter(spool, "h", records_per_epoch=1000) as w:
        w.write_batch(0, unpacked_batch(0))
    t = pq.read_table(_published(spool)[0].path)
    for key, n, h in zip(t["record_key"].to_pylist(), t["n_tokens"].to_pylist(),
                         t["content_hash"].to_pylist(), strict=True):
        assert h == content_hash(record_tokens(key)[:n])


def test_flush_publishes_on_demand_and_durable_step_follows(spool):
    w = LedgerWriter(spool, "f", flush_every=1000)
    for step in range(5):
        w.write_batch(step, unpacked_batch(step))
    assert w.durable_step is None
    w.flush()  # e.g. before a checkpoint is written
    assert w.durable_step == 4
    assert [f.first_step for f in _published(spool)] == [0]
    w.write_batch(5, unpacked_batch(5))
    w.close()
    assert w.durable_step == 5
    assert [f.first_step for f in _published(spool)] == [0, 5]
    with pytest.raises(WriterError, match="closed"):
        w.write_batch(6, unpacked_batch(6))


def test_time_based_flush_publishes_without_more_steps(spool):
    import time
    w = LedgerWriter(spool, "t", flush_every=1000, flush_seconds=0.2)
    w.write_batch(0, unpacked_batch(0))
    deadline = time.monotonic() + 10
    while w.durable_step is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w.durable_step == 0
    w.close()


def test_backpressure_never_drops_rows(spool, tmp_path):
    # A queue of one item and 200 large steps: the loop must wait, never drop.
    big = {"tokens": np.random.default_rng(0).integers(0, 9, (64, 2048), dtype=np.int32),
           "key": np.arange(64, dtype=np.int64)}
    with LedgerWriter(spool, "bp", queue_size=1, flush_every=50) as w:
        for step in range(200):
            w.write_batch(step, big)
    with Ledger(tmp_path / "l.duckdb") as ledger:
        ingest(spool, ledger)
        assert ledger.query("SELECT count(*) AS n, count(DISTINCT step) AS s FROM consumption") \
            == [{"n": 200 * 64, "s": 200}]


def test_bad_batch_is_raised_on_the_next_call(spool):
    w = LedgerWriter(spool, "bad")
    w.write_batch(0, {"tokens": np.ones((2, 3), np.int32)})  # no 'key'
    with pytest.raises(WriterError, match="'key'"):
        w.flush()
    w.close()


def test_write_error_is_raised_and_rows_survive_a_retry(spool, tmp_path):
    w = LedgerWriter(spool, "disk", flush_every=1000)
    for step in range(3):
        w.write_batch(step, unpacked_batch(step))
    # Make publishing fail: the host directory disappears behind a plain file.
    shutil.rmtree(w.dir)
    w.dir.write_text("not a directory")
    with pytest.raises(WriterError, match="failed"):
        w.flush()
    w.write_batch(3, unpacked_batch(3))  # the error was handed over once; the loop goes on
    w.dir.unlink()
    w.dir.mkdir()
    w.close()  # retry publishes everything buffered, nothing lost
    with Ledger(tmp_path / "l.duckdb") as ledger:
        ingest(spool, ledger)
        assert ledger.query("SELECT count(DISTINCT step) AS s, count(*) AS n FROM consumption") \
            == [{"s": 4, "n": 16}]


def test_precomputed_segments_and_resume_metadata(spool, tmp_path):
    segs = Segments.build(row=[0, 0], record_key=[3, 4], offset=[0, 5], n_tokens=[5, 2],
                          epoch=[0, 0], content_hash=[11, 12])
    with LedgerWriter(spool, "pre", attempt=2, resumed_from_step=10, host_count=1) as w:
        w.write_segments(10, segs)
    f = _published(spool)[0]
    assert (f.attempt, f.first_step) == (2, 10)
    md = pq.read_schema(f.path).metadata
    assert md[b"tally.resumed_from_step"] == b"10"


def test_invalid_arguments_are_refused(spool):
    with pytest.raises(ValueError, match="outside"):
        LedgerWriter(spool, "x", host=2, host_count=2)
    with pytest.raises(ValueError, match="resumed_from_step"):
        LedgerWriter(spool, "x", attempt=1)
    with pytest.raises(ValueError, match="run id"):
        LedgerWriter(spool, "../evil")


def test_a_reused_run_id_or_a_restart_within_an_attempt_is_refused(spool):
    with LedgerWriter(spool, "again", host=1, host_count=2) as w:
        w.write_batch(0, unpacked_batch(0))
        w.write_batch(1, unpacked_batch(1))
    # Another host of the same job starting attempt 0 later is fine, and so is a new writer
    # of host 1 that goes on with later steps.
    LedgerWriter(spool, "again", host=0, host_count=2).close()
    with LedgerWriter(spool, "again", host=1, host_count=2) as w:
        w.write_batch(2, unpacked_batch(2))
    # Host 1 writing a step of attempt 0 again: the run id is reused (or the host restarted
    # without resuming); its rows would count twice.
    w = LedgerWriter(spool, "again", host=1, host_count=2)
    with pytest.raises(WriterError, match="run again already has a spool: host 1 published "
                                          "steps up to 2 of attempt 0; step 0 again .* resume"):
        w.write_batch(0, unpacked_batch(0))
    w.close()
    with LedgerWriter(spool, "again", host=1, host_count=2, attempt=1,
                      resumed_from_step=1) as w:
        w.write_batch(1, unpacked_batch(1))
        with pytest.raises(WriterError, match="never go back"):
            w.write_batch(0, unpacked_batch(0))
    assert [(f.attempt, f.first_step) for f in _published(spool)] == [(0, 0), (0, 2), (1, 1)]


TWIN = """
import os, sys, time
import numpy as np
from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter, WriterError
spool, me, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
w = LedgerWriter(spool, "twin", host=0, host_count=2, flush_every=1, fsync=False)
print("spool_id", w.spool_id, flush=True)
try:
    for step in range(40):
        keys = np.arange(64) + me * 10_000 + step * 64
        w.write_segments(step, Segments.build(row=np.arange(64), record_key=keys,
                                              n_tokens=np.full(64, 8), content_hash=keys))
    w.close()
    print("done", flush=True)
except WriterError as exc:
    print("refused", exc, flush=True)
"""


def test_two_writers_claiming_one_host_never_corrupt_nor_replace_a_file(tmp_path):
    """Two processes that both believe they are host 0 (a rank taken from LOCAL_RANK on two
    nodes, a run relaunched while it still runs), started at the same moment: they publish
    the same file names. At least one is refused ("two writers for one host?"); every file
    published is whole and holds one writer's rows under that writer's spool id, and the
    ledger takes them all. Both once wrote one shared temporary file, and the first to rename
    it published the other's bytes in it too: a file no reader could open."""
    spool, go = tmp_path / "spool", tmp_path / "go"
    for trial in range(3):
        shutil.rmtree(spool, ignore_errors=True)
        go.unlink(missing_ok=True)
        twins = [popen_py(TWIN, str(spool), str(me), str(go)) for me in (0, 1)]
        assert [t.stdout.readline() for t in twins] == ["ready\n"] * 2  # imported, waiting
        go.touch()
        said = [t.communicate(timeout=120) for t in twins]
        assert [t.returncode for t in twins] == [0, 0], said
        ids = {me: out.split()[1] for me, (out, _) in enumerate(said)}
        # Refused at a name the other published first, or (one started late, after the other
        # published) at its first step, which that host's spool already holds.
        refused = [out for out, _ in said if "refused" in out]
        assert refused and all("two writers for one host?" in out or "already has a spool"
                               in out for out in refused), said
        files = _published(spool)
        rows = 0
        for f in files:
            t = pq.read_table(f.path)  # whole: a torn file raises here
            if f.kind != "seg":
                continue
            writers = set((t["record_key"].to_numpy() // 10_000).tolist())
            assert len(writers) == 1, (f.name, writers)
            me = writers.pop()
            assert t.schema.metadata[b"tally.spool_id"].decode() == ids[me]
            rows += t.num_rows
        with Ledger(tmp_path / f"l{trial}.duckdb") as ledger:
            res = ingest(spool, ledger)
            assert res.quarantined == [] and res.rows == rows


def test_a_file_system_without_hard_links_still_publishes_and_refuses_a_taken_name(
        spool, monkeypatch):
    """Where `os.link` is refused (EPERM: some FUSE and object-store mounts), a spool file is
    published by rename after a check: the writer works, and a name already published is
    still refused, never replaced."""
    import errno
    import os

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted", str(dst))

    monkeypatch.setattr(os, "link", no_links)
    with LedgerWriter(spool, "nolink", flush_every=1, fsync=False) as w:
        w.write_batch(0, unpacked_batch(0))
        w.write_batch(1, unpacked_batch(1))
    files = _published(spool)
    assert [f.first_step for f in files if f.kind == "seg"] == [0, 1]
    first = files[0].path.read_bytes()
    table = pq.read_table(files[0].path)
    with pytest.raises(FileExistsError, match="two writers for one host"):
        publish(files[0].path.parent, "seg", table, {"run_id": "nolink"}, 0, 0, fsync=False)
    assert files[0].path.read_bytes() == first
    assert not list(files[0].path.parent.glob(".*"))  # the refused temporary is gone


@pytest.mark.parametrize("bad, match", [
    (dict(host=0, host_count=0), "host_count 0 is outside"),
    (dict(host=0, host_count=65_537), "host_count 65537 is outside"),
    (dict(host=4, host_count=4), "host 4 is outside 0..3"),
    (dict(host=-1, host_count=4), "host -1 is outside"),
    (dict(records_per_epoch=0), "records_per_epoch 0 is outside"),
    (dict(records_per_epoch=2**41), "records_per_epoch .* is outside"),
    (dict(attempt=1, resumed_from_step=-5), "resumed_from_step -5 is outside"),
])
def test_the_writer_refuses_values_outside_the_contract(spool, bad, match):
    with pytest.raises(WriterError, match=match):
        LedgerWriter(spool, "bounds", **bad)
    assert not (spool / "bounds").exists()


def test_a_listing_kept_between_rounds_lists_what_a_fresh_scan_lists(spool):
    """`Listing` (the live reconcile's, round after round) reuses what it stat-ed and parsed
    before, yet lists what `scan` lists: `update` gives what changed since its last listing
    (files new, every stray looked at again, files gone), `entries` the files listed."""
    def both():
        fresh = [(f, st.st_size) for f, st in sp.scan(spool)]
        found, gone = changes.update()
        now = {f.rel for f, _ in fresh if isinstance(f, sp.SpoolFile)}
        assert {f.rel for f, _ in found if isinstance(f, sp.SpoolFile)} == now - last[0]
        assert set(gone) == last[0] - now and len(gone) == len(set(gone))
        assert [x for x in found if isinstance(x[0], sp.Stray)] == \
            [x for x in fresh if isinstance(x[0], sp.Stray)]
        assert list(changes.entries()) == [x for x in fresh if isinstance(x[0], sp.SpoolFile)]
        last[0] = now
        return [f.rel for f, _ in fresh]

    changes, last = sp.Listing(spool), [set()]
    assert both() == []
    with LedgerWriter(spool, "ls", host=0, host_count=2, flush_every=2) as w:
        for step in range(6):
            w.write_batch(step, unpacked_batch(step, host=0, hosts=2))
    first = both()
    assert len(first) == 3 and all("/host=0/seg-" in r for r in first)
    with LedgerWriter(spool, "ls", host=1, host_count=2, flush_every=3) as w:
        for step in range(6):
            w.write_batch(step, unpacked_batch(step, host=1, hosts=2))
    host0 = spool / "ls" / "attempt=0" / "host=0"
    gone = sorted(host0.iterdir())[1]
    gone.unlink()
    odd = host0 / "seg-000000000099-000000.parquet"
    odd.symlink_to(host0 / "nowhere")  # a dangling link: a stray, looked at every time
    second = both()
    assert gone.relative_to(spool).as_posix() not in second and len(second) == 5
    assert [type(f).__name__ for f, _ in sp.scan(spool)].count("Stray") == 1  # both(): kept
    odd.unlink()
    odd.symlink_to(sorted(host0.iterdir())[0])  # now a link to a file: a spool file
    assert [type(f).__name__ for f, _ in sp.scan(spool)].count("Stray") == 0
    assert len(both()) == 5
    assert changes.update() == ([], [])  # nothing changed
    host1 = spool / "ls" / "attempt=0" / "host=1"
    first1 = sorted(host1.iterdir())[0]
    first1.rename(host1 / "seg-000000000098-000000.parquet")  # as many names, one other
    assert len(both()) == 5
    shutil.rmtree(spool / "ls")
    assert both() == []


def test_a_listing_skips_a_settled_host_directory_until_its_mtime_moves(spool, monkeypatch):
    """`Listing` does not list a host directory again once it settled (`Settling`, as the
    service's ingest loop): a file renamed in without moving its mtime waits for the full
    listing; a publish moves the mtime and is seen at once."""
    import os

    monkeypatch.setattr(sp, "SETTLE_S", 0.0)  # listings here are ms apart
    listing = sp.Listing(spool)
    with LedgerWriter(spool, "st", host=0, host_count=1, flush_every=2) as w:
        for step in range(4):
            w.write_batch(step, unpacked_batch(step, host=0, hosts=1))
    host0 = spool / "st" / "attempt=0" / "host=0"

    def names() -> list[str]:
        listing.update()
        return [f.rel.rsplit("/", 1)[1] for f, _ in listing.entries()]

    first = names()
    assert len(first) == 2 and names() == first and names() == first  # settled now
    aside = spool.parent / "aside"
    with LedgerWriter(aside, "st", host=0, host_count=1, flush_every=2) as w:
        for step in range(4, 6):
            w.write_batch(step, unpacked_batch(step, host=0, hosts=1))
    late = next((aside / "st" / "attempt=0" / "host=0").glob("seg-*"))
    before = host0.stat()
    late.rename(host0 / late.name)
    os.utime(host0, ns=(before.st_atime_ns, before.st_mtime_ns))  # as if within one tick
    assert names() == first  # settled: not listed
    monkeypatch.setattr(sp, "FULL_LISTING_S", 0.0)
    assert names() == [*first, late.name]  # the full listing finds it
    monkeypatch.setattr(sp, "FULL_LISTING_S", 60.0)
    (host0 / late.name).unlink()  # moves the mtime: listed again, the file gone
    assert names() == first
