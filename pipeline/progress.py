"""Progress for the waits of the command line (a reconcile, a pre-flight shadow run, a
comparison of checkpoints, the start of the service): a tqdm bar on stderr that names the
stage under way and keeps its clock moving while a stage gives no count, fed by a count that
a thread polls (files a job has written, whatever runner or process writes them)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from tqdm import tqdm


class Progress:
    """`with Progress("reconcile", enabled) as p: p.stage("job", total=n, count=fn)`."""

    def __init__(self, desc: str, enabled: bool = True, every: float | None = None) -> None:
        # Twice a second on a terminal; into a pipe or a file (a container's log, a service
        # manager's journal) twice a minute: each redraw is a line there, and the 825 s
        # rebuild of the live state at 500M rows wrote ~1,650 of them.
        self.desc, self.enabled = desc, enabled
        self.every = every if every is not None else 0.5 if _terminal() else 30.0
        self._count: Callable[[], int] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar: tqdm | None = None

    def __enter__(self) -> Progress:
        if self.enabled:
            self._bar = tqdm(desc=self.desc, total=None, unit="", leave=True,
                             bar_format="{desc} [{elapsed}]")
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        return self

    def stage(self, name: str, total: int | None = None,
              count: Callable[[], int] | None = None) -> None:
        """Start a stage: its name, and optionally how many parts and how to count those done."""
        if self._bar is None:
            return
        with self._lock:
            self._count = count
            self._bar.reset(total=total)
            self._bar.bar_format = ("{desc} {n_fmt}/{total_fmt} [{elapsed}]" if total
                                    else "{desc} [{elapsed}]")
            self._bar.set_description_str(f"{self.desc}: {name}", refresh=False)
            self._update()

    def _update(self) -> None:
        if self._count is not None:
            self._bar.n = self._count()
        self._bar.refresh()

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            with self._lock:
                self._update()

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._stop.set()
            self._thread.join()
            with self._lock:
                if exc[0] is None:
                    self._update()
                self._bar.close()


def _terminal() -> bool:
    """Whether the bar's stream (stderr) is a terminal."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False
