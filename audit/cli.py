"""`tally`: the command line, thin over the audit core."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from tally.audit.commands import COMMANDS, SIGNALS
from tally.audit.core.errors import TallyError

EXIT_CODES = """exit status:
  0    done (preflight: safe to resume)
  1    a check failed: reconcile --strict with a FAIL verdict, diff --strict with runs that
       differ or a FAIL verdict, preflight unsafe; train: the status of the host that failed
  2    bad input or a missing extra, said in one line on stderr (tally: error: ...);
       preflight: cannot tell
  130  interrupted (Ctrl-C, or SIGTERM); nothing half made is left behind
  141  the output's reader went away (`tally ledger L | head`): nothing more is printed"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tally", description=__doc__, epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from tally.audit.extras import version

    p.add_argument("--version", action="version", version=f"tally {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:  # each adds its parser(s), its handler beside it
        command.add_parser(sub)
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Command-line arguments; what follows `--` goes to Beam (commands that run a pipeline)."""
    argv = list(argv)
    beam = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = build_parser()
    args = parser.parse_args(argv[: len(argv) - len(beam) - 1] if "--" in argv else argv)
    if beam and not hasattr(args, "runner"):
        parser.error(f"'tally {args.command}' takes no Beam options after '--'")
    if beam:
        args.beam_args = beam
    return args


# Commands whose work runs in worker threads and processes (Beam, Grain workers, training
# hosts): a Ctrl-C that reached all of them printed a traceback from each (110-150 lines for a
# reconcile). They run as a child in a session of its own, so the terminal's Ctrl-C reaches
# only this process, which stops the child's whole process group and says so in one line.
SUPERVISED = {"reconcile", "manifest", "train", "demo", "preflight", "compare", "diff",
              "exposure", "replay"}
_CHILD = "TALLY_SUPERVISED"


def main(argv: Sequence[str] | None = None) -> int:
    kept = _logging_state()
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # while starting, before the command's own handling
        print("tally: interrupted", file=sys.stderr)
        return 130
    finally:
        # A command called in-process (a notebook, a test) leaves logging as it found it:
        # its quiet levels and handlers silenced the progress lines of what ran next.
        _restore_logging(kept)


_LOGGERS = ("", "tally")  # the loggers a command sets up


def _logging_state() -> list[tuple[logging.Logger, int, list[logging.Handler], bool]]:
    return [(log, log.level, list(log.handlers), log.propagate)
            for log in map(logging.getLogger, _LOGGERS)]


def _restore_logging(kept: list[tuple[logging.Logger, int, list[logging.Handler], bool]]
                     ) -> None:
    for log, level, handlers, propagate in kept:
        log.setLevel(level)
        log.handlers[:] = handlers
        log.propagate = propagate


def _main(argv: list[str]) -> int:
    from tally.audit import extras
    from tally.audit.core import allocator, cpu
    from tally.pipeline import beam_filesystems

    cpu.tune()  # before anything loads numpy, and inherited by the processes it starts
    allocator.tune()  # before the work's first allocations, and inherited by its workers
    args = parse(argv)
    # Beam logs optional-dependency warnings at import; they are noise on a terminal.
    logging.getLogger().setLevel(logging.ERROR)
    try:
        extras.check(args.command)
    except extras.MissingExtra as exc:
        print(f"tally: error: {exc}", file=sys.stderr)
        return 2
    if args.command in SUPERVISED and not os.environ.get(_CHILD):
        return _supervise(argv, args)
    if getattr(args, "runner", None) in beam_filesystems.LOCAL_RUNNERS:
        beam_filesystems.local_only()  # before the job imports Beam (its workers do the same)
    try:
        # A supervised child keeps the default SIGTERM: its supervisor stops it and says so.
        with SIGNALS.installed(args.command not in SUPERVISED), \
                _workers_quiet(getattr(args, "quiet", False)):
            code = args.func(args)
        if SIGNALS.received:
            raise KeyboardInterrupt
        return code
    except TallyError as exc:
        print(f"tally: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        need = extras.missing(args.command, exc)
        if need is None:
            raise
        print(f"tally: error: {need}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not os.environ.get(_CHILD):  # a supervised child's supervisor says it, once
            print("tally: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _output_gone()
        return 141
    except Exception:
        if not SIGNALS.received:
            raise
        # What a signal broke on its way (a DuckDB statement it interrupted: "Query
        # interrupted") is the interrupt, not an error of its own.
        print("tally: interrupted", file=sys.stderr)
        return 130


def _output_gone() -> None:
    """The reader of this command's output went away (`tally ledger L | head`): it stops
    quietly, as a program killed by SIGPIPE does (status 141). Python leaves SIGPIPE ignored,
    so the write raised BrokenPipeError; what is left in the buffers is dropped, or the
    flush at exit would raise it again."""
    null = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            os.dup2(null, stream.fileno())
    os.close(null)


@contextlib.contextmanager
def _workers_quiet(quiet: bool) -> Iterator[None]:
    """With -q, what worker processes print on stderr is dropped (Beam's SDK workers log 40
    INFO lines for a `--mode multi_processing` reconcile, and each says "apitools not found"),
    while Tally's own lines still reach the terminal: the processes this one starts inherit
    file descriptor 2, which points at /dev/null meanwhile; sys.stderr writes to the real one."""
    if not quiet:
        yield
        return
    sys.stderr.flush()
    real = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    before = sys.stderr
    sys.stderr = open(os.dup(real), "w", buffering=1, encoding=before.encoding,  # noqa: SIM115
                      errors="backslashreplace")
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stderr.close()
        sys.stderr = before
        os.dup2(real, 2)
        os.close(real)


def _supervise(argv: list[str], args: argparse.Namespace) -> int:
    """Run the command in a child process of its own session; on Ctrl-C (or SIGTERM) stop its
    process group, remove what it left half made, and print one line."""
    import signal

    leftovers = _half_made(args)
    child = subprocess.Popen([sys.executable, "-m", "tally.audit.cli", *argv],
                             env={**os.environ, _CHILD: "1"}, start_new_session=True)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return child.wait()
    except KeyboardInterrupt:
        _stop_group(child)
        for path in leftovers:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        print("tally: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_group(child: subprocess.Popen, grace_s: float = 5.0) -> None:
    import signal

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(wait)
            # Grandchildren in the group (Beam workers, training hosts) go with the signal.
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
        return


def _half_made(args: argparse.Namespace) -> list[Path]:
    """What the command would leave half made if it were stopped now: an output directory it
    creates (the whole of it), or the work files inside one that exists already."""
    if args.command in ("reconcile", "diff", "exposure"):
        out = Path(args.output)
        if getattr(args, "follow", None) is not None:  # its report and checkpoint stand
            return []
        return [out / ".work"] if out.exists() else [out]
    if args.command == "replay":
        from tally.pipeline.replay import ReplaySpec, work_dir

        return [work_dir(ReplaySpec(loader="", hosts=1, steps=1, spool=Path(args.spool),
                                    run_id=args.run))]
    if args.command == "manifest":
        out = Path(args.output)
        return [out.with_name(f".{out.name}.parts"), out.with_name(f".{out.name}.tmp")]
    return []


if __name__ == "__main__":
    sys.exit(main())
