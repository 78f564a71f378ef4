from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent

# One JAX compilation cache for the session, shared by the in-process tests and every training
# host process they start: the same small model compiles once instead of once per process.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="tally-jax-cache-"))


def unpacked_batch(step: int, rows: int = 4, length: int = 16, n_records: int = 1000,
                   host: int = 0, hosts: int = 1) -> dict[str, np.ndarray]:
    """A deterministic one-record-per-row batch: row r of host h at step s reads one key."""
    keys = (np.arange(rows) + (step * hosts + host) * rows) % n_records
    rng = np.random.default_rng(keys[0])
    lens = rng.integers(1, length + 1, rows)
    tokens = np.zeros((rows, length), np.int32)
    seg = np.zeros((rows, length), np.int32)
    for r, (k, n) in enumerate(zip(keys, lens, strict=True)):
        tokens[r, :n] = record_tokens(int(k))[:n]
        seg[r, :n] = 1
    return {"tokens": tokens, "tokens_segment_ids": seg, "key": keys.astype(np.int64)}


def uniform_manifest(path: Path, n: int) -> Path:
    """A manifest of `n` train records (keys 0..n-1, content hash = key, 10 tokens each, one
    domain), for tests that need a manifest but not a corpus."""
    import pyarrow as pa

    from tally.pipeline.manifest_file import write_manifest_table

    keys = np.arange(n)
    t = pa.table({"record_key": keys, "content_hash": keys.astype(np.uint64),
                  "n_tokens": np.full(n, 10, np.int32), "domain": ["web"] * n,
                  "split": ["train"] * n, "source": ["s"] * n, "source_index": keys})
    return write_manifest_table(t, path, fingerprint="f")


def record_tokens(key: int, length: int = 64) -> np.ndarray:
    return np.random.default_rng(1_000_003 + key).integers(0, 50_000, length, dtype=np.int32)


def run_py(code: str, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, **kw)


def popen_py(code: str, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def in_process(monkeypatch) -> None:
    """`tally.audit.cli.main` runs the command in this process (not in a supervised child), so
    that capsys sees its output."""
    monkeypatch.setenv("TALLY_SUPERVISED", "1")


def limited(kind: str, limit: int) -> list[str]:
    """An argv prefix that runs `python REST...` under the resource limit RLIMIT_<kind> of
    `limit`, set in the child itself before it execs: a preexec_fn runs Python between fork
    and exec, which can deadlock in a test process that JAX's threads share."""
    code = ("import os, resource, sys; n = int(sys.argv[2]); "
            "resource.setrlimit(getattr(resource, 'RLIMIT_' + sys.argv[1]), (n, n)); "
            "os.execv(sys.executable, [sys.executable, *sys.argv[3:]])")
    return [sys.executable, "-c", code, kind, str(limit)]
