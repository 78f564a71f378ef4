"""Tokenized corpora: ArrayRecord shards (Grain's native format), Parquet files, and OLMo numpy
token mixes (`pipeline.olmo`).

A corpus is a directory of shards. Shards whose name starts with `heldout` hold the held-out
split, all others the train split. The corpus' global order, which defines record keys, is:
train shards by name, then held-out shards by name, records in file order. Train records are
therefore keys 0..N-1, which is exactly what a Grain source over the train shards indexes.

ArrayRecord record layout (one record per document):
    b"TLY1" | dtype code (1 byte, b"i" = int32 little-endian) | domain length (1 byte)
    | domain (UTF-8) | token ids
Parquet layout: a `tokens` column of list<int32> (other integer widths are accepted when the
values fit) and a `domain` string column.

An OLMo numpy token mix is given as its index JSON, or as token files (a list of them, or a
directory holding them, `*.npy` at any depth in path order) with their sequence length and
dtype. Each token file is one shard (format 'olmo', train split) whose records are the file's
fixed-length instances; its base key is the file's instance offset, so record keys are the
mix's global instance ids.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from audit.core.errors import CorpusError
from audit.core.hashing import TOKEN_DTYPE, content_hash, hash_runs
from pipeline import olmo

MAGIC = b"TLY1"
_HEADER = len(MAGIC) + 2
FORMATS = {".array_record": "array_record", ".parquet": "parquet"}
TOKEN_FILE_SUFFIX = ".npy"  # an OLMo mix's token files


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
    fmt: str  # 'array_record' | 'parquet' | 'olmo'
    split: str  # 'train' | 'heldout'
    num_records: int
    base_key: int  # record key of the shard's first record
    olmo: olmo.OlmoFile | None = None  # fmt 'olmo': the token file, its label and layout

    @property
    def source(self) -> str:
        """The manifest's `source`: the file's name (an OLMo file: its path relative to the
        mix's common directory, as names repeat across a mix's directories)."""
        return self.olmo.source if self.olmo is not None else self.path.name

    @property
    def size_bytes(self) -> int:
        """Bytes of the file the shard's records read."""
        if self.olmo is not None:
            f = self.olmo
            return f.n_instances * f.sequence_length * np.dtype(f.dtype).itemsize
        return self.path.stat().st_size


@dataclass(frozen=True)
class Corpus:
    """What a manifest reads: its shards in global order, what `tally.corpus` names, and the
    metadata that says more about it (an OLMo mix's fingerprint, sequence length, dtype)."""

    shards: list[Shard]
    name: str
    metadata: dict[str, str] = field(default_factory=dict)


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
    except (CorpusError, ModuleNotFoundError):  # the latter: the command names the extra
        raise  # (audit.extras) where "unreadable array_record shard" read as a damaged file
    except Exception as exc:
        raise CorpusError(f"{path}: unreadable {fmt} shard: {exc}") from None


CorpusArg = str | Path | Sequence[str | Path]


def list_shards(corpus: CorpusArg, *, sequence_length: int | None = None,
                dtype: str | None = None) -> list[Shard]:
    """The corpus' shards in global order, with record counts and base keys."""
    return open_corpus(corpus, sequence_length=sequence_length, dtype=dtype).shards


def open_corpus(corpus: CorpusArg, *, sequence_length: int | None = None,
                dtype: str | None = None) -> Corpus:
    """The corpus a manifest reads: a directory of ArrayRecord / Parquet shards, an OLMo mix's
    index (`*.json`), or token files (several, or a directory of `*.npy`) with their
    `sequence_length` and `dtype`. CorpusError, in one line, for anything else."""
    paths = [Path(corpus)] if isinstance(corpus, str | Path) else [Path(p) for p in corpus]
    flags = sequence_length is not None or dtype is not None
    if not paths:
        raise CorpusError("no corpus given")
    if len(paths) == 1 and paths[0].suffix == ".json":
        return _olmo_corpus(olmo.load_index(paths[0]), paths[0], sequence_length, dtype)
    if len(paths) == 1 and paths[0].is_dir():
        root = paths[0]
        if not flags:
            return Corpus(_tally_shards(root), str(root.resolve()))
        tokens = _token_files_in(root)
        if not tokens:
            raise CorpusError(f"corpus {root} holds no token files (*{TOKEN_FILE_SUFFIX}) "
                              "for --sequence-length/--dtype")
        return _token_files(tokens, root, sequence_length, dtype)
    if len(paths) == 1 and not paths[0].exists() and not flags and (
            paths[0].suffix != TOKEN_FILE_SUFFIX):
        raise CorpusError(f"corpus {paths[0]} is not a directory")
    dirs = [p for p in paths if p.is_dir()]
    if dirs:
        raise CorpusError(f"corpus {dirs[0]} is a directory: give one directory, an OLMo "
                          "index .json, or token files")
    if not flags:
        raise CorpusError(f"token files ({paths[0]}{' ...' if len(paths) > 1 else ''}) need "
                          "--sequence-length and --dtype (or give the mix's index .json)")
    return _token_files(paths, None, sequence_length, dtype)


def _token_files(paths: Sequence[Path], root: Path | None, sequence_length: int | None,
                 dtype: str | None) -> Corpus:
    if sequence_length is None or dtype is None:
        raise CorpusError("token files need both --sequence-length and --dtype")
    index = olmo.index_from_files(paths, sequence_length, dtype)
    name = root.resolve() if root is not None else olmo.common_dir(
        [f.path for f in index.files]).resolve()
    return _olmo_corpus(index, name, None, None)


def _olmo_corpus(index: olmo.OlmoIndex, name: Path, sequence_length: int | None,
                 dtype: str | None) -> Corpus:
    if sequence_length is not None and sequence_length != index.sequence_length:
        raise CorpusError(f"OLMo index {index.path} says sequence_length "
                          f"{index.sequence_length}, not --sequence-length {sequence_length}")
    if dtype is not None and dtype != index.dtype.name:
        raise CorpusError(f"OLMo index {index.path} says dtype {index.dtype.name}, not "
                          f"--dtype {dtype}")
    if not index.total_instances:
        where = f"OLMo index {index.path}" if index.path else "OLMo token files"
        raise CorpusError(f"{where}: no file holds a whole instance of "
                          f"{index.sequence_length:,} tokens")
    shards = [Shard(f.path, "olmo", "train", f.n_instances, f.instance_offset, f)
              for f in index.files]
    return Corpus(shards, str(Path(name).resolve()), index.metadata())


def _token_files_in(root: Path) -> list[Path]:
    """The token files under `root`, at any depth, in path order (hidden ones left out)."""
    return sorted(p for p in root.rglob(f"*{TOKEN_FILE_SUFFIX}") if p.is_file() and not
                  any(part.startswith(".") for part in p.relative_to(root).parts))


def _tally_shards(root: Path) -> list[Shard]:
    paths = [p for p in root.iterdir() if p.suffix in FORMATS and not p.name.startswith(".")]
    if not paths and _token_files_in(root):
        raise CorpusError(f"corpus {root} holds token files (*{TOKEN_FILE_SUFFIX}) and no "
                          "ArrayRecord or Parquet shards: give --sequence-length and --dtype "
                          "to read them as an OLMo token mix, or the mix's index .json")
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


def hash_range(shard: Shard, start: int, end: int
               ) -> tuple[np.ndarray, np.ndarray, list[str] | pa.Array]:
    """Content hashes (uint64), lengths (int32) and domains of records [start, end)."""
    try:
        if shard.olmo is not None:  # one label per file: the domains as one Arrow array
            n = end - start
            return (shard.olmo.hashes(start, end),
                    np.full(n, shard.olmo.sequence_length, np.int32), repeat(shard.olmo.label, n))
        if shard.fmt == "array_record":
            return _hash_array_record(shard, start, end)
        values, offsets, domains = _read_parquet(shard, start, end)
        lengths = np.diff(offsets)
        return hash_runs(values, offsets[:-1], lengths), lengths.astype(np.int32), domains
    except CorpusError:
        raise
    except Exception as exc:
        raise CorpusError(f"{shard.path}: cannot read records {start}..{end - 1}: {exc}") from None


def repeat(value: str, n: int) -> pa.Array:
    """`n` times the string `value`, as an Arrow string array built without a list of n."""
    return pa.array([value], pa.string()).take(pa.array(np.zeros(n, np.int32)))


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
        if shard.olmo is not None:
            return shard.olmo.instances(local, local + 1)[0], shard.olmo.label
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
