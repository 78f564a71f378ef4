from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.cli import tally_here
from tests.support.corpus import Corpora
from tests.support.layers import longest_first


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    longest_first(items)


# The Ctrl-C tests send SIGINT to the commands they start: a suite started as a background job
# of a shell without job control (`(pytest &)`, a script's `pytest &`) inherits SIGINT ignored,
# passes it on to every child, and 3 of those tests saw their command run to the end (exit 0,
# or a 100,000-step train timing out). A user's Ctrl-C is what they test, so the suite takes it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config: pytest.Config) -> None:
    _suite_temp(config)
    _jax_cache(config)


def _suite_temp(config: pytest.Config) -> None:
    """The session's temporary files in a folder of its own, removed at its end. What the
    loaders and runners under test leave in the temporary directory by design (Streaming's
    file locks, two a dataset; multiprocessing's pymp-* folders of killed workers; Beam's
    pipeline temp; Dask's scratch space; torch's and OLMo-core's compile caches) went into /tmp,
    ~170 entries a run. pytest's own folders (tmp_path, kept for the last 3 sessions) stay
    where they were. Made by the process that starts the session; its workers and every
    process they start inherit TMPDIR."""
    if "TALLY_SUITE_TMP" in os.environ:  # the session's, in a worker (or the caller's)
        return
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    folder = tempfile.mkdtemp(prefix="tally-suite-")
    os.environ["TMPDIR"] = os.environ["TALLY_SUITE_TMP"] = folder
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    # OLMo-core makes a triton cache folder for every process that imports it, under a fixed
    # /tmp path unless told otherwise.
    os.environ.setdefault("OLMO_TRITON_CACHE_BASE", os.path.join(folder, "olmo-triton-cache"))
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def _jax_cache(config: pytest.Config) -> None:
    """One JAX compilation cache for the session, shared by the in-process tests and every
    training host process they start: the same small model compiles once instead of once per
    run, every host of a multi-host run reading the entry its process 0 wrote
    (trainer/distributed.py: ~5 CPU s a host and start saved). Made by the process that
    starts the session (pytest-xdist's workers inherit it with its environment) and removed
    at its end. A size bound makes JAX lock the folder (filelock): unbounded it writes entries
    in place, and a host of the other worker could read one half written (a warning on
    stderr, which the quiet-output tests would see)."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # the caller's (or the session's, in a worker)
        return
    folder = tempfile.mkdtemp(prefix="tally-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def in_process(monkeypatch) -> None:
    """`tally.audit.cli.main` runs the command in this process (not in a supervised child), so
    that capsys sees its output."""
    monkeypatch.setenv("TALLY_SUPERVISED", "1")


@pytest.fixture
def cli(monkeypatch, capsys) -> Callable[..., tuple[int, str, str]]:
    """`cli(*ARGS, cwd=ROOT, **ENV)`: `tally ARGS` in this process, (exit status, stdout,
    stderr) (tests.support.cli.tally_here)."""
    return lambda *args, **env: tally_here(monkeypatch, capsys, *args, **env)


@pytest.fixture(scope="session")
def corpora(tmp_path_factory) -> Corpora:
    """Synthetic corpora and manifests, built once per session (tests.support.corpus)."""
    return Corpora(tmp_path_factory.mktemp("corpora"))
