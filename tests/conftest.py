from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.cli import tally_here
from tests.support.corpus import Corpora
from tests.support.layers import longest_first


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    longest_first(items)


# One JAX compilation cache for the session, shared by the in-process tests and every training
# host process they start: the same small model compiles once instead of once per process.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="tally-jax-cache-"))


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
