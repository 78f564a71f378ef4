"""The `tally` command line, run from a test.

`tally` runs it as a user does, in a child process (`python -m tally.audit.cli`), where exit
statuses, signals, supervision and start-up are part of what is tested. `tally_here` runs the
CLI's own `main` in the test process (as its supervised child would), for cases refused before
any work, where a child importing Beam, JAX or torch would cost seconds and prove nothing more.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from tests.support import ROOT

# The environment of a command that must not lean on the caller's (a user's shell): only where
# Python finds the repository and the system's programs.
BARE_ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}


def command(*args: object, python: Sequence[str] | None = None) -> list[str]:
    """The argv of `tally ARGS` (under `python`, e.g. a resource-limited interpreter)."""
    return [*(python or [sys.executable]), "-m", "tally.audit.cli", *map(str, args)]


def environment(env: Mapping[str, str] | None = None, *, bare: bool = False) -> dict[str, str]:
    """The caller's environment (or BARE_ENV) with the repository on PYTHONPATH, and `env`."""
    base = BARE_ENV if bare else {**os.environ, "PYTHONPATH": str(ROOT)}
    return {**base, **(env or {})}


def tally(*args: object, cwd: str | Path = ROOT, env: Mapping[str, str] | None = None,
          bare: bool = False, timeout: float = 600, python: Sequence[str] | None = None,
          **kw) -> subprocess.CompletedProcess:
    """`tally ARGS` in a child process; its output captured as text unless `stdout` or
    `stderr` is given."""
    if "stdout" not in kw and "stderr" not in kw:
        kw["capture_output"] = True
    return subprocess.run(command(*args, python=python), text=True, cwd=cwd, timeout=timeout,
                          env=environment(env, bare=bare), **kw)


def tally_popen(*args: object, cwd: str | Path = ROOT, env: Mapping[str, str] | None = None,
                bare: bool = False, python: Sequence[str] | None = None,
                **kw) -> subprocess.Popen:
    """`tally ARGS` started in a child process, stdout and stderr piped as text unless given."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(command(*args, python=python), text=True, cwd=cwd,
                            env=environment(env, bare=bare), **kw)


# A torchrun launch's variables: a test process started under one must not hand them on.
LAUNCHER_VARIABLES = ("WORLD_SIZE", "GLOBAL_RANK", "NNODES")


def tally_here(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: object,
               cwd: str | Path = ROOT, **env: str) -> tuple[int, str, str]:
    """`tally ARGS` through tally.audit.cli.main in this process, from `cwd`, with `env` set
    for this call only: (exit status, stdout, stderr)."""
    from tally.audit.cli import main

    with monkeypatch.context() as m:
        m.chdir(cwd)
        for k in LAUNCHER_VARIABLES:
            m.delenv(k, raising=False)
        for k, v in {**env, "TALLY_SUPERVISED": "1"}.items():
            m.setenv(k, v)
        capsys.readouterr()
        code = main(list(map(str, args)))
        out, err = capsys.readouterr()
    return code, out, err


def tally_bare(*args: object, **kw) -> subprocess.CompletedProcess:
    """`tally ARGS` as from a bare shell: nothing of this process' environment (BARE_ENV)."""
    return tally(*args, bare=True, **kw)
