"""A realistic synthetic corpus for demos, tests and benchmarks.

Several domains of different sizes and log-normal document lengths, a held-out split, and a
small share of exact duplicate documents (as real web crawls have). Deterministic from the seed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tally.pipeline.corpus import encode_record


@dataclass(frozen=True)
class Domain:
    name: str
    share: float  # fraction of documents
    median_len: float  # tokens
    sigma: float  # log-normal spread
    vocab_lo: int  # each domain draws from its own band of the vocabulary
    vocab_hi: int


DOMAINS = (
    Domain("web", 0.50, 300, 1.0, 0, 32_000),
    Domain("code", 0.20, 500, 1.2, 8_000, 40_000),
    Domain("wiki", 0.20, 400, 0.7, 0, 24_000),
    Domain("books", 0.10, 1500, 0.8, 0, 48_000),
)


def synth_corpus(
    out: str | Path,
    *,
    records: int,
    seed: int = 0,
    shards: int = 4,
    heldout_fraction: float = 0.02,
    duplicate_fraction: float = 0.01,
    max_len: int = 8192,
    min_len: int = 8,
    length_scale: float = 1.0,
) -> dict:
    """Write `records` documents as ArrayRecord shards under `out`; return the description."""
    from array_record.python.array_record_module import ArrayRecordWriter

    if records < 2:
        raise ValueError("a corpus needs at least 2 records")
    rng = np.random.default_rng(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shares = np.array([d.share for d in DOMAINS])
    dom = rng.choice(len(DOMAINS), size=records, p=shares / shares.sum())
    med = np.array([d.median_len for d in DOMAINS])[dom] * length_scale
    sig = np.array([d.sigma for d in DOMAINS])[dom]
    lens = np.clip(rng.lognormal(np.log(med), sig), min_len, max_len).astype(np.int64)
    # Exact duplicates: a document that repeats an earlier one (same tokens, same domain).
    dup_of = np.full(records, -1)
    n_dup = int(records * duplicate_fraction)
    if n_dup:
        for w in np.sort(rng.choice(np.arange(1, records), size=n_dup, replace=False)):
            o = int(rng.integers(0, w))
            o = o if dup_of[o] < 0 else dup_of[o]  # point at the original, never at a copy
            dup_of[w], dom[w], lens[w] = o, dom[o], lens[o]
    n_heldout = max(1, int(records * heldout_fraction))
    n_train = records - n_heldout
    bounds = np.linspace(0, n_train, shards + 1).astype(int)
    files = [(f"train-{i:05d}-of-{shards:05d}.array_record", bounds[i], bounds[i + 1])
             for i in range(shards)]
    files.append(("heldout-00000-of-00001.array_record", n_train, records))
    kept: dict[int, np.ndarray] = {}  # originals that a later duplicate copies
    needed = set(dup_of[dup_of >= 0].tolist())
    for name, lo, hi in files:
        w = ArrayRecordWriter(str(out / name), "group_size:1")
        try:
            for k in range(lo, hi):
                if dup_of[k] >= 0:
                    toks = kept[int(dup_of[k])]
                else:
                    d = DOMAINS[dom[k]]
                    # Zipf-distributed ids within the domain's band: text-like frequencies,
                    # so that a model has something to learn.
                    ranks = rng.zipf(1.3, int(lens[k])) - 1
                    toks = (d.vocab_lo + ranks % (d.vocab_hi - d.vocab_lo)).astype(np.int32)
                    if k in needed:
                        kept[k] = toks
                w.write(encode_record(toks, DOMAINS[dom[k]].name))
        finally:
            w.close()
    desc = {
        "records": records, "train_records": n_train, "heldout_records": n_heldout,
        "seed": seed, "shards": shards, "duplicates": n_dup, "tokens": int(lens.sum()),
        "domains": [asdict(d) for d in DOMAINS],
        "train_records_per_domain": {d.name: int((dom[:n_train] == i).sum())
                                     for i, d in enumerate(DOMAINS)},
    }
    (out / "corpus.json").write_text(json.dumps(desc, indent=2))
    return desc
