"""The live reconcile (tally.audit.reconcile.follow) against `tally reconcile --spool`: after
each of many rounds of a run that publishes its files as it goes (hosts a round late, a host
that joins later, within-epoch repeats, hash mismatches, unknown and held-out keys, cut
records, losses, a resume that rolls steps back on another host count, metric files, a
finish), the follower's report gives the job's findings, verdict and numbers over the same
files; and a round folds in only what it touched, the resume's rollback included (no full
pass but the first)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.reconcile.follow import Follower
from tally.audit.reconcile.job import reconcile
from tally.pipeline.runners import RunnerSpec
from tests.support.manifest import keyed_manifest

TRAIN, HELDOUT = 300, 20
ROWS = 8  # rows a host a step


def _same(a, b, where="report") -> None:
    """Equal, floats to rounding (sums added in another order)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) or (a != a and b != b), \
            (where, a, b)
    else:
        assert a == b, (where, a, b)


def _comparable(rep: dict) -> dict:
    rep = dict(rep)
    for k in ("generated_at", "provenance"):
        rep.pop(k, None)
    return rep


class Run:
    """Hosts writing one run's spool step by step; each round publishes what some wrote."""

    def __init__(self, spool: Path, seed: int) -> None:
        self.spool, self.rng = spool, np.random.default_rng(seed)
        self.writers: dict[int, LedgerWriter] = {}
        self.perm = self.rng.permutation(TRAIN)
        self.pos = 0

    def open(self, attempt: int, hosts: list[int], host_count: int,
             resumed: int | None = None) -> None:
        for w in self.writers.values():
            w.close()
        self.writers = {h: LedgerWriter(self.spool, "r", host=h, host_count=host_count,
                                        attempt=attempt, resumed_from_step=resumed,
                                        flush_every=10**6, fsync=False) for h in hosts}

    def step(self, step: int, hosts: list[int], *, repeat: bool = False) -> None:
        for h in hosts:
            if repeat:  # a per-host seed: keys drawn with replacement
                keys = self.rng.integers(0, TRAIN, ROWS)
            else:
                keys = self.perm[np.arange(self.pos, self.pos + ROWS) % TRAIN]
                self.pos += ROWS
            keys = keys.astype(np.int64)
            epoch = np.full(ROWS, self.pos // TRAIN if not repeat else 0, np.int32)
            roll = self.rng.random(ROWS)
            keys = np.where(roll < 0.03, TRAIN + HELDOUT + self.rng.integers(0, 5, ROWS),
                            np.where(roll < 0.06, TRAIN + self.rng.integers(0, HELDOUT, ROWS),
                                     keys))
            content = keys.astype(np.uint64)
            content[self.rng.random(ROWS) < 0.03] ^= np.uint64(7)  # content drift
            offset = np.where(self.rng.random(ROWS) < 0.05, 3, 0).astype(np.int32)
            n_tok = np.where(offset > 0, 7, 10).astype(np.int32)
            self.writers[h].write_segments(step, Segments.build(
                row=np.arange(ROWS), record_key=keys, n_tokens=n_tok, content_hash=content,
                offset=offset, epoch=epoch,
                loss=(2.0 + self.rng.random(ROWS)).astype(np.float32)))
            if step % 4 == 0:
                self.writers[h].log_metric(step, "train_loss", 2.5)
                self.writers[h].log_metric(step, "heldout_loss", 2.7)

    def publish(self, hosts: list[int]) -> None:
        for h in hosts:
            self.writers[h].flush()


def _two_hosts(spool: Path, seed: int, steps: int) -> Run:
    """A run of two hosts that published `steps` steps."""
    run = Run(spool, seed=seed)
    run.open(0, [0, 1], 2)
    for s in range(steps):
        run.step(s, [0, 1])
    run.publish([0, 1])
    return run


def _one_string_a_path(follower: Follower) -> None:
    """Resumed or not, files gathered anew or not, the follower keeps one string a path: its
    files' and footers' keys are the plan's and the listing's (`Follower._share_keys`)."""
    paths = {f.path: f.path for f in follower.plan.files}
    assert all(paths[p] is p for p in follower.files if p in paths)
    rels = {f.rel: f.rel for f, _ in follower._listing.entries()}
    assert all(rels[r] is r for r in follower._footers if r in rels)


def _round(follower: Follower, tmp: Path, manifest: Path, k: int) -> dict:
    rep = follower.round()
    assert rep is not None
    _one_string_a_path(follower)
    full = reconcile(run_id="r", manifest=manifest, out=tmp / f"full-{k}", spool=tmp / "spool",
                     runner=RunnerSpec())
    _same(_comparable(rep), _comparable(full), f"round {k}")
    return rep


@pytest.mark.slow
@pytest.mark.parametrize("deep", [256, 21])
def test_rounds_agree_with_the_job(tmp_path, monkeypatch, deep):
    """`deep` 21: the follower's evidence lists barely longer than the report's, so that the
    resume's rollback takes out entries only a full pass can replace (it makes one). The
    follower is started again now and then, as a restarted service starts it: from a
    checkpoint rounds old (only full passes and quiet moments make one here), or one just
    made; it resumes (no full pass) and its rounds still agree."""
    from tally.audit.reconcile import follow

    monkeypatch.setattr(follow, "DEEP", deep)
    monkeypatch.setattr(follow, "CHECKPOINT_S", 1e9)
    if deep == 21:  # full passes by many key ranges, spilled to disk, runs on disk
        from tally.audit.reconcile import row_store

        monkeypatch.setattr(follow, "PASS_RECORDS", 64)
        monkeypatch.setattr(row_store, "SPILL_ROWS", 100)
        monkeypatch.setattr(row_store, "MEMORY_ROWS", 100)
    m = keyed_manifest(tmp_path / "m.parquet", TRAIN, HELDOUT, domains=("code", "web", "web"),
                       sources=("s1", "s2"))
    spool = tmp_path / "spool"
    run = Run(spool, seed=3)
    f = None
    k = 0

    def restart(saved_at: int) -> Follower:
        again = Follower(spool, m, "r", tmp_path / "live")
        assert again.resumed_from == saved_at and again.set_aside is None
        return again

    # Attempt 0: host 0 alone for two rounds, then host 1 joins, a round behind host 0.
    run.open(0, [0, 1], 2)
    step = 0
    for rnd in range(6):
        for _ in range(5):
            run.step(step, [0, 1], repeat=rnd in (3, 4))
            step += 1
        run.publish([0] if rnd < 2 or rnd % 2 else [0, 1])
        if f is None:
            f = Follower(spool, m, "r", tmp_path / "live")
            assert f.resumed_from is None
        _round(f, tmp_path, m, k)
        k += 1
        if rnd == 2:  # killed: back to the first round's checkpoint (its full pass)
            f = restart(1)
        elif rnd == 4:  # stopped as the service stops it: a checkpoint first
            f.checkpoint()
            f = restart(f.rounds)
    run.publish([0, 1])
    _round(f, tmp_path, m, k)
    k += 1
    passes = f.full_passes
    assert passes == 1  # the first round; every later one folded in, restarts too
    # Attempt 1 resumes from step 20 on 3 hosts: steps 20.. of attempt 0 roll back.
    run.open(1, [0, 1, 2], 3, resumed=20)
    step = 20
    for rnd in range(4):
        for _ in range(4):
            run.step(step, [0, 1, 2])
            step += 1
        run.publish([0, 1, 2] if rnd != 1 else [0, 2])
        rep = _round(f, tmp_path, m, k)
        k += 1
        if rnd == 1:  # the rollback's state, checkpointed and resumed
            f.checkpoint()
            f = restart(f.rounds)
    if deep == 21:
        assert f.full_passes == passes + 1  # the rollback emptied a list: one full pass
    else:
        assert f.full_passes == passes  # the resume's rollback folded out too
    for w in run.writers.values():
        w.finish()
        w.close()
    rep = _round(f, tmp_path, m, k)
    assert rep["verdict"] == "FAIL" and rep["findings"]
    assert f.round() is None  # nothing new: nothing done
    saved = f.rounds
    f = restart(saved)  # the quiet round made a checkpoint
    assert f.round() is None


def test_follow_command_keeps_the_report_current(tmp_path):
    """`tally reconcile --follow` as a user runs it: a report once the run publishes, a new
    round for each file published later, one line a round; Ctrl-C keeps the report and the
    checkpoint, and the command started again resumes (no full pass) and goes on; a wrong
    combination is one line."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from tests.support.manifest import uniform_manifest

    m = uniform_manifest(tmp_path / "m.parquet", 100)
    spool = tmp_path / "spool"
    out = tmp_path / "live"

    def follow() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "tally.audit.cli", "reconcile",
                                 "--spool", spool, "--manifest", m, "--run", "r", "-o", out,
                                 "--follow", "0.2", "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def step(w: LedgerWriter, s: int) -> None:
        w.write_segments(s, Segments.build(row=np.arange(4), record_key=np.arange(4),
                                           n_tokens=np.full(4, 10),
                                           content_hash=np.arange(4, dtype=np.uint64)))
        w.flush()

    def stop(proc: subprocess.Popen) -> str:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the last report and the checkpoint stay
        assert proc.wait(30) == 130
        err = proc.stderr.read()
        assert err.strip().splitlines()[-1] == "tally: interrupted"
        return err

    checkpoint = out / ".follow" / "checkpoint.pickle"
    with LedgerWriter(spool, "r", host=0, flush_every=10**6, fsync=False) as w:
        step(w, 0)
        proc = follow()
        try:
            first = json.loads(proc.stdout.readline())
            assert first["round"] == 1 and first["as_of_step"] == 0
            assert json.loads((out / "report.json").read_text())["coverage"]["seen"] == 4
            step(w, 1)
            second = json.loads(proc.stdout.readline())
            assert second["round"] == 2 and second["as_of_step"] == 1
            assert json.loads((out / "report.json").read_text())["coverage"]["exposures"] == 8
            status = json.loads((out / "follow.json").read_text())
            assert status["round"] == 2 and status["full_passes"] == 1 and status["rows"] == 8
            assert status["resumed_from_round"] is None
            # The next round finds nothing new: a checkpoint as of round 2.
            after = time.time_ns()
            deadline = time.monotonic() + 30
            while not (checkpoint.exists() and checkpoint.stat().st_mtime_ns >= after):
                assert time.monotonic() < deadline, "no checkpoint at a quiet moment"
                time.sleep(0.05)
        finally:
            stop(proc)
        assert json.loads((out / "report.json").read_text())["coverage"]["exposures"] == 8
        proc = follow()
        try:
            step(w, 2)
            third = json.loads(proc.stdout.readline())
            assert third["round"] == 3 and third["as_of_step"] == 2
            status = json.loads((out / "follow.json").read_text())
            assert status["resumed_from_round"] == 2 and status["full_passes"] == 1
            assert status["rows"] == 12
            assert json.loads((out / "report.json").read_text())["coverage"]["exposures"] == 12
        finally:
            err = stop(proc)
        assert "set aside" not in err
    bad = subprocess.run([sys.executable, "-m", "tally.audit.cli", "reconcile", "--ledger",
                          tmp_path / "l.duckdb", "--manifest", m, "--run", "r", "-o",
                          tmp_path / "x", "--follow", "5"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "tally: error: --follow reads a spool as it grows: give --spool, without --at-step"]


def test_a_live_reconcile_killed_again_and_again_resumes_and_agrees(tmp_path):
    """kill -9 of `tally reconcile --follow` at 4 seeded random moments (within a round, a
    checkpoint, a quiet wait) while the run goes on: each start resumes from the last whole
    checkpoint or, before the first, starts afresh (never a checkpoint set aside), and the
    report after the last start is the job's over the same files."""
    import json
    import signal
    import subprocess
    import time

    from tests.support.cli import command, environment

    m = keyed_manifest(tmp_path / "m.parquet", TRAIN, HELDOUT)
    spool, out = tmp_path / "spool", tmp_path / "live"
    run = Run(spool, seed=11)
    run.open(0, [0, 1], 2)
    rng = np.random.default_rng(11)
    resumed: list[int | None] = []
    step = 0
    for _ in range(4):
        for _ in range(3):
            run.step(step, [0, 1])
            step += 1
        run.publish([0, 1])
        (out / "follow.json").unlink(missing_ok=True)  # the last process'
        proc = subprocess.Popen(command("reconcile", "--spool", spool, "--manifest", m, "--run",
                                        "r", "-o", out, "--follow", "0.05", "-q"),
                                env=environment({"TALLY_SUPERVISED": "1"}),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while True:  # this process' first round
            try:
                st = json.loads((out / "follow.json").read_text())
            except (OSError, ValueError):
                st = {}
            if st.get("as_of_step") == step - 1:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(proc.communicate()[1])
            time.sleep(0.02)
        resumed.append(st["resumed_from_round"])
        time.sleep(float(rng.uniform(0, 0.4)))
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
        assert "set aside" not in err
    assert [r for r in resumed[1:] if r is not None], resumed  # at least one resumed
    f = Follower(spool, m, "r", out)
    assert f.set_aside is None
    if f.round() is None:  # its last checkpoint had every file
        f.checkpoint()
    full = reconcile(run_id="r", manifest=m, out=tmp_path / "full", spool=spool,
                     runner=RunnerSpec())
    _same(_comparable(json.loads((out / "report.json").read_text())), _comparable(full))


def test_a_checkpoint_that_does_not_fit_is_set_aside(tmp_path):
    """A live reconcile started over a checkpoint of another manifest, an unreadable one, or
    one naming a run of rows that is gone: set aside (saying why), a full pass, the job's
    report; the same start over a good checkpoint resumes without one."""
    from tests.support.manifest import uniform_manifest

    m = uniform_manifest(tmp_path / "m.parquet", TRAIN)
    spool, out = tmp_path / "spool", tmp_path / "live"
    _two_hosts(spool, seed=5, steps=6)
    f = Follower(spool, m, "r", out)
    _round(f, tmp_path, m, 0)
    f.checkpoint()
    checkpoint = out / ".follow" / "checkpoint.pickle"
    good = checkpoint.read_bytes()

    def again(k: int, why: str | None) -> Follower:
        g = Follower(spool, m, "r", out)
        if why is None:
            assert g.resumed_from == 1 and g.set_aside is None
            assert g.round() is None  # nothing new
        else:
            assert g.resumed_from is None and why in g.set_aside
            _round(g, tmp_path, m, k)
            assert g.full_passes == 1 and g.rounds == 1
        return g

    again(1, None)
    checkpoint.write_bytes(good[: len(good) // 2])
    again(2, "unreadable")  # its full pass made a new checkpoint
    runs = [d for d in (out / ".follow" / "rows").iterdir() if d.is_dir()]
    assert runs  # a checkpoint writes the runs in memory to disk
    for c in runs[0].iterdir():
        c.unlink()
    again(3, "unreadable")
    keyed_manifest(tmp_path / "m.parquet", TRAIN, HELDOUT)  # another manifest in its place
    again(4, "another run's, spool's or manifest's")
    again(5, None)


def test_a_round_that_fails_half_way_is_never_checkpointed(tmp_path, monkeypatch):
    """A round that raises after it changed the state (here the per-record statistics, once):
    that state is never checkpointed (a restart resumes from the one before), and the next
    round makes a full pass that agrees with the job."""
    from tally.audit.reconcile import bucket_stats

    m = keyed_manifest(tmp_path / "m.parquet", TRAIN, HELDOUT)
    spool, out = tmp_path / "spool", tmp_path / "live"
    run = _two_hosts(spool, seed=7, steps=4)
    f = Follower(spool, m, "r", out)
    _round(f, tmp_path, m, 0)  # a full pass: a checkpoint as of round 1
    for s in range(4, 8):
        run.step(s, [0, 1])
    run.publish([0, 1])
    compute = bucket_stats.compute
    calls = []

    def fails_once(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # the fold's second computation: the state already changed
            raise OSError("disk gone")
        return compute(*a, **k)

    monkeypatch.setattr(bucket_stats, "compute", fails_once)
    with pytest.raises(OSError):
        f.round()
    f.checkpoint()  # as the command does when its service goes: nothing whole to write
    g = Follower(spool, m, "r", out)  # a restart: from the checkpoint before the failure
    assert g.resumed_from == 1
    _round(g, tmp_path, m, 1)
    assert g.full_passes == 1  # folded in
    _round(f, tmp_path, m, 2)  # the failed follower goes on: a full pass mends
    assert f.full_passes == 2


@pytest.mark.slow
def test_a_long_run_on_many_hosts_agrees(tmp_path):
    """Beyond 16 hosts (the host overlap by pairs) and beyond 256 steps (the loss windows
    double as the run grows: the follower merges pairs of them), rounds still agree."""
    m = keyed_manifest(tmp_path / "m.parquet", TRAIN, domains=("code", "web"))
    spool = tmp_path / "spool"
    rng = np.random.default_rng(5)
    hosts = 20
    writers = [LedgerWriter(spool, "r", host=h, host_count=hosts, flush_every=10**6,
                            fsync=False) for h in range(hosts)]
    f = Follower(spool, m, "r", tmp_path / "live")
    windows = set()
    try:
        for k, (lo, hi) in enumerate([(0, 150), (150, 330), (330, 600)]):
            for step in range(lo, hi):
                for w in writers:
                    keys = rng.integers(0, TRAIN, 2)
                    w.write_segments(step, Segments.build(
                        row=np.arange(2), record_key=keys, n_tokens=np.full(2, 10),
                        content_hash=keys.astype(np.uint64), epoch=np.zeros(2, np.int32),
                        loss=rng.random(2).astype(np.float32)))
            for w in writers:
                w.flush()
            rep = _round(f, tmp_path, m, k)
            windows.add(rep["loss"]["window_steps"])
    finally:
        for w in writers:
            w.close()
    assert windows == {1, 2, 4} and f.full_passes == 1
    assert len(rep["hosts"]["per_host"]) == hosts


def _cmdline(p) -> list[str]:
    import psutil

    try:
        return p.cmdline()
    except psutil.Error:  # gone, or a zombie not reaped yet
        return []


def test_a_killed_service_takes_its_live_reconcile_with_it(tmp_path):
    """`tally serve` runs a live reconcile child per run; kill -9 the service and the child
    ends too (it would otherwise fold in a spool nobody reads, for ever), its checkpoint left
    for the next service to resume from."""
    import signal
    import subprocess
    import sys

    import httpx
    import psutil

    from tests.support.api import free_port, poll, write_steps
    from tests.support.cli import BARE_ENV
    from tests.support.manifest import uniform_manifest

    spool = tmp_path / "spool"
    write_steps(spool, "r", host=0, hosts=1, steps=range(6), n=100, seed=1, flush_every=2)
    m = uniform_manifest(tmp_path / "m.parquet", 100)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tally.audit.cli", "serve", "--ledger", tmp_path / "l.duckdb",
         "--spool", spool, "--manifest", m, "--port", str(port), "--findings-every", "0.5",
         "--interval", "0.2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=BARE_ENV, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{port}/v1/runs/r"

        def verdict():
            try:
                return (httpx.get(url, timeout=5).json().get("findings") or {}).get("verdict")
            except (httpx.HTTPError, ValueError):
                return None

        assert poll(verdict, timeout=90)
        service = psutil.Process(proc.pid)
        (child,) = poll(lambda: [p for p in service.children(recursive=True)
                                 if _cmdline(p) and "--follow" in _cmdline(p)], timeout=30)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert poll(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE,
                    timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # It left a checkpoint as it went: the next service's live reconcile resumes there.
    again = Follower(spool, m, "r", tmp_path / "l.duckdb.findings" / "r")
    assert again.resumed_from is not None and again.set_aside is None
    assert again.round() is None  # all of the run read already


def test_row_store_fetches_every_row_of_the_keys_asked(tmp_path, monkeypatch):
    """The store under the live reconcile, with runs small enough to go to disk and to stop
    merging: every row of the keys asked, whatever run holds it; merged runs' files gone."""
    from tally.audit.reconcile import row_store

    monkeypatch.setattr(row_store, "MEMORY_ROWS", 500)
    monkeypatch.setattr(row_store, "RUN_ROWS", 3000)
    store = row_store.RowStore(tmp_path / "rows")
    rng = np.random.default_rng(0)
    every = []
    for batch in range(40):
        n = int(rng.integers(50, 400))
        rows = {c: np.zeros(n, t) for c, t in row_store.COLUMNS.items()}
        rows["key"] = rng.integers(0, 2000, n)
        rows["step"] = np.full(n, batch)
        rows["host"] = rng.integers(0, 9, n).astype(np.uint16)
        store.add(rows)
        every.append(rows)
    total = sum(len(r["key"]) for r in every)
    assert store.rows == total
    sizes = [len(r["key"]) for r in store.runs]
    assert max(sizes) <= 3000 and any(s >= 500 for s in sizes)  # some on disk, none too big
    on_disk = {p.name for p in (tmp_path / "rows").iterdir()}
    assert on_disk == {r["_folder"].name for r in store.runs if "_folder" in r}
    allk = np.concatenate([r["key"] for r in every])
    alls = np.concatenate([r["step"] for r in every])
    allh = np.concatenate([r["host"] for r in every])
    keys = np.unique(rng.integers(0, 2100, 300))
    got, at = store.fetch(keys)
    assert np.array_equal(keys[at], got["key"])  # each row's key by its position in `keys`
    want = np.isin(allk, keys)
    def triples(k, s, h):
        return sorted(zip(k.tolist(), s.tolist(), h.tolist(), strict=True))

    assert triples(got["key"], got["step"], got["host"]) == \
        triples(allk[want], alls[want], allh[want])

    # A bulk load by key range (the full pass): rows spilled to disk, a range with none, keys
    # beyond the last bound; then runs added as rounds add them, and fetches across both.
    monkeypatch.setattr(row_store, "SPILL_ROWS", 700)
    bulk = row_store.RowStore(tmp_path / "bulk")
    chunks = [{c: v[i:i + 300] for c, v in row_store.concat(every).items()}
              for i in range(0, total, 300)]
    for ch in chunks:  # nothing in [500, 1000)
        ch["key"] = np.where((ch["key"] >= 500) & (ch["key"] < 1000), ch["key"] + 1500,
                             ch["key"])
    keyed = np.concatenate([ch["key"] for ch in chunks])
    bounds = np.array([0, 500, 1000, 1500, 2000])
    seen = []
    for i, rows in bulk.load(iter(chunks), bounds):
        seen.append(i)
        k = rows["key"]
        hi = bounds[i + 1] if i + 1 < len(bounds) else keyed.max() + 1
        assert (np.diff(k) >= 0).all() and ((k >= bounds[i]) & (k < hi)).all()
        assert len(k) == int(((keyed >= bounds[i]) & (keyed < hi)).sum())
    assert seen == [0, 1, 2, 3, 4] and bulk.rows == total
    assert not (tmp_path / "bulk" / "load").exists()  # the spilled ranges' files gone
    extra = {c: np.zeros(100, t) for c, t in row_store.COLUMNS.items()}
    extra["key"] = rng.integers(0, 3600, 100)
    bulk.add(extra)
    keyed = np.r_[keyed, extra["key"]]
    keys = np.unique(rng.integers(0, 3600, 400))
    got, at = bulk.fetch(keys)
    assert np.array_equal(keys[at], got["key"])
    assert np.array_equal(np.sort(got["key"]), np.sort(keyed[np.isin(keyed, keys)]))


def test_the_service_stops_an_idle_live_reconcile_and_starts_it_on_a_change(tmp_path,
                                                                            monkeypatch):
    """A run that stops changing: its live reconcile stops once a round has read all of it,
    its report stays served; new files of the run start one again, which resumes from its
    checkpoint and reads them."""
    import json

    import psutil

    from tally.api import findings
    from tally.api.app import create_app
    from tally.audit.ledger.database import Ledger
    from tests.support.api import Server, poll, write_steps
    from tests.support.manifest import uniform_manifest

    monkeypatch.setattr(findings, "IDLE_S", 1.0)
    monkeypatch.setattr(findings, "IDLE_ROUNDS", 1)
    spool = tmp_path / "spool"
    write_steps(spool, "r", host=0, hosts=1, steps=range(4), n=100, seed=1, flush_every=2)
    m = uniform_manifest(tmp_path / "m.parquet", 100)

    def following() -> list:
        return [p for p in psutil.Process().children(recursive=True)
                if "--follow" in _cmdline(p)]

    with Ledger(tmp_path / "l.duckdb") as ledger, \
            Server(create_app(ledger, spool=spool, manifest=m, interval=0.05,
                              findings_every=0.3)) as srv:
        def as_of():
            return (srv.get("/v1/runs/r").json().get("findings") or {}).get("as_of_step")

        assert poll(lambda: as_of() == 3, timeout=60)
        assert poll(lambda: not following(), timeout=60)  # idle: stopped
        assert as_of() == 3  # its report still served
        write_steps(spool, "r", host=0, hosts=1, steps=range(4, 8), n=100, seed=2,
                    flush_every=2)
        assert poll(lambda: as_of() == 7, timeout=60)  # started again, and read them
        # ... from the checkpoint its quiet rounds left: no full pass over the run again
        # (a round writes its report, then checkpoints, then says so in follow.json, which the
        # new child's start removed: on a loaded box the report is served before it is there)
        said = tmp_path / "l.duckdb.findings" / "r" / "follow.json"
        assert poll(said.exists, timeout=60)
        status = json.loads(said.read_text())
        assert status["resumed_from_round"] >= 1 and status["full_passes"] == 1


def test_follow_waits_for_the_runs_first_file_and_says_why(tmp_path):
    """Started before the run publishes: one line on stderr saying why it waits (once),
    follow.json saying so, then rounds as files come."""
    import json
    import subprocess
    import sys

    from tests.support.manifest import uniform_manifest

    m = uniform_manifest(tmp_path / "m.parquet", 100)
    spool = tmp_path / "spool"
    spool.mkdir()
    out = tmp_path / "live"
    proc = subprocess.Popen([sys.executable, "-m", "tally.audit.cli", "reconcile", "--spool",
                             spool, "--manifest", m, "--run", "r", "-o", out, "--follow", "0.2",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**__import__("os").environ,
                                            "TALLY_SUPERVISED": "1"})
    try:
        line = proc.stderr.readline()
        assert line.startswith("tally: live reconcile waits: no segment files for run 'r'")
        assert "waiting" in json.loads((out / "follow.json").read_text())
        with LedgerWriter(spool, "r", host=0, fsync=False) as w:
            w.write_segments(0, Segments.build(row=np.arange(3), record_key=np.arange(3),
                                               n_tokens=np.full(3, 10),
                                               content_hash=np.arange(3, dtype=np.uint64)))
        got = json.loads(proc.stdout.readline())
        assert got["round"] == 1 and got["as_of_step"] == 0
        assert "waiting" not in json.loads((out / "follow.json").read_text())
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert "waits" not in err  # said once, not every round


def test_spool_inputs_taken_on_top_equal_one_pass_whatever_changes(tmp_path):
    """The live reconcile's rounds gather only the files listed since (`SpoolMemo`): after
    each kind of change, what they give equals one pass over the spool as it is."""
    import shutil

    from tally.audit.buckets.plan import SpoolMemo, spool_inputs
    from tally.audit.hook.spool import Listing
    from tally.audit.provenance import plan_fingerprint
    from tests.support.api import write_steps

    spool = tmp_path / "spool"
    listing, memo, footers = Listing(spool), SpoolMemo(), {}

    def agree(on_top: bool) -> None:
        was = memo.gathered
        kept = spool_inputs(spool, "r", footers, listing, memo)
        assert kept == spool_inputs(spool, "r")
        assert (memo.gathered is was) == on_top  # new files taken on top, or all again
        # The report's input fingerprint, summed as files were taken, is the files' own.
        assert plan_fingerprint(kept.files, kept.files_print) == plan_fingerprint(kept.files)

    def host(h: int, steps: range, attempt: int = 0, resumed: int | None = None,
             hosts: int = 3) -> Path:
        write_steps(spool, "r", host=h, hosts=hosts, steps=steps, n=500, seed=h + 10 * attempt,
                    attempt=attempt, resumed=resumed, flush_every=2)
        return spool / "r" / f"attempt={attempt}" / f"host={h}"

    for h in (1, 2):  # host 0 comes later: its files are listed before the others'
        host(h, range(6))
    agree(on_top=False)  # the first call
    for h in (1, 2):
        host(h, range(6, 8))
    agree(on_top=True)
    agree(on_top=True)  # nothing new
    two = spool / "r" / "attempt=0" / "host=2"
    oldest = sorted(two.glob("seg-*"))[0]
    oldest.rename(tmp_path / oldest.name)  # a file gone and one new, as many as before
    host(2, range(8, 10))
    agree(on_top=False)
    (tmp_path / oldest.name).rename(oldest)
    agree(on_top=False)
    # A host whose files sort first in the listing, saying another host count: the attempt's
    # facts are its first file's, in listing order.
    late = host(0, range(8), hosts=4)
    agree(on_top=True)
    hidden = sorted(late.glob("seg-*"))[1]
    aside = tmp_path / hidden.name
    shutil.move(hidden, aside)  # a file gone
    agree(on_top=False)
    shutil.move(aside, hidden)  # back: published late, below its host's newest
    agree(on_top=False)
    twin = sorted(late.glob("seg-*"))[-1]  # a copy of the newest, listed after it
    shutil.copy(twin, late / f"{twin.name.rsplit('-', 1)[0]}-000099.parquet")
    (late / "notes.txt").write_text("left here")  # a stray
    agree(on_top=True)
    host(1, range(4, 10), attempt=1, resumed=4)  # a new attempt
    agree(on_top=True)
    broken = late / "seg-000000000050-000000.parquet"
    broken.write_bytes(b"not parquet")  # no footer yet
    agree(on_top=True)
    host(2, range(10, 12))
    agree(on_top=True)  # its footer tried again, still unreadable: new files taken on top
    broken.unlink()  # the real file in its place (published at last): its footer read
    write_steps(tmp_path / "late", "r", host=0, hosts=4, steps=range(50, 51), n=500, seed=7,
                flush_every=2)
    shutil.move(next((tmp_path / "late").rglob("seg-*")), broken)
    agree(on_top=False)
    kept = spool_inputs(spool, "r", footers, listing, memo)
    assert [why[:9] for _, why in kept.left_out] == ["not a spo", "duplicate"]
    assert (kept.attempts[0]["host_count"], kept.attempts[1]["resumed_from_step"]) == (4, 4)


def test_a_follower_keeps_one_string_a_path_when_its_files_are_gathered_anew(tmp_path):
    """A file published late (below its host's newest) makes the round gather every file
    anew, with new path strings: the follower's own keys are made those."""
    import shutil

    from tests.support.manifest import uniform_manifest

    m = uniform_manifest(tmp_path / "m.parquet", TRAIN)
    spool = tmp_path / "spool"
    run = _two_hosts(spool, seed=5, steps=3)
    host = spool / "r" / "attempt=0" / "host=0"
    aside = sorted(host.glob("seg-*"))[0]
    shutil.move(aside, tmp_path / aside.name)  # not published yet
    f = Follower(spool, m, "r", tmp_path / "live")
    assert f.round() is not None
    gathered = f._memo.gathered
    for s in range(3, 5):
        run.step(s, [0, 1])
    run.publish([0, 1])
    assert f.round() is not None and f._memo.gathered is gathered  # taken on top
    shutil.move(tmp_path / aside.name, aside)  # published late
    assert f.round() is not None and f._memo.gathered is not gathered  # all again
    assert aside.as_posix() in f.files
    _one_string_a_path(f)


def test_a_checkpoint_slow_to_write_is_written_less_often(tmp_path):
    """Rounds checkpoint at least every CHECKPOINT_S, unless the last writing took more than
    CHECKPOINT_SHARE of that: then every last-seconds / CHECKPOINT_SHARE (its pickle grows
    with the run's files)."""
    import time

    from tally.audit.reconcile import follow
    from tests.support.manifest import uniform_manifest

    m = uniform_manifest(tmp_path / "m.parquet", TRAIN)
    spool = tmp_path / "spool"
    run = _two_hosts(spool, seed=3, steps=4)
    f = Follower(spool, m, "r", tmp_path / "live")
    assert f.round() is not None  # a full pass: checkpointed
    checkpoint = tmp_path / "live" / ".follow" / "checkpoint.pickle"

    def step_and_round(step: int, last_save_s: float) -> bool:
        """Whether a round 61 s after the last checkpoint, which took `last_save_s`, wrote."""
        run.step(step, [0, 1])
        run.publish([0, 1])
        before = checkpoint.stat().st_mtime_ns
        f._saved_at, f.last_save_s = time.monotonic() - 61, last_save_s
        assert f.round() is not None
        return checkpoint.stat().st_mtime_ns != before

    assert step_and_round(4, 1.0)  # 1 s of 61: within the share
    assert not step_and_round(5, 0.05 * 61 + 1)  # every 81 s: not yet
    assert f._unsaved and follow.CHECKPOINT_SHARE == 0.05


def test_alerts_against_the_split_defer_to_a_live_reconcile_that_finds_weighted_domains(
        tmp_path):
    """A mixture reading `code` (a third of the records) at twice the rate of `web`, in its
    first pass over the split: code's records repeat on both hosts and coverage trails the
    split's ideal, which is what its weights do. The live reconcile says `domain_weighted`
    (PASS); the alerts measured against the split's ideal (host overlap in the first pass,
    coverage behind the ideal, within-epoch repeats) then do not fire and say why."""
    from tally.api.app import create_app
    from tally.audit.ledger.database import Ledger
    from tests.support.api import Server, poll
    from tests.support.manifest import CODE_EVERY_THIRD, content_hash_of, keyed_manifest

    n = 300
    m = keyed_manifest(tmp_path / "m.parquet", n, hashes=content_hash_of, tokens=10,
                       domains=CODE_EVERY_THIRD)
    keys = np.arange(n)
    rng = np.random.default_rng(3)

    def passes(pool):
        for e in range(10):
            for k in rng.permutation(pool):
                yield e, int(k)

    code, web = passes(keys[keys % 3 == 0]), passes(keys[keys % 3 != 0])
    spool = tmp_path / "spool"
    writers = [LedgerWriter(spool, "r", host=h, host_count=2, fsync=False) for h in (0, 1)]
    for step in range(15):  # 8 code and 8 web rows a step: code 1.2 passes, web 0.6
        batch = [next(code) for _ in range(8)] + [next(web) for _ in range(8)]
        for h, w in enumerate(writers):
            k = np.array([x[1] for x in batch[h::2]])
            w.write_segments(step, Segments.build(
                row=np.arange(8), record_key=k, n_tokens=np.full(8, 10),
                content_hash=content_hash_of(k), epoch=np.array([x[0] for x in batch[h::2]])))
    for w in writers:
        w.finish()
    with Ledger(tmp_path / "l.duckdb") as ledger, \
            Server(create_app(ledger, spool=spool, manifest=m, interval=0.05,
                              findings_every=0.3)) as srv:
        def summary():
            return srv.get("/v1/runs/r").json()

        assert poll(lambda: (summary().get("findings") or {}).get("as_of_step") == 14,
                    timeout=60)
        s = summary()
        assert s["findings"]["verdict"] == "PASS", s["findings"]
        assert "domain_weighted" in [f["code"] for f in s["findings"]["findings"]]
        alerts = {a["name"]: a for a in s["alerts"]}
        for name in ("host_overlap", "coverage_behind_ideal"):
            assert alerts[name]["value"] > alerts[name]["threshold"], alerts[name]
            assert not alerts[name]["firing"]
            assert "not alerted: the run weights its domains" in alerts[name]["what"]
        assert s["status"] == "ok", s["alerts"]
