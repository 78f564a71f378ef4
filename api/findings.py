"""Live findings: the causes reconcile names, kept current while the run goes on.

The service runs one live reconcile per run over the spool it ingests (`tally reconcile --spool
... --follow EVERY`, a child process at low priority: tally.audit.reconcile.follow), which
folds in each round only the files published since the last and rewrites the run's report.
So a live finding is, by construction, the finding `tally reconcile` gives for the same files:
the same mechanism, the same numbers, as of the files that round read; a round costs what its
new rows touch, not what the run consumed. The cheap alerts (thresholds over the aggregates)
stay instant; these follow within a round or two.
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
from typing import IO, Any

log = logging.getLogger("tally.api")
# Live reconciles at once: one without a checkpoint reads its run's whole spool when it starts
# (a ledger of many finished runs must not start a full pass for every one of them together).
FOLLOWING = 2
# A live reconcile whose run has not changed for this long (and this many of its rounds) after
# its last round stops; its report stays, and a change to the run starts it again.
IDLE_S, IDLE_ROUNDS = 60.0, 6


class LiveFindings:
    def __init__(self, spool: Path, manifest: str, work: Path, every: float,
                 versions: Any) -> None:
        """`versions()` -> {run_id: ledger version} of the runs to keep current."""
        self.spool, self.manifest, self.work, self.every = spool, manifest, work, every
        self.versions = versions
        self._children: dict[str, tuple[subprocess.Popen, IO[str]]] = {}
        self._started: dict[str, float] = {}
        self._rounds: dict[str, int] = {}  # run -> the last round logged
        self._exits: dict[str, int] = {}  # run -> its live reconcile's exits since a round
        self._version: dict[str, int] = {}  # run -> its ledger version, as last seen
        self._changed: dict[str, float] = {}  # run -> when its version last moved
        # run -> when its last logged round began (wall clock), and when its version moved
        self._round_began: dict[str, float] = {}
        self._changed_wall: dict[str, float] = {}
        self._settled: dict[str, int] = {}  # run -> the version its stopped reconcile covers
        self._waits: dict[str, str] = {}  # run -> why its live reconcile waits, as last said
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tally-findings", daemon=True)
        self.failures = 0

    def start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        for child, err in self._children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
            err.close()

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
        now = time.monotonic()
        versions = self.versions()
        for run_id, v in versions.items():
            if self._version.get(run_id) != v:
                self._version[run_id], self._changed[run_id] = v, now
                self._changed_wall[run_id] = time.time()
        for run_id, (child, err) in list(self._children.items()):
            self._logged(run_id)
            if child.poll() is not None:
                self._failed(run_id, child, err)
            elif now - self._changed[run_id] > max(IDLE_S, IDLE_ROUNDS * self.every) and \
                    self._round_began.get(run_id, -1e18) > self._changed_wall[run_id]:
                # A round that began after the run's last change has read all of it.
                self._idle(run_id, child, err)
        # Started for a run that changed since its last reconcile, the latest change first, a
        # few at a time; again after an exit only after `every`, doubling with each exit in a
        # row (up to 64x): one that keeps failing does not read its spool every round.
        todo = sorted((r for r in versions if r not in self._children
                       and self._settled.get(r) != versions[r]
                       and now - self._started.get(r, -1e18)
                       >= self.every * 2 ** min(self._exits.get(r, 0), 6)),
                      key=lambda r: -self._changed[r])
        for run_id in todo[:max(0, FOLLOWING - len(self._children))]:
            if self._stop.is_set():
                return
            self._follow(run_id)

    def _idle(self, run_id: str, child: subprocess.Popen, err: IO[str]) -> None:
        """A live reconcile whose run stopped changing: stopped, its report kept."""
        child.kill()
        child.wait()
        err.close()
        del self._children[run_id]
        self._settled[run_id] = self._version[run_id]
        log.info("run %s: no change for %.0f s, its live reconcile stops (report as of step "
                 "%s)", run_id, time.monotonic() - self._changed[run_id],
                 self.summary(run_id)["as_of_step"])

    def _follow(self, run_id: str) -> None:
        out = self.work / run_id
        out.mkdir(parents=True, exist_ok=True)
        (out / "follow.json").unlink(missing_ok=True)  # a round of an earlier child's
        self._rounds.pop(run_id, None)
        self._round_began.pop(run_id, None)
        self._started[run_id] = time.monotonic()
        # Not supervised (the command itself runs here, so that killing it kills it), and
        # told this process' id, so that it ends when the service goes, even killed.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]),
            "TALLY_SUPERVISED": "1", "TALLY_FOLLOW_PARENT": str(os.getpid())}
        # Its log to a file, not a pipe: a long-lived child would block on a full pipe.
        err = open(out / "follow.log", "w")  # noqa: SIM115 (closed with the child)
        child = subprocess.Popen(
            [sys.executable, "-m", "tally.audit.cli", "reconcile", "--spool", str(self.spool),
             "--manifest", self.manifest, "--run", run_id, "-o", str(out), "-q",
             "--follow", str(self.every)],
            env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        with contextlib.suppress(OSError):  # below the service and the training beside it
            os.setpriority(os.PRIO_PROCESS, child.pid, 10)
        self._children[run_id] = (child, err)

    def _failed(self, run_id: str, child: subprocess.Popen, err: IO[str]) -> None:
        """A live reconcile that exited: counted and said; started again after `every`."""
        del self._children[run_id]
        err.close()
        self.failures += 1
        self._exits[run_id] = self._exits.get(run_id, 0) + 1
        try:
            tail = (self.work / run_id / "follow.log").read_text().strip().splitlines()[-1:]
        except OSError:
            tail = []
        log.warning("live findings of run %s: reconcile exited (%s): %s", run_id,
                    child.returncode, tail or "")

    def _logged(self, run_id: str) -> None:
        """A line for each round the run's live reconcile finished since the last look."""
        try:
            st = json.loads((self.work / run_id / "follow.json").read_text())
        except (OSError, ValueError):
            return
        if "waiting" in st:  # no round made (idle, if the run stays as it is)
            self._round_began[run_id] = st["began_at"]
            if st["round"] and self._waits.get(run_id) != st["waiting"]:
                log.warning("run %s: live reconcile waits, its report as of step %s stands: "
                            "%s", run_id, self.summary(run_id)["as_of_step"], st["waiting"])
            self._waits[run_id] = st["waiting"]
            return
        self._waits.pop(run_id, None)
        if st["round"] == self._rounds.get(run_id):
            return
        self._rounds[run_id] = st["round"]
        self._round_began[run_id] = st["began_at"]
        self._exits.pop(run_id, None)
        rep = self.summary(run_id)
        log.info("run %s: live reconcile finished: %s as of step %s (%s) in %.1f s", run_id,
                 rep["verdict"], rep["as_of_step"],
                 ", ".join(f["code"] for f in rep["findings"]) or "no findings",
                 st["seconds"],
                 extra={"run": run_id, "event": "live_reconcile", "verdict": rep["verdict"],
                        "as_of_step": rep["as_of_step"], "seconds": st["seconds"],
                        "round": st["round"], "full_passes": st["full_passes"],
                        "findings": [f["code"] for f in rep["findings"]]})
