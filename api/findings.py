"""Live findings: the causes reconcile names, kept current while the run goes on.

The service re-runs the reconcile job itself over the spool it ingests (`tally reconcile --spool`
in a child process at low priority, one run at a time), for every run whose ledger version
moved, at most every `every` seconds. So a live finding is, by construction, the finding
`tally reconcile` gives for the same files: the same mechanism, the same numbers, as of the
steps that job read. The cheap alerts (thresholds over the aggregates) stay instant; these
follow within a few reconcile durations.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("tally.api")


class LiveFindings:
    def __init__(self, spool: Path, manifest: str, work: Path, every: float,
                 versions: Any) -> None:
        """`versions()` -> {run_id: ledger version} of the runs to keep current."""
        self.spool, self.manifest, self.work, self.every = spool, manifest, work, every
        self.versions = versions
        self._done: dict[str, int] = {}  # run -> the version its findings are of
        self._last: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tally-findings", daemon=True)
        self._child: subprocess.Popen | None = None
        self.failures = 0

    def start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()
        self._thread.join(30)

    def report(self, run_id: str) -> dict[str, Any] | None:
        """The newest live report of a run (None: none yet)."""
        try:
            return json.loads((self.work / run_id / "report.json").read_text())
        except (OSError, ValueError):
            return None

    def summary(self, run_id: str) -> dict[str, Any]:
        """What the summary shows: the live verdict and findings, and as of when."""
        rep = self.report(run_id)
        if rep is None:
            return {"verdict": None, "findings": [], "integrity": None, "as_of_step": None,
                    "first_bad_step": None, "generated_at": None}
        return {"verdict": rep["verdict"], "findings": rep["findings"],
                "integrity": rep["integrity"], "as_of_step": rep["consumption"]["last_step"],
                "first_bad_step": rep.get("first_bad_step"),
                "generated_at": rep["generated_at"]}

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self._round()
            except Exception:  # shown by the log; the loop goes on with the next round
                log.exception("live findings round failed")

    def _round(self) -> None:
        for run_id, version in self.versions().items():
            if self._stop.is_set():
                return
            if self._done.get(run_id) == version or \
                    time.monotonic() - self._last.get(run_id, -1e18) < self.every:
                continue
            self._last[run_id] = time.monotonic()
            if self._reconcile(run_id):
                self._done[run_id] = version

    def _reconcile(self, run_id: str) -> bool:
        out = self.work / run_id
        t0 = time.monotonic()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
        self._child = subprocess.Popen(
            [sys.executable, "-m", "tally.audit.cli", "reconcile", "--spool", str(self.spool),
             "--manifest", self.manifest, "--run", run_id, "-o", str(out), "-q"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        with contextlib.suppress(OSError):  # below the service and the training beside it
            os.setpriority(os.PRIO_PROCESS, self._child.pid, 10)
        _, err = self._child.communicate()
        if self._child.returncode not in (0, 1):
            self.failures += 1
            log.warning("live findings of run %s: reconcile failed: %s", run_id,
                        err.strip().splitlines()[-1:] or "")
            return False
        took = time.monotonic() - t0
        rep = self.summary(run_id)
        log.info("run %s: live reconcile finished: %s as of step %s (%s) in %.1f s", run_id,
                 rep["verdict"], rep["as_of_step"],
                 ", ".join(f["code"] for f in rep["findings"]) or "no findings", took,
                 extra={"run": run_id, "event": "live_reconcile", "verdict": rep["verdict"],
                        "as_of_step": rep["as_of_step"], "seconds": round(took, 3),
                        "findings": [f["code"] for f in rep["findings"]]})
        return True
