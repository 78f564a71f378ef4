"""A real multi-process dask.distributed cluster on 127.0.0.1, for tests and benchmarks.

`dask scheduler` and each `dask worker` run as separate OS processes, started through the
`dask` command line exactly as on a cluster (no LocalCluster inside the calling process). The
scheduler takes a free port from the OS (`--port 0`) and says which in its scheduler file, so
two clusters never race for a port. Workers run without a nanny, one thread each: killing a
worker's process removes that worker, which is what a machine lost mid-job looks like.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # importable by the workers, as by this process


class DaskProcesses:
    """`dask scheduler` plus `workers` `dask worker` processes; stopped on exit."""

    def __init__(self, workers: int, *, env: dict[str, str] | None = None,
                 folder: str | Path | None = None) -> None:
        self.n_start = workers
        self._tmp = None if folder else tempfile.TemporaryDirectory(prefix="tally-dask-")
        self.folder = Path(folder or self._tmp.name).resolve()
        self.env = {**os.environ, "PYTHONPATH": str(ROOT),
                    "DASK_DISTRIBUTED__LOGGING__DISTRIBUTED": "error", **(env or {})}
        self.scheduler: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.address = ""

    def _start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "wb")  # noqa: SIM115 (the process owns it)
        try:
            return subprocess.Popen([sys.executable, "-m", "dask", *args], env=self.env,
                                    cwd=self.folder, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def __enter__(self) -> DaskProcesses:
        self.folder.mkdir(parents=True, exist_ok=True)
        info = self.folder / "scheduler.json"
        self.scheduler = self._start("scheduler", "scheduler", "--host", "127.0.0.1",
                                     "--port", "0", "--no-dashboard", "--scheduler-file",
                                     str(info))
        try:
            self.address = self._wait(lambda: info.exists() and info.stat().st_size
                                      and json.loads(info.read_text())["address"],
                                      "the scheduler to write its address")
            for _ in range(self.n_start):
                self.add_worker(wait=False)
            self.wait_for_workers(self.n_start)
        except BaseException:
            self.__exit__()
            raise
        return self

    def add_worker(self, wait: bool = True) -> subprocess.Popen:
        name = f"worker-{len(self.workers)}"
        p = self._start(name, "worker", self.address, "--name", name, "--nthreads", "1",
                        "--no-nanny", "--no-dashboard", "--host", "127.0.0.1",
                        "--local-directory", str(self.folder / name))
        self.workers.append(p)
        if wait:
            self.wait_for_workers(len(self.alive()))
        return p

    def alive(self) -> list[subprocess.Popen]:
        return [p for p in self.workers if p.poll() is None]

    def wait_for_workers(self, n: int, timeout: float = 60) -> None:
        from distributed import Client

        with Client(self.address, timeout=timeout) as client:
            client.wait_for_workers(n, timeout=timeout)

    def _wait(self, ready, what: str, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError):
                got = ready()
                if got:
                    return got
            if self.scheduler.poll() is not None or time.monotonic() > deadline:
                log = (self.folder / "scheduler.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"timed out waiting for {what}:\n{log}")
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        # Workers first, while the scheduler can still take their goodbye; SIGKILL what does
        # not stop within 5 s (a worker whose scheduler is gone can hang in close).
        procs = [*self.workers, *([self.scheduler] if self.scheduler else [])]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if self._tmp is not None:
            self._tmp.cleanup()
