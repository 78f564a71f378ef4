"""Manifest, reconcile and diff on a real multi-process Dask cluster: `dask scheduler` and `dask
worker` as separate OS processes on 127.0.0.1 (bench/reference/dask_cluster.py), the jobs submitted
through the real CLI. They must give exactly what FnApiRunner gives; a worker killed mid-job
(SIGKILL) must leave either the exact report or one clear error and no report, never a wrong
report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from distributed import Client

from bench.reference.dask_cluster import DaskProcesses
from tally.audit.reconcile import reconcile
from tally.pipeline.manifest import build_manifest, manifest_info
from tally.pipeline.synth import synth_corpus
from tests.support import ROOT
from tests.test_reconcile import random_run, write_manifest

# Separate dask scheduler and worker processes and the jobs on them (~1.5 min).
pytestmark = pytest.mark.slow

RUNS = ("r0",)
SMALL_BUCKETS = "0.0001"  # --memory-gb: the smallest buckets, 10,000 records


def tally(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "tally"), *args]


def run_tally(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(tally(*args), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """A synthetic corpus and its manifest; a bigger manifest (five key buckets at the smallest
    bucket size) and a spool of a run with restarts and every kind of trouble
    (tests/test_reconcile.py); the FnApiRunner manifest and report of them."""
    root = tmp_path_factory.mktemp("dask-data")
    synth_corpus(root / "corpus", records=2000, seed=5, shards=3, length_scale=0.2)
    build_manifest(root / "corpus", root / "manifest.parquet", chunk_records=300)
    rng = np.random.default_rng(18)
    man = write_manifest(root / "keys.parquet", 49_000, 1000, rng, row_group=5000)
    for run in RUNS:
        random_run(root / "spool", man, 49_000, rng, run_id=run)
    assert list((root / "spool").glob("*/attempt=1"))  # a restart: replays are compared
    for run in RUNS:
        reconcile(run_id=run, manifest=root / "keys.parquet", out=root / f"fnapi-{run}",
                  spool=root / "spool", memory_gb=float(SMALL_BUCKETS))
    return {"root": root}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with DaskProcesses(2, folder=tmp_path_factory.mktemp("dask")) as c:
        yield c


def same_report(got: Path, want: Path) -> None:
    """Every number of report.json, and every table, equal."""
    a, b = (json.loads((p / "report.json").read_text()) for p in (got, want))
    for r in (a, b):  # when and how it was run: the only things that may differ
        r.pop("generated_at"), r["provenance"].pop("command_line")
    assert a == b
    for name in ("steps", "hosts", "domains"):
        table = f"{name}.parquet"
        assert pq.read_table(got / table).equals(pq.read_table(want / table))
    assert pq.read_table(got / "records").equals(pq.read_table(want / "records"))
    assert not (got / ".work").exists()


def test_manifest_on_the_cluster_equals_fnapi(data, cluster, tmp_path):
    root = data["root"]
    # Paths relative to the submitting process's directory, which the workers do not share.
    done = run_tally("manifest", "corpus", "-o", str(tmp_path / "m.parquet"), "-q",
                     "--runner", "dask", "--dask-address", cluster.address, cwd=root)
    assert done.returncode == 0, done.stderr
    want = manifest_info(root / "manifest.parquet")
    assert manifest_info(tmp_path / "m.parquet") == want
    assert pq.read_table(tmp_path / "m.parquet").equals(pq.read_table(root / "manifest.parquet"))


def reconcile_args(root: Path | str, run: str, out: Path | str, address: str) -> list[str]:
    return ["reconcile", "--spool", str(Path(root, "spool")), "--manifest",
            str(Path(root, "keys.parquet")), "--run", run, "-o", str(out), "--memory-gb",
            SMALL_BUCKETS, "--runner", "dask", "--dask-address", address]


def test_reconcile_on_the_cluster_equals_fnapi(data, cluster, tmp_path):
    root = data["root"]
    with Client(cluster.address) as client:
        workers = {w["name"] for w in client.scheduler_info()["workers"].values()}
    assert workers == {"worker-0", "worker-1"}  # separate processes, started by the fixture
    for run in RUNS:
        # Relative paths, as in the manifest test.
        done = run_tally(*reconcile_args(".", run, tmp_path / run, cluster.address), cwd=root)
        assert done.returncode == 0, done.stderr
        same_report(tmp_path / run, root / f"fnapi-{run}")


def test_diff_on_the_cluster_equals_fnapi(data, cluster, tmp_path):
    """The post-hoc diff job (a run against itself from the spool and from the ledger) on the
    same cluster: exactly FnApiRunner's diff.json and tables."""
    from tally.audit.ledger.database import Ledger
    from tally.audit.ledger.ingest import ingest
    from tally.audit.posthoc.diff import diff
    from tally.audit.posthoc.sources import run_source

    root = data["root"]
    with Ledger(tmp_path / "l.duckdb") as ledger:
        ingest(root / "spool", ledger)
    a, b = run_source(root / "spool", "r0"), run_source(tmp_path / "l.duckdb", "r0")
    want = diff(a=a, b=b, manifest=root / "keys.parquet", out=tmp_path / "fnapi",
                memory_gb=float(SMALL_BUCKETS))
    done = run_tally("diff", "--manifest", "keys.parquet", "-o", str(tmp_path / "dask"),
                     "--a", "spool:r0", "--b", f"{tmp_path / 'l.duckdb'}:r0", "--memory-gb",
                     SMALL_BUCKETS, "--runner", "dask", "--dask-address", cluster.address,
                     cwd=root)
    assert done.returncode == 0, done.stderr
    got = json.loads((tmp_path / "dask" / "diff.json").read_text())
    for d in (got, want):
        d.pop("generated_at", None), d["provenance"].pop("command_line")
        d.get("a", {}).pop("source", None), d.get("b", {}).pop("source", None)
    assert got == want
    assert want["first_divergent_step"] is None  # a run against itself
    for table in sorted(p.name for p in (tmp_path / "fnapi").glob("*.parquet")):
        assert pq.read_table(tmp_path / "dask" / table).equals(
            pq.read_table(tmp_path / "fnapi" / table)), table


def kill_a_busy_worker(cluster: DaskProcesses, job: subprocess.Popen, out: Path,
                       busy: str) -> dict:
    """SIGKILL the worker that holds the most of the job (`busy`: "processing" counts the tasks
    it is running or queued to run; "held" adds the results in its memory that later tasks
    need), once the read stage has written its first bucket file and before the job saved its
    results. Returns what the kill hit, checked right after it."""
    work = out / ".work"
    with Client(cluster.address) as client:
        names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
        deadline = time.monotonic() + 120
        while job.poll() is None and time.monotonic() < deadline:
            if any((work / "buckets").glob("*.bin")):
                load = {a: len(keys) for a, keys in client.processing().items()}
                if busy == "held":
                    for a, keys in client.has_what().items():
                        load[a] = load.get(a, 0) + len(keys)
                victim, tasks = max(load.items(), key=lambda kv: kv[1])
                if tasks:
                    proc = cluster.workers[int(names[victim].rsplit("-", 1)[1])]
                    proc.kill()
                    return {"worker": names[victim], "tasks": tasks,
                            "job_running": job.poll() is None and not (work / "saved").exists(),
                            "killed": proc.wait(10) == -9}
            time.sleep(0.005)
    raise AssertionError(f"no busy worker to kill while the job ran (exit {job.returncode})")


@pytest.mark.parametrize("allowed_failures", [3, 0])
def test_a_worker_killed_mid_job_recovers_or_fails_cleanly(data, tmp_path, allowed_failures):
    """Dask's default (3 deaths per task allowed): the tasks and the results the dead worker
    held are redone on the other worker, and the report is exactly FnApiRunner's. With no death
    allowed (`allowed-failures` 0 on the scheduler), the tasks the dead worker was running fail
    the job: one `tally: error:` line, exit 2, no report."""
    root, run, out = data["root"], RUNS[0], tmp_path / "report"
    env = {"DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": str(allowed_failures)}
    with DaskProcesses(2, env=env, folder=tmp_path / "dask") as cluster:
        # -q: no progress lines, so that stderr is the error line alone
        job = subprocess.Popen(tally(*reconcile_args(root, run, out, cluster.address), "-q"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            hit = kill_a_busy_worker(cluster, job, out,
                                     busy="held" if allowed_failures else "processing")
            stdout, stderr = job.communicate(timeout=180)
        finally:
            if job.poll() is None:
                job.kill()
        assert len(cluster.alive()) == 1
    # The kill landed on a worker with work of the job, while the job ran.
    assert hit["killed"] and hit["tasks"] > 0 and hit["job_running"], hit
    if allowed_failures:
        assert job.returncode == 0, stderr
        same_report(out, root / f"fnapi-{run}")
    else:
        assert job.returncode == 2, (stdout, stderr)
        lines = [line for line in stderr.splitlines() if line.strip()
                 and not line.startswith("WARNING:root:")]  # Beam's import-time warning
        assert len(lines) == 1 and lines[0].startswith("tally: error: a Dask worker died"), \
            stderr
        assert not (out / "report.json").exists() and not (out / "records").exists()


def test_an_unreachable_scheduler_is_one_clear_error(data, tmp_path):
    from tally.trainer.launch import free_port

    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    done = subprocess.run(tally(*reconcile_args(data["root"], RUNS[0], tmp_path, address)),
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "1s"})
    assert done.returncode == 2
    assert f"tally: error: cannot reach the Dask scheduler at {address}" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "report.json").exists()
