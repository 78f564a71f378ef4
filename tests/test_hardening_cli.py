"""Hardening of the command line, on real `tally` processes: Ctrl-C and SIGTERM at many points
of an ingest and of a serve, a damaged ledger, a full disk, a reader that goes away, and the
options and paths that must be refused before any work starts. Each case printed a traceback,
lost an exit status or was accepted before (issue 36, points 8, 10 and 11)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.lookup import LookupIndex
from tests.support import ROOT
from tests.support.api import free_port, poll, write_steps
from tests.support.cli import tally, tally_popen
from tests.support.processes import limited

FILES, ROWS = 48, 10_000  # ~1 s of ingest on this 2-core box, in batches of 3 files
BATCH = ["--batch-rows", str(3 * ROWS)]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _counts(path: Path) -> dict:
    """What a ledger holds, file by file and in its aggregates; two ledgers of the same files,
    each counted once, are equal here. Also checks that it holds whole files only."""
    with Ledger(path, read_only=True) as ledger:
        def one(sql: str):
            return tuple(ledger.query(sql)[0].values())

        half = one("""SELECT count(*) FROM segments g LEFT JOIN (SELECT file_id, count(*) AS n
                      FROM consumption GROUP BY ALL) c USING (file_id)
                      WHERE coalesce(c.n, 0) <> g.n_rows""")
        assert half == (0,), "a file is in the ledger in part"
        return {
            "files": one("SELECT count(*), count(DISTINCT path), sum(n_rows) FROM segments"),
            "rows": one("SELECT count(*), count(DISTINCT (file_id, step, \"row\")) "
                        "FROM consumption"),
            "agg_steps": one("SELECT coalesce(sum(segments), 0), coalesce(sum(tokens), 0), "
                             "coalesce(sum(exposures), 0) FROM agg_steps"),
            "agg_runs": [tuple(r.values()) for r in ledger.query(
                "SELECT * EXCLUDE (run) FROM agg_runs ORDER BY run")],
            "agg_levels": [tuple(r.values()) for r in ledger.query(
                "SELECT level, records FROM agg_levels ORDER BY level")],
            "agg_ranks": one("SELECT count(*), coalesce(sum(records), 0) FROM agg_ranks"),
            "quarantine": one("SELECT count(*) FROM quarantine"),
        }


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> tuple[Path, dict]:
    """A spool of FILES files of ROWS rows, with the counts of a clean ingest of it."""
    tmp = tmp_path_factory.mktemp("big")
    spool = tmp / "spool"
    rng = np.random.default_rng(0)
    with LedgerWriter(spool, "big", flush_every=1, fsync=False, queue_size=64) as w:
        for step in range(FILES):
            w.write_segments(step, Segments.build(
                row=np.arange(ROWS) % 512, record_key=rng.integers(0, 10**6, ROWS),
                n_tokens=np.full(ROWS, 100), content_hash=rng.integers(0, 2**63, ROWS),
                epoch=np.zeros(ROWS)))
    r = tally("ingest", spool, "--ledger", tmp / "clean.duckdb", "-q", *BATCH)
    assert r.returncode == 0, r.stderr
    return spool, _counts(tmp / "clean.duckdb")


def _one_line_error(r: subprocess.CompletedProcess, *said: str) -> None:
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2, (r.returncode, r.stderr)
    last = r.stderr.splitlines()[-1]
    assert all(s in last for s in said), r.stderr


# ---- point 8: Ctrl-C and SIGTERM ----------------------------------------------------------

class _Stderr(threading.Thread):
    """A child's stderr, a pseudo-terminal read as it comes: how many files its progress bar
    has counted (the bar redraws on a terminal only; into a pipe it is one line)."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True)
        self.fd, self.text, self.files = fd, "", -1

    def _read(self) -> bytes:
        try:
            return os.read(self.fd, 65536)
        except OSError:  # EIO: the child has closed the terminal's other end
            return b""

    def run(self) -> None:
        for chunk in iter(self._read, b""):
            self.text += chunk.decode(errors="replace")
            counts = re.findall(r" (\d+)/\d+ \[", self.text[-400:])
            if counts:
                self.files = int(counts[-1])


@pytest.mark.slow
def test_ctrl_c_at_six_points_of_an_ingest_exits_130_in_one_line_and_loses_nothing(
        tmp_path, big):
    """SIGINT to the process group (what a terminal's Ctrl-C sends) at six points of an
    ingest: as the ledger opens, then as its progress bar passes 1, 9, 21, 33 and 42 of the 48
    files (points by progress, not by time: the same points on a loaded box), the last one
    twice in a row. Each time:
    status 130, `tally: interrupted` as the last line and no traceback, a ledger of whole
    files, and a second `tally ingest` that completes it to exactly what a clean ingest gives.
    Before: a traceback and status 1 in about half the tries (DuckDB interrupted
    mid-statement, then "cannot rollback"): six points catch that 63 times in 64. Twelve
    points were tried here until 12-07 (~50 CPU s, the suite's fourth-costliest test)."""
    spool, want = big
    partial = []
    for i, at in enumerate([0, 1, 9, 21, 33, 42]):
        path = tmp_path / f"l{i}.duckdb"
        term, child_end = pty.openpty()
        # A new pseudo-terminal is 0 columns wide, where tqdm draws an empty bar.
        fcntl.ioctl(child_end, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
        proc = subprocess.Popen([sys.executable, "-m", "tally.audit.cli", "ingest", str(spool),
                                 "--ledger", str(path), *BATCH], env=ENV, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=child_end,
                                start_new_session=True)
        os.close(child_end)
        err = _Stderr(term)
        err.start()
        try:
            if at == 0:  # the ledger file appears once the command is past its imports
                assert poll(lambda: path.exists() or proc.poll() is not None,  # noqa: B023
                            timeout=60, every=0.005)
            else:
                assert poll(lambda: err.files >= at or proc.poll() is not None,  # noqa: B023
                            timeout=60, every=0.005)
            assert proc.poll() is None, f"the ingest ended before point {i}: {err.text}"
            os.killpg(proc.pid, signal.SIGINT)
            if at == 42:  # impatient: a second Ctrl-C ends it at once, as a kill would
                time.sleep(0.01)
                os.killpg(proc.pid, signal.SIGINT)
            out = proc.stdout.read()
            proc.wait(60)
            err.join(10)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            os.close(term)
        assert proc.returncode == 130 and out == b"", (i, err.text)
        lines = err.text.splitlines()  # a progress bar's lines, then this one
        assert lines[-1] == "tally: interrupted" and "Traceback" not in err.text, (i, err.text)
        partial.append(_counts(path)["files"][0])  # whole files only, aggregates agreeing
        r = tally("ingest", spool, "--ledger", path, "-q", *BATCH)
        assert r.returncode == 0, r.stderr
        assert _counts(path) == want, i  # nothing lost, nothing twice
    assert sum(0 < p < FILES for p in partial) >= 4, partial  # mid-ingest, as intended


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.slow
def test_serve_stops_alike_on_sigterm_and_ctrl_c_and_writes_its_lookup_index(tmp_path, sig):
    """docker stop and systemd send SIGTERM: `tally serve` ended with status 143 there, its
    ledger unclosed and the lookup index's runs in memory never written; uvicorn swallowed a
    Ctrl-C's KeyboardInterrupt (status 0). Both now shut down alike."""
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    write_steps(spool, "r", host=0, hosts=1, steps=range(20), n=100, seed=0, flush_every=5)
    port = free_port()
    proc = tally_popen("serve", "--ledger", path, "--spool", spool, "--port", port,
                  "--interval", "0.1", "-q")

    def files() -> int:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()[
                "files_in_ledger"]
        except httpx.HTTPError:
            return 0

    try:
        want = len(list(spool.rglob("*.parquet")))
        assert poll(lambda: files() == want or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The last line says it; before it, only the service's log lines (an alert that started
    # firing is an operator's news even with -q).
    lines = err.splitlines()
    assert proc.returncode == 130 and lines[-1] == "tally: interrupted", err
    assert all(ln.startswith("tally: [") for ln in lines[:-1]) and "Traceback" not in err, err
    with Ledger(path, read_only=True) as ledger:
        top = ledger.query("SELECT max(file_id) AS m FROM segments")[0]["m"]
        cur = ledger.cursor()
        assert LookupIndex.open(path, cur).coverage.upto == top  # written at the close
        cur.close()


# ---- point 10: one line, never a traceback -------------------------------------------------

def _damage(tmp_path: Path, clean: Path, how: str) -> Path:
    bad = tmp_path / f"{how}.duckdb"
    shutil.copy(clean, bad)
    size = bad.stat().st_size
    with open(bad, "r+b") as f:
        if how == "truncated":  # a copy cut short: the last blocks are read only by a query
            f.truncate(size - size // 16)
        else:  # a bad stretch of disk in the middle of the data
            f.seek(size // 4)
            f.write(b"\0" * (size // 2))
    return bad


@pytest.mark.parametrize("how", ["truncated", "zeroed"])
@pytest.mark.slow
def test_a_damaged_ledger_is_one_line_in_ledger_ingest_and_serve(tmp_path, big, how):
    """Without the state's snapshot beside it, the ledger's rows are read at start: a block
    that is not what DuckDB wrote made a traceback of `tally ingest` and `tally serve` (and
    of `tally ledger` for a truncated file)."""
    spool, _ = big
    bad = _damage(tmp_path, spool.parent / "clean.duckdb", how)
    said = (f"tally: error: ledger {bad} is damaged (", "restore it from a backup")
    for cmd in (["ingest", spool, "--ledger", bad, "-q"],
                ["serve", "--ledger", bad, "--port", free_port(), "-q"]):
        _one_line_error(tally(*cmd, timeout=60), *said)
    r = tally("ledger", bad)
    if how == "truncated" or r.returncode:
        _one_line_error(r, *said)
    else:  # the overview reads the small tables only, which the zeros may have missed
        assert "Traceback" not in r.stderr, r.stderr


def _tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(where)], capture_output=True, timeout=30)
    except OSError:
        return False
    return done.returncode == 0


@pytest.mark.parametrize("full", ["tmpfs", "file_size_limit"])
@pytest.mark.slow
def test_a_full_disk_during_ingest_is_one_line_and_the_next_ingest_loses_nothing(
        tmp_path, big, full):
    """The ledger's disk fills mid-ingest: a COMMIT (or its checkpoint) fails, then the
    ROLLBACK ("cannot rollback", "database has been invalidated"): a traceback before. Now one
    line; with space again, the next ingest makes the ledger a clean ingest's.

    `tmpfs`: a real full file system (a 6 MB tmpfs; needs the right to mount, else skipped).
    `file_size_limit`: RLIMIT_FSIZE of 4 MB on the ingest, whose writes beyond it fail with
    EFBIG ("File too large"; Python ignores SIGXFSZ), on any machine."""
    spool, want = big
    disk = tmp_path / "disk"
    limit = 4 << 20
    if full == "tmpfs":
        if not _tmpfs(disk, "6m"):
            pytest.skip("cannot mount a tmpfs here")
        python = None
    else:
        disk.mkdir()
        python = limited("FSIZE", limit)
    path = disk / "l.duckdb"
    try:
        r = tally("ingest", spool, "--ledger", path, "-q", *BATCH, python=python)
        _one_line_error(r, f"tally: error: ledger {path}: the disk is full (",
                        "free space, and the next ingest goes on from there")
        if full == "tmpfs":
            subprocess.run(["mount", "-o", "remount,size=200m", str(disk)], check=True)
        r = tally("ingest", spool, "--ledger", path, "-q", *BATCH)
        assert r.returncode == 0, r.stderr
        assert "already in the ledger" in r.stdout and " 0 already" not in r.stdout
        assert _counts(path) == want
    finally:
        if full == "tmpfs":
            subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.slow
def test_serve_on_a_full_disk_says_so_once_and_in_healthz_and_still_stops_cleanly(tmp_path,
                                                                                  big):
    """The live ingester's rounds fail while the ledger's disk is full (here RLIMIT_FSIZE on
    the service): each round logged the same traceback before (ten a second at --interval
    0.1). Now one line, once, and /healthz degraded with the same words."""
    spool, _ = big
    port, limit = free_port(), 4 << 20
    path = tmp_path / "l.duckdb"
    proc = tally_popen("serve", "--ledger", path, "--spool", spool, "--port", port,
                  "--interval", "0.1", "-q", python=limited("FSIZE", limit))

    def health() -> dict:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()
        except httpx.HTTPError:
            return {}

    try:
        assert poll(lambda: (health().get("ingest") or {}).get("last_error")
                    or proc.poll() is not None, timeout=60)
        time.sleep(1.0)  # ten more rounds, failing alike
        h = health()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = f"ledger {path}: the disk is full ("
    assert h["status"] == "degraded" and h["ingest"]["last_error"].startswith(said), h
    assert "Traceback" not in err, err
    assert err.count(f"tally: [error] ingest round failed: {said}") == 1, err
    assert proc.returncode == 130 and err.endswith("tally: interrupted\n"), err


@pytest.mark.slow
def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path, big):
    """`tally ledger L | head`, `tally ingest --json | head`: a BrokenPipeError traceback,
    status 1. Now status 141 (a program killed by SIGPIPE), nothing on stderr; the ingest's
    work is in the ledger all the same."""
    spool, want = big
    path = tmp_path / "l.duckdb"
    for cmd in (["ingest", spool, "--ledger", path, "-q", "--json"], ["ledger", path],
                ["ledger", path, "--json"]):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first line
        try:
            r = tally(*cmd, stdout=write, stderr=subprocess.PIPE)
        finally:
            os.close(write)
        assert (r.returncode, r.stderr) == (141, ""), (cmd, r.stderr)
    assert _counts(path) == want


@pytest.mark.slow
def test_bad_paths_and_log_level_are_one_line_before_any_work(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    ledger = tmp_path / "s.duckdb"
    r = tally("serve", "--ledger", ledger, "--log-level", "bogus")
    _one_line_error(r, "argument --log-level: invalid choice: 'bogus'")
    assert not ledger.exists()  # a failed start creates nothing
    for cmd in (["reconcile", "--spool", tmp_path, "--manifest", "m.parquet", "--run", "r"],
                ["diff", "--manifest", "m.parquet", "--a", "s:a", "--b", "s:b"]):
        r = tally(*cmd, "-o", afile)
        _one_line_error(r, f"argument -o/--output: {afile} exists and is not a directory")
        r = tally(*cmd, "-o", afile / "sub")
        _one_line_error(r, f"argument -o/--output: {afile} is not a directory")
    assert afile.read_text() == "mine"
    # Before, every host failed with a traceback from the writer or from orbax.
    r = tally("train", "spool=/etc/passwd/x", cwd=tmp_path)
    _one_line_error(r, "tally: error: spool=/etc/passwd/x: /etc/passwd is not a directory")
    r = tally("train", f"spool={tmp_path / 'spool'}", "checkpoint_dir=/proc/x",
               "checkpoint_every=1", cwd=tmp_path)
    _one_line_error(r, "tally: error: checkpoint_dir=/proc/x: cannot create anything in /proc")
    assert not (tmp_path / "spool").exists()


# ---- point 11: options that must be refused ------------------------------------------------

@pytest.mark.parametrize("args,said", [pytest.param(*case, id=" ".join(case[0])) for case in [
    (["serve", "--interval", "0"], "argument --interval: expected a number > 0, got 0"),
    (["serve", "--interval", "-1"], "argument --interval: expected a number > 0, got -1"),
    (["serve", "--interval", "nan"], "argument --interval: expected a number > 0, got nan"),
    (["serve", "--findings-every", "-5"], "argument --findings-every: expected a number >= 0"),
    (["serve", "--preflight-seconds", "-1"], "argument --preflight-seconds: expected a number"),
    (["serve", "--max-round-seconds", "-1"], "argument --max-round-seconds: expected a number"),
    (["reconcile", "--memory-gb", "0"], "argument --memory-gb: expected a number > 0, got 0"),
    (["reconcile", "--at-step", "-5"], "argument --at-step: expected an integer >= 0, got -5"),
    (["diff", "--memory-gb", "inf"], "argument --memory-gb: expected a number > 0, got inf"),
    (["diff", "--at-step", "-5"], "argument --at-step: expected an integer >= 0, got -5"),
    (["preflight", "--at-step", "-5"], "argument --at-step: expected an integer >= 0, got -5"),
    ]])
def test_options_that_must_be_refused_are_refused_before_any_work(tmp_path, args, said):
    """`--interval 0` kept a core at 100% scanning the spool; the others went on into the
    work (a reconcile planned for no memory, a step before the first)."""
    command, rest = args[0], args[1:]
    needs = {"serve": ["--ledger", tmp_path / "l.duckdb", "--port", "0"],
             "reconcile": ["--spool", tmp_path, "--manifest", "m.parquet", "--run", "r", "-o",
                           tmp_path / "out"],
             "diff": ["--manifest", "m.parquet", "--a", "s:a", "--b", "s:b", "-o",
                      tmp_path / "out"],
             "preflight": ["--run", "r", "--ledger", tmp_path / "l.duckdb", "--manifest",
                           "m.parquet", "--hosts", "2", "--loader", "m:f"]}[command]
    try:
        r = tally(command, *needs, *rest, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tally {' '.join(args)} was accepted and ran")
    _one_line_error(r, said)
    assert not (tmp_path / "l.duckdb").exists() and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_learning_rate_of_inf_or_nan_is_refused_before_any_host_starts(tmp_path):
    for value in ("inf", "nan"):
        r = tally("train", f"spool={tmp_path / 'spool'}", f"learning_rate={value}",
                   cwd=tmp_path)
        _one_line_error(r, f"learning_rate={value}: Input should be a finite number")
