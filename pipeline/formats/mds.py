"""MosaicML Streaming MDS datasets: a directory with `index.json` and shards
`shard.NNNNN.mds`, possibly compressed (`shard.NNNNN.mds.zstd`, `.gz`, `.bz2`, `.br`,
`.snappy`).

Layout (mosaicml-streaming 0.7 to 0.13, streaming/base/format/mds/ writer.py, reader.py,
encodings.py; base/format/base/writer.py; base/compression.py):
- `index.json`: `{"version": 2, "shards": [...]}`, one entry per shard in the dataset's order,
  each with `column_names` (sorted), `column_encodings`, `column_sizes` (bytes, or null for a
  variable-size column), `compression` (null or `algo[:level]`), `samples`, and `raw_data` /
  `zip_data` (`basename`, `bytes`). A compressed shard is stored only as `zip_data`;
  `raw_data` names it decompressed (the reader decompresses into its cache).
- a raw shard: uint32 sample count n, uint32 offsets[n + 1] (absolute, from the file's start),
  the writer's config JSON, then the samples; sample i is bytes offsets[i]:offsets[i + 1]: a
  uint32 size per variable-size column (in column order), then each column's bytes.
- encodings read here: `str` (UTF-8 text), `bytes` (as UTF-8 text), `ndarray[:dtype[:shape]]`
  (dtype and shape in the header, or a dtype byte and a shape prefix per sample; token ids),
  and integer scalars (`int`, `int8`..`uint64`, `str_int`) for ids. `json` and `pkl` are
  refused for the text or token column (pickle would run code from the corpus).

Read without importing `streaming`: its package imports torch (and torchvision through
`streaming.vision`), several hundred MB and seconds of import per Beam worker for a layout this
small, and its reader is built to download shards into a cache, not to read a range.

Splits: a directory holding `index.json` is one train split; else each subdirectory holding an
`index.json` is a split (`train` is train, every other one held out: train first, then the
others by name). The unit a job reads is one shard; `shards(root)` lists them in index.json's
order.
"""

from __future__ import annotations

import functools
import json
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tally.audit.core.errors import CorpusError
from tally.audit.core.hashing import TOKEN_DTYPE
from tally.pipeline.formats import Documents, Fields

NAME = "mds"
INDEX = "index.json"

# streaming's NDArray value dtype codes and shape dtype codes (encodings.py).
_VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32",
                 33: "int32", 34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_SHAPE_DTYPES = {0: "<u1", 1: "<u2", 2: "<u4", 3: "<u8"}
_INT_SCALARS = {"int": "<i8", "int8": "<i1", "int16": "<i2", "int32": "<i4", "int64": "<i8",
                "uint8": "<u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8"}


def matches(path: Path) -> bool:
    """An MDS dataset directory (index.json, or split subdirectories holding one), or a
    shard file beside its index.json."""
    path = Path(path)
    if path.is_dir():
        return (path / INDEX).is_file() or any(
            (p / INDEX).is_file() for p in path.iterdir() if p.is_dir())
    return ".mds" in path.suffixes and _index_of(path) is not None


def _load_index(index: Path) -> list[dict]:
    try:
        st = index.stat()
    except OSError as exc:
        raise CorpusError(f"{index}: unreadable MDS index ({exc})") from None
    return _parse_index(index, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _parse_index(index: Path, mtime_ns: int, size: int) -> list[dict]:
    """index.json's shard entries (cached per version of the file: read once per shard)."""
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
        entries = raw["shards"]
        if not isinstance(entries, list):
            raise TypeError("`shards` is not a list")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorpusError(f"{index}: unreadable MDS index ({exc})") from None
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or e.get("format") != "mds":
            raise CorpusError(f"{index}: shard {i} is not an MDS shard "
                              f"(format {e.get('format') if isinstance(e, dict) else e!r})")
    return entries


def _stored_name(entry: dict) -> str:
    return (entry.get("zip_data") or entry["raw_data"])["basename"]


def _index_of(path: Path) -> tuple[Path, dict] | None:
    """The index.json that lists the shard file, and its entry (a merged index in a parent
    directory lists shards by their path relative to it)."""
    for d in list(path.parents)[:3]:
        index = d / INDEX
        if index.is_file():
            rel = path.relative_to(d).as_posix()
            for e in _load_index(index):
                if rel in (_stored_name(e), e["raw_data"]["basename"]):
                    return index, e
    return None


def shards(root: Path) -> list[tuple[Path, str]]:
    """The dataset's shard files in the corpus' global order, with their split ('train' |
    'heldout'): index.json's order within a split."""
    root = Path(root)
    if (root / INDEX).is_file():
        splits = [(root, "train")]
    else:
        dirs = sorted((p for p in root.iterdir() if p.is_dir() and (p / INDEX).is_file()),
                      key=lambda p: (p.name != "train", p.name))
        if not dirs:
            raise CorpusError(f"{root}: not an MDS dataset (no {INDEX}, nor a split "
                              f"subdirectory holding one)")
        splits = [(d, "train" if d.name == "train" else "heldout") for d in dirs]
    out = []
    for d, split in splits:
        for e in _load_index(d / INDEX):
            raw = d / e["raw_data"]["basename"]
            stored = d / _stored_name(e)
            path = raw if raw.is_file() else stored  # a reader's cache keeps both
            if not path.is_file():
                raise CorpusError(f"{stored}: listed in {d / INDEX} but missing")
            out.append((path, split))
    return out


def _entry(path: Path) -> tuple[Path, dict]:
    found = _index_of(path)
    if found is None:
        raise CorpusError(f"{path}: no {INDEX} beside it lists this shard")
    return found


def count(path: Path, fields: Fields) -> int | None:
    """Samples in the shard, from index.json. CorpusError when the field is not a column, so
    a wrong --text-field stops the job before it starts."""
    path = Path(path)
    entry = _entry(path)[1]
    _check_columns(entry, fields, path)
    return int(entry["samples"])


def _check_columns(entry: dict, fields: Fields, path: Path) -> None:
    main, names = fields.tokens or fields.text, entry["column_names"]
    if main not in names:
        raise CorpusError(f"{path} record 0: no {'token' if fields.tokens else 'text'} field "
                          f"{main!r} (the shard's columns: {', '.join(names)}); name it with "
                          f"--{'tokens' if fields.tokens else 'text'}-field")


def _decompress(algo: str, data: bytes, path: Path) -> bytes:
    family = algo.split(":")[0]
    try:
        if family == "zstd":
            import zstandard

            # streaming compresses with the `zstd` package, whose frames may not record the
            # content size: decompress as a stream, not with ZstdDecompressor().decompress.
            return zstandard.ZstdDecompressor().decompressobj().decompress(data)
        if family == "gz":
            import gzip

            return gzip.decompress(data)
        if family == "bz2":
            import bz2

            return bz2.decompress(data)
        if family == "br":
            import brotli

            return brotli.decompress(data)
        if family == "snappy":
            import snappy

            return snappy.decompress(data)
    except ModuleNotFoundError as exc:
        raise CorpusError(f"{path}: {family}-compressed MDS shard needs the `{exc.name}` "
                          "package") from None
    except Exception as exc:
        raise CorpusError(f"{path}: corrupt {family}-compressed MDS shard ({exc})") from None
    raise CorpusError(f"{path}: MDS compression {algo!r} is not one of zstd, gz, bz2, br, snappy")


def _shard_bytes(path: Path, entry: dict) -> bytes | mmap.mmap:
    """The raw shard: memory-mapped when stored raw, else decompressed whole (at most the
    writer's size_limit, 64 MiB by default)."""
    raw_name = Path(entry["raw_data"]["basename"]).name
    if path.name == raw_name:
        if not path.stat().st_size:
            return b""
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    algo = entry.get("compression") or ""
    data = _decompress(algo, path.read_bytes(), path)
    want = entry["raw_data"].get("bytes")
    if want is not None and len(data) != want:  # a cut zstd stream decompresses without error
        raise CorpusError(f"{path}: corrupt {algo.split(':')[0]}-compressed MDS shard "
                          f"(decompresses to {len(data):,} bytes, index.json says {want:,})")
    return data


class _Column:
    """How to decode one column of a sample."""

    def __init__(self, name: str, encoding: str, size: int | None) -> None:
        self.name, self.encoding, self.size = name, encoding, size
        parts = encoding.split(":")
        self.ndarray = parts[0] == "ndarray"
        self.dtype = parts[1] if self.ndarray and len(parts) > 1 and parts[1] else None
        self.shape = tuple(int(x) for x in parts[2].split(",")) if self.ndarray and len(
            parts) > 2 else None

    def tokens(self, data: bytes, where: str) -> np.ndarray:
        if not self.ndarray:
            raise CorpusError(f"{where}: token field {self.name!r} is encoded {self.encoding}, "
                              "expected ndarray (of integer token ids)")
        i = 0
        dtype = self.dtype
        if dtype is None:
            dtype = _VALUE_DTYPES.get(data[0]) if data else None
            i = 1
        if self.shape is None:
            if len(data) <= i:
                raise CorpusError(f"{where}: token field {self.name!r}: truncated array header")
            ndim, sdt = data[i] >> 2, _SHAPE_DTYPES[data[i] & 3]
            i += 1 + ndim * np.dtype(sdt).itemsize
        if dtype is None or not np.issubdtype(np.dtype(dtype), np.integer):
            raise CorpusError(f"{where}: token field {self.name!r} holds {dtype or 'unknown'} "
                              "values, expected integer token ids")
        dt = np.dtype(dtype).newbyteorder("<")
        body = data[i:]
        if len(body) % dt.itemsize:
            raise CorpusError(f"{where}: token field {self.name!r}: {len(body)} bytes, not a "
                              f"whole number of {dtype}")
        v = np.frombuffer(body, dt)
        if v.dtype != TOKEN_DTYPE:
            if v.size and (int(v.min()) < -(2**31) or int(v.max()) >= 2**31):
                raise CorpusError(f"{where}: token ids in {self.name!r} do not fit in int32")
            v = v.astype(TOKEN_DTYPE)
        return v

    def text(self, data: bytes, path: Path, record: int) -> str:
        if self.encoding == "str":  # the common case first: no message built per record
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError:
                pass
        where = f"{path} record {record}"
        if self.encoding not in ("str", "bytes"):
            raise CorpusError(f"{where}: text field {self.name!r} is encoded {self.encoding}, "
                              "expected str (json and pkl columns are not read; for token ids "
                              "name the column with --tokens-field)")
        try:
            return bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{where}: text field {self.name!r} is not UTF-8 ({exc.reason} "
                              f"at byte {exc.start})") from None

    def scalar(self, data: bytes) -> str | None:
        """An id or domain as str; None for an encoding that is not a string or integer."""
        if self.encoding in ("str", "str_int", "bytes"):
            return bytes(data).decode("utf-8", errors="replace")
        dt = _INT_SCALARS.get(self.encoding)
        if dt is not None and len(data) == np.dtype(dt).itemsize:
            return str(int(np.frombuffer(data, dt)[0]))
        return None


def read(path: Path, fields: Fields, start: int = 0, end: int | None = None,
         batch: int = 4096) -> Iterator[Documents]:
    path = Path(path)
    _, entry = _entry(path)
    names = entry["column_names"]
    cols = [_Column(n, e, s) for n, e, s in zip(
        names, entry["column_encodings"], entry["column_sizes"], strict=True)]
    _check_columns(entry, fields, path)
    n = int(entry["samples"])
    end = n if end is None else end
    if end > n:
        raise CorpusError(f"{path}: records {max(start, n)}..{end - 1} asked for, index.json "
                          f"lists {n}")
    data = _shard_bytes(path, entry)
    try:
        yield from _read_samples(data, path, n, cols, fields, start, end, batch)
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def _read_samples(data: bytes | mmap.mmap, path: Path, n: int, cols: list[_Column],
                  fields: Fields, start: int, end: int, batch: int) -> Iterator[Documents]:
    size = len(data)
    head = 4 * (n + 2)
    if size < head or struct.unpack_from("<I", data, 0)[0] != n:
        raise CorpusError(f"{path}: truncated or not an MDS shard of {n} samples (header)")
    offsets = np.frombuffer(data[4:head], "<u4").astype(np.int64)
    if offsets[-1] > size or np.any(np.diff(offsets) < 0) or offsets[0] < head:
        bad = int(np.argmax(offsets > size)) - 1 if offsets[-1] > size else 0
        raise CorpusError(f"{path} record {max(bad, 0)}: truncated or corrupt MDS shard "
                          f"(sample ends past the file's {size} bytes)")
    bounds = offsets.tolist()
    ci = {c.name: k for k, c in enumerate(cols)}
    main = ci[fields.tokens or fields.text]
    id_col = ci.get(fields.id)
    domain_names = (fields.domain,) if fields.domain is not None else ("domain", "source")
    dom_col = next((ci[d] for d in domain_names if d in ci), None)
    var = [k for k, c in enumerate(cols) if c.size is None]
    sizes_fmt = struct.Struct(f"<{len(var)}I")
    fixed = [c.size for c in cols]
    for b in range(start, end, batch):
        stop = min(b + batch, end)
        doc_id: list[str | None] = []
        domain: list[str] = []
        text: list[str] = []
        ids: list[np.ndarray] = []
        for r in range(b, stop):
            # The sample's uint32 sizes of its variable-size columns, then the columns' bytes,
            # sliced straight from the shard (no copy of the sample as a whole).
            lo, hi = bounds[r], bounds[r + 1]
            if hi - lo < sizes_fmt.size:
                raise CorpusError(f"{path} record {r}: truncated MDS sample")
            sizes = fixed[:]
            for k, s in zip(var, sizes_fmt.unpack_from(data, lo), strict=True):
                sizes[k] = s
            if sizes_fmt.size + sum(sizes) != hi - lo:
                raise CorpusError(f"{path} record {r}: corrupt MDS sample ({hi - lo} bytes, "
                                  f"its columns say {sizes_fmt.size + sum(sizes)})")
            parts, i = [], lo + sizes_fmt.size
            for s in sizes:
                parts.append(data[i:i + s])
                i += s
            if fields.tokens:
                ids.append(cols[main].tokens(parts[main], f"{path} record {r}"))
            else:
                text.append(cols[main].text(parts[main], path, r))
            doc_id.append(cols[id_col].scalar(parts[id_col]) if id_col is not None else None)
            d = cols[dom_col].scalar(parts[dom_col]) if dom_col is not None else None
            domain.append(d if d is not None else "default")
        if fields.tokens:
            offs = np.zeros(len(ids) + 1, np.int64)
            np.cumsum([len(x) for x in ids], out=offs[1:])
            flat = np.concatenate(ids) if ids else np.zeros(0, TOKEN_DTYPE)
            yield Documents(b, doc_id, domain, tokens=(flat, offs))
        else:
            yield Documents(b, doc_id, domain, text=text)
