"""The synthetic corpus: deterministic, several domains, held-out split, exact duplicates."""

import json

import numpy as np
import pyarrow.parquet as pq

from tally.pipeline.corpus import TokenSource, list_shards
from tally.pipeline.manifest import build_manifest
from tally.pipeline.synth import synth_corpus


def _bytes(root):
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_same_seed_same_corpus_other_seed_other_corpus(tmp_path):
    a = synth_corpus(tmp_path / "a", records=400, seed=5, length_scale=0.1)
    synth_corpus(tmp_path / "b", records=400, seed=5, length_scale=0.1)
    synth_corpus(tmp_path / "c", records=400, seed=6, length_scale=0.1)
    assert _bytes(tmp_path / "a") == _bytes(tmp_path / "b")
    assert _bytes(tmp_path / "a") != _bytes(tmp_path / "c")
    assert json.loads((tmp_path / "a" / "corpus.json").read_text()) == a


def test_realistic_shape(tmp_path):
    desc = synth_corpus(tmp_path / "c", records=6000, seed=1, shards=3)
    shards = list_shards(tmp_path / "c")
    assert [s.split for s in shards] == ["train"] * 3 + ["heldout"]
    assert desc["heldout_records"] == 120 and desc["train_records"] == 5880
    build_manifest(tmp_path / "c", tmp_path / "m.parquet")
    m = pq.read_table(tmp_path / "m.parquet")
    dom = np.array(m["domain"].to_pylist())
    n_tok = m["n_tokens"].to_numpy()
    hashes = m["content_hash"].to_numpy()
    # Domains of different sizes and different document lengths.
    share = {d: (dom == d).mean() for d in set(dom)}
    assert share["web"] > share["code"] > share["books"] > 0.05
    assert np.median(n_tok[dom == "books"]) > 2 * np.median(n_tok[dom == "web"])
    assert n_tok.std() / n_tok.mean() > 0.7  # heavy-tailed, log-normal-like
    # Exact duplicates: 1% of documents repeat an earlier one, token for token.
    uniq, first, counts = np.unique(hashes, return_index=True, return_counts=True)
    assert len(hashes) - len(uniq) == desc["duplicates"] == 60
    src = TokenSource(tmp_path / "c")
    twins = np.flatnonzero(hashes == uniq[np.argmax(counts)])
    twins = [int(t) for t in twins if t < len(src)]
    assert len(twins) >= 2
    assert all(np.array_equal(src[twins[0]], src[t]) for t in twins)
