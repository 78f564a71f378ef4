"""What a user sees on stderr is Tally's: `tally: ...` lines, nothing of the libraries below.

Real commands (`python -m tally.audit.cli`), real hosts (jax.distributed, gloo), real Beam workers
and a real local Dask cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.api import poll, write_steps
from tests.support.cli import tally, tally_popen
from tests.support.manifest import uniform_manifest

# Real 2-host training runs, Beam workers and a Dask cluster, stopped and read.
pytestmark = pytest.mark.slow


def foreign(err: str) -> list[str]:
    """stderr's lines that are not Tally's own."""
    return [line for line in err.splitlines() if line and not line.startswith("tally: ")]


def assert_quiet(err: str) -> None:
    assert foreign(err) == [], err[-3000:]
    for noise in ("SIGTERM caught", "gloo", "Traceback", "leaked semaphore", "WARNING"):
        assert noise.lower() not in err.lower(), err[-3000:]


@pytest.fixture(scope="module")
def corpus(corpora) -> Path:
    return corpora.corpus(records=300, seed=1, length_scale=0.1, max_len=64)


def _train(corpus: Path, spool: Path) -> subprocess.Popen:
    return tally_popen("train", "--hosts", "2", f"corpus={corpus}", f"spool={spool}",
                       "steps=100000", "flush_every=1", "d_model=16", "n_layers=1", "seq_len=32",
                       start_new_session=True)


def _until_training(proc: subprocess.Popen, spool: Path) -> None:
    """Until both hosts train (each has published a file)."""
    assert poll(lambda: len(list(spool.glob("*/*/host=*/seg-*"))) >= 2
                or proc.poll() is not None, timeout=180, every=0.2)
    assert proc.poll() is None, proc.communicate()


def test_ctrl_c_during_a_two_host_train_prints_only_tallys_line(corpus, tmp_path):
    """Each host printed XLA's preemption notifier's "SIGTERM caught at ..." and trained on
    until the launcher's SIGKILL; the supervised launcher's own `tally: interrupted` could
    double the supervisor's. Every host process is gone after it."""
    spool = tmp_path / "spool"
    proc = _train(corpus, spool)
    try:
        _until_training(proc, spool)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    assert err == "tally: interrupted\n", err[-3000:]
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", f"tally.trainer.host.*{spool}"], capture_output=True,
                          text=True)
    assert left.stdout == ""


def test_a_host_that_dies_is_named_in_tallys_lines_without_a_gloo_traceback(corpus, tmp_path):
    """The surviving host's collective failed with a JaxRuntimeError traceback of gloo's
    "Connection reset by peer"; now one line says another host left, and the launcher's
    line names the host that died."""
    spool = tmp_path / "spool"
    proc = _train(corpus, spool)
    try:
        _until_training(proc, spool)
        found = subprocess.run(["pgrep", "-f", f"tally.trainer.host.*{spool}.*--host 1"],
                               capture_output=True, text=True).stdout.split()
        os.kill(int(found[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 137
    assert foreign(err) == [] and "Traceback" not in err, err[-3000:]
    assert err.endswith("tally: host 1 ended with signal 9; stopping the other hosts\n"), err


@pytest.mark.parametrize("runner", [[], ["--runner", "dask", "--workers", "1"],
                                    ["--mode", "multi_processing", "--workers", "2"]],
                         ids=["in_memory", "dask", "multi_processing"])
def test_reconcile_without_q_prints_only_tallys_lines(tmp_path, runner):
    """Beam's workers (a local Dask cluster's, or the SDK workers of multi_processing) logged
    "WARNING:root:apitools not found, and bigquery client libraries are not available" at
    their import of Beam, and the SDK workers some 20 INFO lines each. A local Dask cluster's
    scheduler warned "Port 8787 is already in use" whenever another one ran on the machine
    (its HTTP server's default port): the port is held here while the job runs."""
    import socket

    spool = tmp_path / "spool"
    write_steps(spool, "r", host=0, hosts=1, steps=range(6), n=40, seed=0, flush_every=3)
    uniform_manifest(tmp_path / "m.parquet", 40)
    with socket.socket() as taken:
        try:
            taken.bind(("", 8787))
            taken.listen()
        except OSError:
            pass  # another process holds it already: the same situation
        done = tally("reconcile", "--spool", spool, "--manifest", tmp_path / "m.parquet",
                     "--run", "r", "-o", tmp_path / "rep", *runner, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reconcile r: writing the report" in done.stderr  # Tally's own lines stay
    assert_quiet(done.stderr)


def test_reading_a_checkpoints_loader_state_says_nothing_about_a_read_only_directory(
        tmp_path, caplog):
    """Orbax logged "Given directory is read only=<dir>" (and that it set
    save_interval_steps=0) each time the pre-flight check opened a checkpoint to read it: it
    read as if the user's checkpoint directory could not be written."""
    import logging

    import numpy as np

    from tally.audit.preflight.check import load_checkpoint_meta
    from tally.trainer import checkpoint

    checkpoint.save(checkpoint.manager(tmp_path / "ck"), 3, {"w": np.zeros(2, np.float32)},
                    {"m": np.zeros(2, np.float32)}, {"step": 3, "loaders": {}})
    with caplog.at_level(logging.DEBUG):
        assert load_checkpoint_meta(tmp_path / "ck")["step"] == 3
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    # Silenced while reading only (the logger's level set here: an in-process command run
    # earlier in this worker may have left the root logger at ERROR).
    with caplog.at_level(logging.WARNING, logger="absl"):
        logging.getLogger("absl").warning("Given directory is read only=%s", "elsewhere")
    assert "read only=elsewhere" in caplog.text


def test_ctrl_c_during_a_dask_reconcile_leaks_no_semaphore(tmp_path):
    """Stopped with its local Dask cluster open, the command left the cluster's semaphores to
    multiprocessing's resource tracker, which printed "UserWarning: resource_tracker: There
    appear to be 12 leaked semaphore objects to clean up at shutdown"; the cluster is closed
    now."""
    spool = tmp_path / "spool"
    write_steps(spool, "r", host=0, hosts=1, steps=range(6), n=40, seed=0, flush_every=3)
    uniform_manifest(tmp_path / "m.parquet", 40)
    proc = tally_popen("reconcile", "--spool", spool, "--manifest", tmp_path / "m.parquet",
                       "--run", "r", "-o", tmp_path / "rep", "--runner", "dask", "--workers",
                       "2", start_new_session=True)

    def workers() -> bool:  # the supervised child runs in a session of its own
        child = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                               text=True).stdout.split()
        return bool(child) and len(subprocess.run(
            ["pgrep", "-s", child[0], "-f", "spawn_main"], capture_output=True,
            text=True).stdout.split()) >= 2
    try:
        assert poll(lambda: workers() or proc.poll() is not None, timeout=60, every=0.05)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    assert err.endswith("tally: interrupted\n")
    assert_quiet(err)
