"""What the commands' handlers share at run time: JSON and progress on the console, Tally's log
lines on stderr, one-line ledger errors, and the signal handling (`SIGNALS`) the dispatcher
installs around a command (tally.audit.cli)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from tally.audit.core.errors import TallyError


@contextlib.contextmanager
def ledger_errors(path: str | Path) -> Iterator[None]:
    """A ledger whose disk is full, or whose file is damaged (truncated, overwritten), said in
    one line naming the file (tally.audit.ledger.database.ledger_error), whether DuckDB finds out at
    open or only when a query reaches the bad block."""
    from tally.audit.ledger.database import ledger_error

    try:
        yield
    except TallyError:  # said already (Ledger's own, at open)
        raise
    except Exception as exc:
        said = ledger_error(path, exc)
        if said is None:
            raise
        raise said from None


def print_json(value: object) -> None:
    print(json.dumps(value, indent=2, default=str))


def progress(args: argparse.Namespace) -> bool:
    """Whether a command shows its progress: never with -q or --json (tally.audit.core.logs and
    tally.pipeline.progress keep redraws to a terminal)."""
    return not getattr(args, "quiet", False) and not getattr(args, "json", False)


def log_to_stderr(level: int, fmt: str = "text") -> None:
    """Tally's own log lines on stderr for the long-running commands (why a per-record state
    was rebuilt, quarantined files, snapshots written; the service's alerts and live
    reconciles), in `fmt` (tally.audit.core.logs: `tally: [level] ...` or JSON lines)."""
    from tally.audit.core import logs

    log = logging.getLogger("tally")
    for h in list(log.handlers):
        log.removeHandler(h)
    log.addHandler(logs.handler(fmt))
    log.setLevel(level)
    log.propagate = False


class Signals:
    """Ctrl-C (SIGINT) and SIGTERM (docker stop, systemd, kill) alike for the commands that run
    in this process (ingest, ledger, corpus synth, serve): `tally: interrupted`, status 130.

    By default a signal raises KeyboardInterrupt where the command is. A command that stops
    better at a point of its own (`graceful`: ingest, between two transactions) gets an event
    set instead; a second signal then ends the process at once, as a kill does (what was
    committed stays; nothing half is in the ledger)."""

    def __init__(self) -> None:
        self.received = False
        self._stop: threading.Event | None = None
        self._bar = False

    def graceful(self, progress: bool) -> threading.Event:
        """The event a signal sets; `progress`: a progress bar may be mid-line on stderr."""
        self._stop, self._bar = threading.Event(), progress
        return self._stop

    def __call__(self, signum: int, frame: object) -> None:
        stop = self._stop
        if stop is not None and stop.is_set():
            os.write(2, b"\ntally: interrupted\n" if self._bar else b"tally: interrupted\n")
            os._exit(130)
        self.received = True
        if stop is not None:
            stop.set()
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self, terminate_too: bool = True) -> Iterator[None]:
        """The handler for SIGINT (and SIGTERM, with `terminate_too`) while the command runs,
        the previous ones after (a test may call `main` in its own process)."""
        import signal

        self.received, self._stop = False, None
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM) if terminate_too else (signal.SIGINT,)
        before = {sig: signal.signal(sig, self) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
            self._stop = None


SIGNALS = Signals()
