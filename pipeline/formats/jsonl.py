"""Dolma-style JSON lines: one JSON object per line (`id`, `text`, `source`, metadata), plain or
compressed (`.jsonl`, `.json`, and either with `.gz` or `.zst`).

Read as a stream of decompressed blocks (1 MiB of compressed input at a time) cut into lines, so
memory stays bounded by the batch, whatever the file's size. Blank lines are not records. A
compressed file's records are counted only by reading it, so count() is None for it and the
manifest job reads it whole in one element; a plain file is counted by its lines (a scan at
disk speed) and read in ranges.

Multi-member gzip and multi-frame zstd files (pigz, pzstd) are read across members/frames. A
stream that ends inside a member or frame is truncated, and said so: zstandard's own stream
reader returns the partial data without complaint, hence the decompressobj loop here.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tally.audit.core.errors import CorpusError
from tally.audit.core.hashing import TOKEN_DTYPE
from tally.pipeline.formats import Documents, Fields

NAME = "jsonl"
SUFFIXES = (".jsonl", ".json")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", "": None}
_BLOCK = 1 << 20


def _parts(path: Path) -> tuple[str, str | None] | None:
    """(data suffix, compression) of the file's name, or None when it is not JSON lines."""
    name = path.name
    for ext, comp in COMPRESSIONS.items():
        stem = name[: len(name) - len(ext)] if ext and name.endswith(ext) else name
        if (ext == "" or name.endswith(ext)) and stem.endswith(SUFFIXES):
            return stem[stem.rfind("."):], comp
    return None


def matches(path: Path) -> bool:
    """A file named *.jsonl / *.json, optionally .gz or .zst."""
    path = Path(path)
    return not path.is_dir() and _parts(path) is not None


def _compression(path: Path) -> str | None:
    parts = _parts(path)
    return parts[1] if parts else None  # a file named otherwise (--format jsonl): plain


def _decompressor(kind: str) -> Any:
    if kind == "gzip":
        return zlib.decompressobj(wbits=31)
    try:
        import zstandard
    except ModuleNotFoundError:
        raise CorpusError("zstd-compressed JSON lines need the `zstandard` package: pip install "
                          "'tally-audit[text]'") from None
    return zstandard.ZstdDecompressor().decompressobj()


def _blocks(path: Path, where: list[str]) -> Iterator[bytes]:
    """The file's decompressed bytes, block by block. `where` holds, for error messages, the
    position (line and record) the reader is at; errors raise CorpusError with it."""
    kind = _compression(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; a generator)
    except OSError as exc:
        raise CorpusError(f"{path}: cannot open ({exc.strerror or exc})") from None
    with f:
        if kind is None:
            while block := f.read(_BLOCK):
                yield block
            return
        d, fresh = _decompressor(kind), True
        try:
            while data := f.read(_BLOCK):
                while data:
                    out = d.decompress(data)
                    fresh = False
                    if out:
                        yield out
                    if not d.eof:
                        break
                    data = d.unused_data  # the next gzip member / zstd frame
                    d, fresh = _decompressor(kind), True
            if not fresh and not d.eof:
                raise CorpusError(f"{path} {where[0]}: truncated {kind} stream (the file ends "
                                  "inside a compressed block)")
        except CorpusError:
            raise
        except Exception as exc:  # zlib.error, zstandard.ZstdError
            raise CorpusError(f"{path} {where[0]}: corrupt {kind} data "
                              f"({str(exc).splitlines()[0] or type(exc).__name__})") from None


def _lines(path: Path, where: list[str]) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, line) of the file's non-blank lines."""
    rest, lineno = b"", 0
    for block in _blocks(path, where):
        pieces = (rest + block).split(b"\n")
        rest = pieces.pop()
        for line in pieces:
            lineno += 1
            if line.strip():
                yield lineno, line
    if rest.strip():
        yield lineno + 1, rest


def count(path: Path, fields: Fields) -> int | None:
    """Records of a plain file (its non-blank lines); None for a compressed one."""
    path = Path(path)
    if _compression(path) is not None:
        return None
    n = 0
    for _ in _lines(path, ["line 1 (record 0)"]):
        n += 1
    return n


def read(path: Path, fields: Fields, start: int = 0, end: int | None = None,
         batch: int = 4096) -> Iterator[Documents]:
    """Documents [start, end) in file order; CorpusError naming the file, line and record of
    an undecodable line, a line that is not a JSON object, or a record without its field."""
    path = Path(path)
    where = ["line 1 (record 0)"]
    record = -1
    docs: list[dict] = []
    first = start
    for lineno, line in _lines(path, where):
        record += 1
        where[0] = f"line {lineno + 1} (record {record + 1})"  # where a stream error would be
        if record < start:
            continue
        if end is not None and record >= end:
            break
        at = f"{path} line {lineno} (record {record})"
        try:
            obj = json.loads(line)
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{at}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
        except ValueError as exc:
            raise CorpusError(f"{at}: not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise CorpusError(f"{at}: a JSON {type(obj).__name__}, not an object")
        docs.append(_check(obj, fields, at))
        if len(docs) == batch:
            yield _documents(docs, fields, first)
            first += len(docs)
            docs = []
    if docs:
        yield _documents(docs, fields, first)
    if end is not None and record + 1 < end:
        raise CorpusError(f"{path}: records {max(start, record + 1)}..{end - 1} asked for, the "
                          f"file holds {record + 1} (changed since it was counted)")


def _check(obj: dict, fields: Fields, at: str) -> dict:
    if fields.tokens:
        ids = obj.get(fields.tokens)
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise CorpusError(f"{at}: no token field {fields.tokens!r} holding a list of "
                              f"integers (the record's fields: {', '.join(obj) or 'none'})")
        if any(not -(2**31) <= t < 2**31 for t in ids):
            raise CorpusError(f"{at}: token ids in {fields.tokens!r} do not fit in int32")
    else:
        text = obj.get(fields.text)
        if not isinstance(text, str):
            what = "no" if text is None else f"a {type(text).__name__} in the"
            raise CorpusError(f"{at}: {what} text field {fields.text!r} (the record's fields: "
                              f"{', '.join(obj) or 'none'}; name it with --text-field)")
    return obj


def _domain(obj: dict, fields: Fields) -> str:
    if fields.domain is not None:
        value = obj.get(fields.domain)
    else:
        value = obj.get("domain", obj.get("source"))
    return "default" if value is None else str(value)


def _documents(docs: list[dict], fields: Fields, start: int) -> Documents:
    doc_id = [None if (v := d.get(fields.id)) is None else str(v) for d in docs]
    domain = [_domain(d, fields) for d in docs]
    if fields.tokens:
        lists = [d[fields.tokens] for d in docs]
        offsets = np.zeros(len(lists) + 1, np.int64)
        np.cumsum([len(x) for x in lists], out=offsets[1:])
        flat = np.fromiter((t for x in lists for t in x), TOKEN_DTYPE, int(offsets[-1]))
        return Documents(start, doc_id, domain, tokens=(flat, offsets))
    return Documents(start, doc_id, domain, text=[d[fields.text] for d in docs])
