"""Text corpora for tests: a tiny BPE tokenizer trained here (never downloaded), Dolma-like
documents (id, text, source, metadata), their JSON lines files (plain, gzip, zstandard), and the
hashes a training loop would compute of them (the reference a manifest must equal).

The reference is computed with the `tokenizers` library directly, not with tally.pipeline.text, so a
test that compares a manifest with it checks the manifest job against an independent loop.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from tally.audit.core.hashing import bytes_hash, content_hash

_VOCABULARY = ("the data model token corpus train loss step batch shard record hash manifest audit "
          "ledger epoch host loader window domain source split held out every each one two "
          "three seven reads writes counts checks keeps finds names numbers order file line "
          "text code wiki book web news paper über café naïve 東京 ☃")
_WORDS = _VOCABULARY.split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """`n` generated sentences of 3 to 24 words (some non-ASCII), reproducible by `seed`."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 24))).capitalize() + "."
            for _ in range(n)]


def train_tokenizer(path: str | Path, vocab_size: int = 300, seed: int = 0) -> Path:
    """A byte-level BPE `tokenizer.json` (GPT-2 style: any text encodes) trained on a few hundred
    generated sentences, with `<|bos|>` (id 0) and `<|eos|>` (id 1) and a post-processor that
    adds them when `add_special_tokens` is set. Trains in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(sentences(400, seed), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A <|eos|>", special_tokens=[("<|bos|>", 0), ("<|eos|>", 1)])
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path.mkdir(parents=True, exist_ok=True)
        path = path / "tokenizer.json"
    tok.save(str(path))
    return path


def documents(n: int, seed: int = 0, *, prefix: str = "doc", sources: tuple[str, ...] = (
        "cc", "wiki", "code")) -> list[dict[str, Any]]:
    """`n` Dolma-like documents: `id` (f"{prefix}-{i}"), `text` (one to four generated
    sentences, paragraphs joined by a newline), `source`, and a `metadata` object."""
    rng = random.Random(seed)
    pool = sentences(4 * n + 8, seed + 1)
    docs = []
    for i in range(n):
        k = rng.randint(1, 4)
        docs.append({"id": f"{prefix}-{i}", "text": "\n".join(rng.sample(pool, k)),
                     "source": sources[i % len(sources)],
                     "metadata": {"url": f"https://example.org/{prefix}/{i}", "k": k}})
    return docs


def write_jsonl(path: str | Path, docs: list[dict[str, Any]]) -> Path:
    """Documents as JSON lines, compressed by the file's name: `.gz` gzip, `.zst` zstandard,
    else plain."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()
    if path.suffix == ".gz":
        data = gzip.compress(data)
    elif path.suffix == ".zst":
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def loop_token_ids(texts: list[str], tokenizer: str | Path, *, bos_id: int | None = None,
                   eos_id: int | None = None, special_tokens: bool = False,
                   max_tokens: int | None = None) -> list[np.ndarray]:
    """The token ids a loader makes of each text: encode (with the tokenizer's own special
    tokens when `special_tokens`), BOS in front and EOS at the end when given, then the first
    `max_tokens`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    out = []
    for t in texts:
        ids = tok.encode(t, add_special_tokens=special_tokens).ids
        ids = ([bos_id] if bos_id is not None else []) + ids + (
            [eos_id] if eos_id is not None else [])
        out.append(np.asarray(ids[:max_tokens] if max_tokens else ids, np.int32))
    return out


def loop_hashes(texts: list[str], tokenizer: str | Path | None = None, **settings: Any
                ) -> tuple[list[int], list[int]]:
    """(content hashes, lengths) a loop computes of the texts: over the token ids of
    loop_token_ids with `tokenizer`, or over the UTF-8 bytes without one."""
    if tokenizer is None:
        return [bytes_hash(t) for t in texts], [len(t.encode()) for t in texts]
    ids = loop_token_ids(texts, tokenizer, **settings)
    return [content_hash(x) for x in ids], [len(x) for x in ids]
