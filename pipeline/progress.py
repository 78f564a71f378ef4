"""Progress for the waits of the command line (a reconcile, a pre-flight shadow run, a
comparison of checkpoints, the start of the service): a tqdm bar on stderr that names the
stage under way and keeps its clock moving while a stage gives no count, fed by a count that
a thread polls (files a job has written, whatever runner or process writes them).

Redraws (`\r`) go to a terminal only. Into a pipe or a file (CI, a container's log, a service
manager's journal) each stage is one log line when it starts (tally.audit.core.logs), nothing more:
a bar redrawn there is a line per redraw, each starting with a carriage return."""

from __future__ import annotations

import threading
from collections.abc import Callable

from tqdm import tqdm

from tally.audit.core.logs import info_line, terminal


class Progress:
    """`with Progress("reconcile", enabled) as p: p.stage("job", total=n, count=fn)`."""

    def __init__(self, desc: str, enabled: bool = True, every: float = 0.5) -> None:
        # Off a terminal, one line per stage: a bar redrawn every 30 s still wrote ~27
        # `\r`-lines for the 825 s rebuild of the live state at 500M rows.
        self.desc, self.every = desc, every
        self.enabled = enabled and terminal()
        self.lines = enabled and not self.enabled
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
        if self.lines:
            info_line("tally.progress", f"{self.desc}: {name}"
                      + (f" ({total:,} parts)" if total else ""))
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


def bar(enabled: bool, **kwargs: object) -> tqdm:
    """A tqdm bar (`tqdm(**kwargs)`) on a terminal; elsewhere a disabled one, after one line
    naming what it counts (the manifest job's ranges, an ingest's files)."""
    if enabled and not terminal():
        total = kwargs.get("total")
        info_line("tally.progress", f"{kwargs.get('desc', '')}: {total:,} {kwargs.get('unit', '')}"
                  if isinstance(total, int) else str(kwargs.get("desc", "")))
    return tqdm(**kwargs, disable=not (enabled and terminal()))
