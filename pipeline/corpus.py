"""Tokenized corpora: ArrayRecord shards (Grain's native format) and Parquet files.

A corpus is a directory of shards. Shards whose name starts with `heldout` hold the held-out
split, all others the train split. The corpus' global order, which defines record keys, is:
train shards by name, then held-out shards by name, records in file order. Train records are
therefore keys 0..N-1, which is exactly what a Grain source over the train shards indexes.

ArrayRecord record layout (one record per document):
    b"TLY1" | dtype code (1 byte, b"i" = int32 little-endian) | domain length (1 byte)
    | domain (UTF-8) | token ids
Parquet layout: a `tokens` column of list<int32> (other integer widths are accepted when the
values fit) and a `domain` string column.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from audit.core.errors import TallyError
from audit.core.hashing import TOKEN_DTYPE, content_hash, hash_runs

MAGIC = b"TLY1"
_HEADER = len(MAGIC) + 2
FORMATS = {".array_record": "array_record", ".parquet": "parquet"}


class CorpusError(TallyError):
    """Bad corpus input; the message names the file and, where it applies, the record."""


def encode_record(tokens: np.ndarray | Sequence[int], domain: str) -> bytes:
    d = domain.encode()
    if len(d) > 255:
        raise ValueError(f"domain name longer than 255 bytes: {domain!r}")
    return MAGIC + b"i" + bytes([len(d)]) + d + np.asarray(tokens, dtype=TOKEN_DTYPE).tobytes()


def decode_record(raw: bytes, where: str) -> tuple[np.ndarray, str]:
    """(tokens as an int32 view, domain) of one ArrayRecord record; `where` names it in errors."""
    if raw[:4] != MAGIC or len(raw) < _HEADER:
        raise CorpusError(f"{where}: not a Tally token record (bad header)")
    if raw[4:5] != b"i":
        raise CorpusError(f"{where}: token array of type code {raw[4:5]!r}, expected b'i' (int32)")
    start = _HEADER + raw[5]
    domain = raw[_HEADER:start].decode("utf-8", errors="replace")
    body = len(raw) - start
    if body <= 0:
        raise CorpusError(f"{where}: record without tokens")
    if body % 4:
        raise CorpusError(f"{where}: {body} token bytes, not a whole number of int32 tokens")
    return np.frombuffer(raw, dtype=TOKEN_DTYPE, offset=start), domain


@dataclass(frozen=True)
class Shard:
    path: Path
    fmt: str  # 'array_record' | 'parquet'
    split: str  # 'train' | 'heldout'
    num_records: int
    base_key: int  # record key of the shard's first record


def _split_of(path: Path) -> str:
    return "heldout" if path.name.startswith("heldout") else "train"


def _count(path: Path, fmt: str) -> int:
    try:
        if fmt == "array_record":
            from array_record.python.array_record_module import ArrayRecordReader

            reader = ArrayRecordReader(str(path))
            try:
                return reader.num_records()
            finally:
                reader.close()
        meta = pq.read_metadata(path)
        names = set(meta.schema.to_arrow_schema().names)
        if "tokens" not in names:
            raise CorpusError(f"{path}: Parquet shard has no 'tokens' column (has {sorted(names)})")
        return meta.num_rows
    except CorpusError:
        raise
    except Exception as exc:
        raise CorpusError(f"{path}: unreadable {fmt} shard: {exc}") from None


def list_shards(corpus: str | Path) -> list[Shard]:
    """The corpus' shards in global order, with record counts and base keys."""
    root = Path(corpus)
    if not root.is_dir():
        raise CorpusError(f"corpus {root} is not a directory")
    paths = [p for p in root.iterdir() if p.suffix in FORMATS and not p.name.startswith(".")]
    if not paths:
        raise CorpusError(f"corpus {root} holds no shards (*.array_record or *.parquet)")
    paths.sort(key=lambda p: (_split_of(p) != "train", p.name))
    shards, base = [], 0
    for p in paths:
        fmt = FORMATS[p.suffix]
        n = _count(p, fmt)
        shards.append(Shard(p, fmt, _split_of(p), n, base))
        base += n
    return shards


def hash_range(shard: Shard, start: int, end: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Content hashes (uint64), lengths (int32) and domains of records [start, end)."""
    try:
        if shard.fmt == "array_record":
            return _hash_array_record(shard, start, end)
        values, offsets, domains = _read_parquet(shard, start, end)
        lengths = np.diff(offsets)
        return hash_runs(values, offsets[:-1], lengths), lengths.astype(np.int32), domains
    except CorpusError:
        raise
    except Exception as exc:
        raise CorpusError(f"{shard.path}: cannot read records {start}..{end - 1}: {exc}") from None


def _hash_array_record(shard: Shard, start: int, end: int):
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(str(shard.path))
    try:
        raws = reader.read(start, end)
    finally:
        reader.close()
    n = len(raws)
    hashes = np.empty(n, dtype=np.uint64)
    lengths = np.empty(n, dtype=np.int32)
    domains = []
    for i, raw in enumerate(raws):
        # Hash each record's token view in place: no copy of the shard's tokens.
        tokens, domain = decode_record(raw, f"{shard.path} record {start + i}")
        hashes[i] = content_hash(tokens)
        lengths[i] = len(tokens)
        domains.append(domain)
    return hashes, lengths, domains


def _token_values(col: pa.ChunkedArray, shard: Shard, start: int) -> tuple[np.ndarray, np.ndarray]:
    arr = col.combine_chunks()
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)) or not (
        pa.types.is_integer(arr.type.value_type)
    ):
        raise CorpusError(f"{shard.path}: column 'tokens' is {arr.type}, expected list<int32>")
    if arr.null_count:
        bad = start + int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise CorpusError(f"{shard.path} record {bad}: record without tokens (null)")
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])).to_numpy()
    offsets = offsets - offsets[0]
    empty = np.flatnonzero(np.diff(offsets) == 0)
    if empty.size:
        raise CorpusError(f"{shard.path} record {start + int(empty[0])}: record without tokens")
    if values.dtype != TOKEN_DTYPE:
        if values.size and (values.min() < -(2**31) or values.max() >= 2**31):
            raise CorpusError(f"{shard.path}: token ids do not fit in int32")
        values = values.astype(TOKEN_DTYPE)
    return values, offsets


@functools.lru_cache(maxsize=8)
def _parquet_file(path: Path) -> pq.ParquetFile:
    return pq.ParquetFile(path)


def read_rows(pf: pq.ParquetFile, start: int, end: int, columns: list[str]) -> pa.Table:
    """Rows [start, end) of a Parquet file, reading only the row groups that overlap them."""
    groups, first, row = [], 0, 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if row + n > start and row < end:
            first = row if not groups else first
            groups.append(g)
        row += n
    return pf.read_row_groups(groups, columns=columns).slice(start - first, end - start)


def _read_parquet(shard: Shard, start: int, end: int):
    pf = _parquet_file(shard.path)
    cols = ["tokens"] + (["domain"] if "domain" in pf.schema_arrow.names else [])
    table = read_rows(pf, start, end, cols)
    values, offsets = _token_values(table["tokens"], shard, start)
    domains = table["domain"].to_pylist() if "domain" in cols else ["default"] * table.num_rows
    return values, offsets, domains


class TokenSource:
    """Grain random-access source over one split: item i is that split's i-th record's tokens.

    For the train split item i is record key i. Readers open lazily, so the source pickles
    into Grain's worker processes.
    """

    def __init__(self, corpus: str | Path, split: str = "train") -> None:
        self.shards = [s for s in list_shards(corpus) if s.split == split]
        if not self.shards:
            raise CorpusError(f"corpus {corpus} has no {split} shards")
        self.base_key = self.shards[0].base_key
        self._ends = np.cumsum([s.num_records for s in self.shards])
        self._readers: dict[int, object] = {}

    def __len__(self) -> int:
        return int(self._ends[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        return self.record(i)[0]

    def record(self, i: int) -> tuple[np.ndarray, str]:
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} outside 0..{len(self) - 1}")
        s = int(np.searchsorted(self._ends, i, side="right"))
        shard = self.shards[s]
        local = i - (int(self._ends[s - 1]) if s else 0)
        if shard.fmt == "parquet":
            values, offsets, domains = _read_parquet(shard, local, local + 1)
            return values, domains[0]
        reader = self._readers.get(s)
        if reader is None:
            from array_record.python.array_record_module import ArrayRecordReader

            reader = self._readers[s] = ArrayRecordReader(str(shard.path))
        return decode_record(reader.read([local])[0], f"{shard.path} record {local}")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_readers": {}}

    def __repr__(self) -> str:  # Grain logs sources by repr
        return f"TokenSource({len(self)} records in {len(self.shards)} shards)"
