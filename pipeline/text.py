"""What a record's content hash is taken over: the content basis, and the tokenizer behind it.

The loop hashes the token ids it trains on (tally.audit.core.hashing). A corpus stored as token ids
(Tally's ArrayRecord and Parquet shards, an OLMo mix, a Parquet or MDS token column) is hashed
over those ids as they are: basis `token_ids`. A text corpus is hashed either

- over the token ids its loader makes of each document (basis `tokens`): the manifest job runs
  the run's tokenizer (a Hugging Face `tokenizers` JSON file, or a `transformers` tokenizer name
  found in the local cache; nothing is downloaded) with the run's settings, so the manifest's
  hashes equal the loop's; or
- over the document's UTF-8 bytes (basis `bytes`, no tokenizer), which a loop can hash the same
  way when it has the text (`tally.audit.core.hashing.bytes_hash`).

A document's token ids under the `tokens` basis, in this order: the tokenizer's encoding of the
text (with its own special tokens when `special_tokens`, as `add_special_tokens=True` does),
then `bos_id` in front and `eos_id` at the end when given, then the first `max_tokens` ids when
given (an EOS past the limit is cut, as a loader that trims after tokenizing does).

The basis is recorded in the manifest's metadata (`tally.content_basis`, JSON) and, by a loop
that says how it tokenizes, in its spool files (`tally.content_basis`); reconcile compares the
two and names any difference as one `manifest_mismatch` finding instead of thousands of hash
mismatches.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tally.audit.core.errors import CorpusError
from tally.audit.core.hashing import TOKEN_DTYPE, bytes_hash, hash_runs

BASIS_KEY = "content_basis"  # the metadata key, under the `tally.` prefix, in manifest and spool
TOKEN_IDS, TOKENS, BYTES = "token_ids", "tokens", "bytes"


@dataclass(frozen=True)
class ContentBasis:
    """What content hashes are taken over (see the module's docstring)."""

    kind: str = TOKEN_IDS  # token_ids | tokens | bytes
    tokenizer: str = ""  # tokens: xxh3_64 (hex) of the tokenizer's canonical JSON
    tokenizer_name: str = ""  # tokens: the file or name it was loaded from (messages only)
    bos_id: int | None = None
    eos_id: int | None = None
    special_tokens: bool = False
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in (TOKEN_IDS, TOKENS, BYTES):
            raise CorpusError(f"content basis {self.kind!r}: expected {TOKEN_IDS}, {TOKENS} or "
                              f"{BYTES}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise CorpusError(f"max_tokens {self.max_tokens}: expected at least 1")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None, where: str = "") -> ContentBasis:
        """The basis recorded as JSON; an empty or absent one is `token_ids` (files written
        before the basis was recorded hashed token ids)."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in raw.items() if k in known})
        except (ValueError, TypeError, CorpusError) as exc:
            raise CorpusError(f"{where or 'content basis'}: unreadable tally.{BASIS_KEY} "
                              f"({exc})") from None

    def metadata(self) -> dict[str, str]:
        """The `tally.*` metadata entry (key without the prefix) that records this basis."""
        return {BASIS_KEY: self.to_json()}

    def describe(self) -> str:
        """In words, for reports: what the content hashes rest on."""
        if self.kind == TOKEN_IDS:
            return "the corpus' token ids"
        if self.kind == BYTES:
            return "each document's UTF-8 bytes (no tokenizer)"
        parts = [f"token ids of tokenizer {self.tokenizer_name or '?'} ({self.tokenizer})"]
        parts.append("its special tokens" if self.special_tokens else "no special tokens")
        parts.append(f"BOS {self.bos_id}" if self.bos_id is not None else "no BOS")
        parts.append(f"EOS {self.eos_id}" if self.eos_id is not None else "no EOS")
        if self.max_tokens is not None:
            parts.append(f"at most {self.max_tokens:,} tokens")
        return ", ".join(parts)

    def differences(self, other: ContentBasis) -> list[str]:
        """How `other` (say, the run's) differs from this basis (say, the manifest's), in
        words; empty when content hashes taken under both compare equal."""
        if self.kind != other.kind:
            return [f"hashes {other.describe()}, not {self.describe()}"]
        out = []
        if self.tokenizer != other.tokenizer:
            out.append(f"tokenizer {other.tokenizer_name or '?'} ({other.tokenizer}), not "
                       f"{self.tokenizer_name or '?'} ({self.tokenizer})")
        for name in ("special_tokens", "bos_id", "eos_id", "max_tokens"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name} {b}, not {a}")
        return out


def basis_differences(manifest_basis: str, run_bases: list[str]) -> list[str]:
    """How the run's content bases (JSON, `ContentBasis`; none: unknown, never a
    difference) differ from the manifest's ("": token ids), in words."""
    want = ContentBasis.from_json(manifest_basis, "the manifest")
    out: list[str] = []
    for raw in run_bases:
        try:
            got = ContentBasis.from_json(raw, "the run's spool")
        except CorpusError as exc:
            out.append(str(exc))
            continue
        out += [d for d in want.differences(got) if d not in out]
    return out


def load_tokenizer(spec: str | os.PathLike) -> Any:
    """A Hugging Face `tokenizers.Tokenizer` from a `tokenizer.json` file, a directory holding
    one, or a hub name found in the local Hugging Face cache (never downloaded). CorpusError,
    in one line, when it cannot be loaded."""
    try:
        from tokenizers import Tokenizer
    except ModuleNotFoundError:
        raise CorpusError("a tokenizer needs the `tokenizers` package: pip install "
                          "'tally-audit[text]'") from None
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        cached = _cached_tokenizer(str(spec))
        if cached is None:
            raise CorpusError(f"tokenizer {spec}: no such tokenizer.json file, and no "
                              "tokenizer of that name in the local Hugging Face cache (Tally "
                              "never downloads one: save it with `tokenizer.save(path)` or "
                              "fetch it to the cache before the job)")
        path = cached
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise CorpusError(f"tokenizer {path}: does not load ({str(exc).splitlines()[0]})"
                          ) from None


def _cached_tokenizer(name: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ModuleNotFoundError:
        return None
    try:
        found = try_to_load_from_cache(name, "tokenizer.json")
    except Exception:  # not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


class TextHasher:
    """Content hashes and lengths of documents under one basis (picklable: Beam workers get
    the tokenizer's JSON and load it once)."""

    def __init__(self, tokenizer: str | os.PathLike | None = None, *,
                 bos_id: int | None = None, eos_id: int | None = None,
                 special_tokens: bool = False, max_tokens: int | None = None) -> None:
        if tokenizer is None:
            if bos_id is not None or eos_id is not None or special_tokens or max_tokens:
                raise CorpusError("BOS/EOS ids, special tokens and a token limit need a "
                                  "tokenizer (--tokenizer)")
            self.basis = ContentBasis(BYTES)
            self._json = ""
        else:
            tok = load_tokenizer(tokenizer)
            self._json = tok.to_str()
            self.basis = ContentBasis(
                TOKENS, xxhash.xxh3_64_hexdigest(self._json.encode()), str(tokenizer),
                bos_id, eos_id, special_tokens, max_tokens)
        self._tok: Any = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tok": None}

    def _tokenizer(self) -> Any:
        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_str(self._json)
        return self._tok

    def token_ids(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(flat int32 token ids, offsets of n + 1) of the documents under the basis."""
        b = self.basis
        tok = self._tokenizer()
        # encode_batch_fast: no character offsets, 1.6x encode_batch; threads across the batch.
        enc = (tok.encode_batch_fast if hasattr(tok, "encode_batch_fast") else
               tok.encode_batch)(texts, add_special_tokens=b.special_tokens)
        bodies = [e.ids for e in enc]
        pre, post = int(b.bos_id is not None), int(b.eos_id is not None)
        lengths = np.fromiter((len(x) for x in bodies), np.int64, len(bodies)) + pre + post
        if b.max_tokens is not None:
            lengths = np.minimum(lengths, b.max_tokens)
        offsets = np.zeros(len(bodies) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # One flat array filled in place: building `[bos] + ids + [eos]` lists and flattening
        # them cost as much as the tokenizer (1.3 s of 3.3 s over 20k documents).
        flat = np.empty(int(offsets[-1]), TOKEN_DTYPE)
        body = np.fromiter(itertools.chain.from_iterable(bodies), TOKEN_DTYPE,
                           sum(len(x) for x in bodies))
        src = 0
        for i, ids in enumerate(bodies):
            lo, n = int(offsets[i]), int(lengths[i])
            m = len(ids)
            if pre:
                flat[lo] = b.bos_id
            take = min(m, n - pre)
            flat[lo + pre: lo + pre + take] = body[src: src + take]
            if post and pre + m < n:
                flat[lo + pre + m] = b.eos_id
            src += m
        return flat, offsets

    def hash_texts(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(content hash uint64, length int32) per document: tokens under the basis, or UTF-8
        bytes (the length then counts bytes)."""
        if self.basis.kind == BYTES:
            raw = [t.encode("utf-8") for t in texts]
            return (np.fromiter((bytes_hash(r) for r in raw), np.uint64, len(raw)),
                    np.fromiter((len(r) for r in raw), np.int32, len(raw)))
        flat, offsets = self.token_ids(texts)
        return hash_runs(flat, offsets[:-1], np.diff(offsets)), np.diff(offsets).astype(np.int32)
