"""Synthetic token corpora (tally.pipeline.synth) and their manifests, built once per test
session and shared: the `corpora` fixture (tests/conftest.py) hands out a `Corpora`.

A corpus is named by what it is made from (records, seed, synth options), so two test files
that ask for the same one share it; tests only read it (one that changes a corpus copies it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


class Corpora:
    """The session's synthetic corpora, under `base`."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def corpus(self, *, records: int, seed: int, **options: Any) -> Path:
        """The folder of `synth_corpus(records=, seed=, **options)`, built on first use."""
        from tally.pipeline.synth import synth_corpus

        spec = json.dumps({"records": records, "seed": seed, **options}, sort_keys=True)
        root = self.base / hashlib.sha1(spec.encode()).hexdigest()[:12] / "c"
        if not root.exists():  # built aside, then renamed: a failed build leaves no corpus
            part = root.with_name("c.partial")
            synth_corpus(part, records=records, seed=seed, **options)
            part.rename(root)
        return root

    def manifest(self, corpus: Path) -> Path:
        """The manifest of `corpus` (the Beam manifest job, defaults), built on first use."""
        from tally.pipeline.manifest import build_manifest

        out = corpus.parent / "manifest.parquet"
        if not out.exists():
            part = out.with_name("manifest.partial.parquet")
            build_manifest(corpus, part)
            part.rename(out)
        return out
