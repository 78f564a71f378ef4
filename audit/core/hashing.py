"""The one content hash of the project.

xxh3_64 with seed 0 over a record's token ids as little-endian int32 bytes. The manifest job,
the training hook and every check use these functions and nothing else, so a hash computed
anywhere in Tally compares equal to one computed anywhere else.

A text corpus hashed without a tokenizer (the manifest's `bytes` content basis,
tally.pipeline.text) uses the same xxh3_64 over the document's UTF-8 bytes (`bytes_hash`); a loop
that has the document's text hashes it with the same function.
"""

from __future__ import annotations

import numpy as np
import xxhash

TOKEN_DTYPE = np.dtype("<i4")
_xxh3 = xxhash.xxh3_64_intdigest  # seed 0 by default


def as_token_array(tokens: np.ndarray | list[int]) -> np.ndarray:
    """Tokens as a C-contiguous little-endian int32 array (no copy when already one)."""
    arr = np.asarray(tokens)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype != TOKEN_DTYPE and arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ValueError("token ids do not fit in int32")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)


def content_hash(tokens: np.ndarray | list[int]) -> int:
    """xxh3_64 (seed 0) of the tokens' little-endian int32 bytes, as a Python int (uint64)."""
    return _xxh3(memoryview(as_token_array(tokens)).cast("B"))


def hash_runs(flat_tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Hash of flat_tokens[s : s + n] for each (s, n), as uint64.

    `flat_tokens` must already be a contiguous int32 array (see `as_token_array`). Slicing one
    byte view avoids a copy per segment; at ~0.3 us of Python per segment, this loop, not xxh3
    itself (~20 GB/s), is what a packed batch of thousands of segments pays for.
    """
    view = memoryview(flat_tokens).cast("B")
    begin = (starts * 4).tolist()
    end = ((starts + lengths) * 4).tolist()
    return np.array([_xxh3(view[b:e]) for b, e in zip(begin, end, strict=True)], dtype=np.uint64)


def bytes_hash(data: bytes | str) -> int:
    """xxh3_64 (seed 0) of a document's bytes (a str: its UTF-8 encoding), as a Python int: the
    content hash of the `bytes` basis, for text corpora hashed without a tokenizer."""
    return _xxh3(data.encode("utf-8") if isinstance(data, str) else data)
