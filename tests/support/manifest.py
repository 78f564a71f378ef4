"""Small manifests of keyed records for tests that need a manifest but no corpus, written by
the manifest contract's own writer (tally.pipeline.manifest_file.write_manifest_table)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from tally.pipeline.manifest_file import write_manifest_table


def content_hash_of(keys: np.ndarray) -> np.ndarray:
    """A stand-in content hash per key (odd, so never 0), for spools and manifests that agree
    without real tokens."""
    return (np.asarray(keys, np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)


# Record k's domain: "code" every third record from key 0, "web" otherwise.
CODE_EVERY_THIRD = ("code", "web", "web")


def key_as_hash(keys: np.ndarray) -> np.ndarray:
    return np.asarray(keys, np.uint64)


def keyed_manifest(path: str | Path, train: int, heldout: int = 0, *,
                   hashes: Callable[[np.ndarray], np.ndarray] = key_as_hash,
                   tokens: int = 10, domains: Sequence[str] = ("web",),
                   sources: Sequence[str] = ("s",), fingerprint: str | None = "f") -> Path:
    """Keys 0..train-1 (train) then `heldout` held-out keys; content hashes `hashes(keys)`;
    `tokens` each; record k's domain and source are domains[k % len(domains)] and
    sources[k % len(sources)]. `fingerprint=None`: computed from the table, as the job does."""
    n = train + heldout
    keys = np.arange(n)
    t = pa.table({"record_key": keys, "content_hash": hashes(keys),
                  "n_tokens": np.full(n, tokens, np.int32),
                  "domain": [domains[k % len(domains)] for k in range(n)],
                  "split": ["train"] * train + ["heldout"] * heldout,
                  "source": [sources[k % len(sources)] for k in range(n)],
                  "source_index": keys})
    return write_manifest_table(t, path, fingerprint=fingerprint)


def uniform_manifest(path: str | Path, n: int) -> Path:
    """A manifest of `n` train records (keys 0..n-1, content hash = key, 10 tokens each, one
    domain)."""
    return keyed_manifest(path, n)
