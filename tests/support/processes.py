"""Python snippets in a child process (from the repository, which is on its PYTHONPATH), and a
child under a resource limit."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import ROOT


def run_py(code: str, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, **kw)


def popen_py(code: str, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def limited(kind: str, limit: int) -> list[str]:
    """An argv prefix that runs `python REST...` under the resource limit RLIMIT_<kind> of
    `limit`, set in the child itself before it execs: a preexec_fn runs Python between fork
    and exec, which can deadlock in a test process that JAX's threads share."""
    code = ("import os, resource, sys; n = int(sys.argv[2]); "
            "resource.setrlimit(getattr(resource, 'RLIMIT_' + sys.argv[1]), (n, n)); "
            "os.execv(sys.executable, [sys.executable, *sys.argv[3:]])")
    return [sys.executable, "-c", code, kind, str(limit)]
