"""Tokenized corpora: ArrayRecord shards (Grain's native format), Parquet files, and OLMo numpy
token mixes (`tally.pipeline.olmo`).

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

A text corpus (tally.pipeline.formats: Dolma JSON lines, Parquet with a text or token column, a
Hugging Face `datasets` directory, ...) is a directory of files of one format, or a list of
them: each file is one shard, in the same global order (train files by path, then held-out
files by path; a format that knows its own splits, such as a `datasets` directory, says which
files are which). A file whose records are counted only by reading it (compressed JSON lines)
has no count and no base key up front: the manifest job numbers its records when it puts the
parts together.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tally.audit.core.errors import CorpusError
from tally.audit.core.hashing import TOKEN_DTYPE, content_hash, hash_runs
from tally.pipeline import formats, olmo
from tally.pipeline.formats import Fields

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
    fmt: str  # 'array_record' | 'parquet' | 'olmo' | a text format (tally.pipeline.formats.FORMATS)
    split: str  # 'train' | 'heldout'
    num_records: int | None  # None: known only once read (a text format's count() said so)
    base_key: int | None  # record key of the shard's first record; None after an unknown count
    olmo: olmo.OlmoFile | None = None  # fmt 'olmo': the token file, its label and layout
    fields: Fields | None = None  # a text format: which field holds what
    name: str = ""  # a text format: the file's path relative to the corpus directory
    domain: str | None = None  # every record's domain, by the file (`tally manifest --domain`)

    @property
    def text(self) -> bool:
        """A shard of a text format (read through tally.pipeline.formats)."""
        return self.fields is not None

    @property
    def source(self) -> str:
        """The manifest's `source`: the file's name (an OLMo file: its path relative to the
        mix's common directory, as names repeat across a mix's directories; a text corpus'
        file: its path relative to the corpus directory)."""
        if self.olmo is not None:
            return self.olmo.source
        return self.name or self.path.name

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
        raise  # (tally.audit.extras) where "unreadable array_record shard" read as a damaged file
    except Exception as exc:
        raise CorpusError(f"{path}: unreadable {fmt} shard: {exc}") from None


CorpusArg = str | Path | Sequence[str | Path]


def list_shards(corpus: CorpusArg, *, sequence_length: int | None = None,
                dtype: str | None = None) -> list[Shard]:
    """The corpus' shards in global order, with record counts and base keys."""
    return open_corpus(corpus, sequence_length=sequence_length, dtype=dtype).shards


def open_corpus(corpus: CorpusArg, *, sequence_length: int | None = None,
                dtype: str | None = None, fmt: str | None = None,
                fields: Fields | None = None) -> Corpus:
    """The corpus a manifest reads: a directory of ArrayRecord / Parquet shards, an OLMo mix's
    index (`*.json`), token files (several, or a directory of `*.npy`) with their
    `sequence_length` and `dtype`, or a text corpus (a directory or a list of files of one
    format of tally.pipeline.formats, found by the files' names or layout or named by `fmt`;
    `fields`
    says which field holds what). CorpusError, in one line, for anything else."""
    paths = [Path(corpus)] if isinstance(corpus, str | Path) else [Path(p) for p in corpus]
    flags = sequence_length is not None or dtype is not None
    if not paths:
        raise CorpusError("no corpus given")
    if (fmt is not None or fields is not None) and flags:
        raise CorpusError("--sequence-length/--dtype read OLMo token files; --format and the "
                          "field flags read a text corpus: not both")
    if fmt is not None:
        return _text_corpus(paths, formats.module(fmt), fields)
    if len(paths) == 1 and paths[0].suffix == ".json" and fields is None:
        try:
            index = olmo.load_index(paths[0])
        except CorpusError as exc:
            if "not valid JSON (Extra data" not in str(exc):
                raise
            # JSON values one after another (one a line) are not one JSON document: a Dolma
            # file named *.json, not a broken index.
            raise CorpusError(f"{exc}; a JSON lines file of documents? give --format jsonl"
                              ) from None
        return _olmo_corpus(index, paths[0], sequence_length, dtype)
    if len(paths) == 1 and paths[0].is_dir():
        root = paths[0]
        if not flags:
            if fields is None and _tally_dir(root):
                return Corpus(_tally_shards(root), str(root.resolve()))
            if fields is None and _token_files_in(root):  # an OLMo mix's directory (its
                raise CorpusError(  # index.json must not read as another format's)
                    f"corpus {root} holds token files (*{TOKEN_FILE_SUFFIX}) and no "
                    "ArrayRecord or Parquet shards: give --sequence-length and --dtype to read "
                    "them as an OLMo token mix, or the mix's index .json")
            return _text_corpus(paths, None, fields)
        tokens = _token_files_in(root)
        if not tokens:
            raise CorpusError(f"corpus {root} holds no token files (*{TOKEN_FILE_SUFFIX}) "
                              "for --sequence-length/--dtype")
        return _token_files(tokens, root, sequence_length, dtype)
    if len(paths) == 1 and not paths[0].exists() and not flags and (
            paths[0].suffix != TOKEN_FILE_SUFFIX):
        raise CorpusError(f"corpus {paths[0]} is not a directory")
    if not flags and all(formats.detect(p) is not None for p in paths):
        return _text_corpus(paths, None, fields)
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


def _is_tally_shard(path: Path) -> bool:
    """A Parquet file with a `tokens` column, or an ArrayRecord file of TLY1 records (one
    that cannot be read counts as Tally's, whose reader then names the damage)."""
    try:
        if path.suffix == ".parquet":
            return "tokens" in pq.read_schema(path).names
        from array_record.python.array_record_module import ArrayRecordReader

        reader = ArrayRecordReader(str(path))
        try:
            return reader.num_records() == 0 or reader.read([0])[0][:4] == MAGIC
        finally:
            reader.close()
    except Exception:
        return True


def _tally_dir(root: Path) -> bool:
    """The directory holds Tally's own shards (not a text corpus stored as Parquet or as
    ArrayRecord of another record format)."""
    paths = [p for p in root.iterdir() if p.suffix in FORMATS and not p.name.startswith(".")]
    return bool(paths) and all(_is_tally_shard(p) for p in paths)


# Files a text corpus directory may hold beside its data, left out without a word. Any other
# file in no known format is refused: left out silently, its records would be missing.
_NOT_DATA = ("readme", "license", "licence", ".gitattributes")


def _data_files(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*")) if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(root).parts) and not (
        p.name.lower().startswith(_NOT_DATA) or p.suffix == ".md")]


def _text_corpus(paths: list[Path], fmt: formats.Format | None, fields: Fields | None
                 ) -> Corpus:
    """Shards of a text corpus (see the module's docstring), counted where the format can."""
    fields = fields or Fields()
    if fields.tokens and fields.tokens == fields.text:
        raise CorpusError(f"--tokens-field and --text-field both name {fields.tokens!r}")
    root = paths[0] if len(paths) == 1 and paths[0].is_dir() else None
    listed: list[tuple[Path, str]]
    mod = fmt if fmt is not None else (formats.detect(root) if root is not None else None)
    if root is not None and mod is not None and mod.matches(root) and hasattr(mod, "shards"):
        listed = list(mod.shards(root))  # the format's own order and splits
    else:
        files = _data_files(root) if root is not None else paths
        if root is not None and fmt is not None:
            files = [p for p in files if fmt.matches(p)] or files
        if not files:
            raise CorpusError(f"corpus {root} holds no shards (*.array_record or *.parquet) and "
                              f"no documents (formats: {', '.join(formats.FORMATS)})")
        dirs = [p for p in files if p.is_dir()]
        if dirs and root is None:
            raise CorpusError(f"corpus {dirs[0]} is a directory: give one directory, or files")
        if mod is None:
            found = {}
            for p in files:
                m = formats.detect(p)
                if m is None:
                    raise CorpusError(f"corpus file {p}: in no known format (by its name: "
                                      f"{', '.join(formats.FORMATS)}); remove it, or name the "
                                      "format with --format")
                found.setdefault(m.NAME, (m, p))
            if len(found) > 1:
                (a, (_, pa_)), (b, (_, pb)) = list(found.items())[:2]
                raise CorpusError(f"corpus {root or 'files'} mixes formats {a} ({pa_.name}) and "
                                  f"{b} ({pb.name}): give the files of one format")
            mod = next(iter(found.values()))[0]
        listed = sorted(((p, _split_of(p)) for p in files),
                        key=lambda ps: (ps[1] != "train", str(ps[0])))
    base = root if root is not None else Path(olmo.common_dir([p for p, _ in listed]))
    shards: list[Shard] = []
    key: int | None = 0
    for p, split in sorted(listed, key=lambda ps: ps[1] != "train"):  # stable: format's order
        n = mod.count(p, fields)
        try:
            name = str(p.relative_to(base))
        except ValueError:
            name = p.name
        shards.append(Shard(p, mod.NAME, split, n, key, fields=fields, name=name))
        key = None if key is None or n is None else key + n
    used = {"tokens": fields.tokens} if fields.tokens else {"text": fields.text}
    used |= {"id": fields.id} | ({"domain": fields.domain} if fields.domain else {})
    return Corpus(shards, str(Path(base).resolve()),
                  {"tally.format": mod.NAME, "tally.fields": json.dumps(used, sort_keys=True)})


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
        if any(s.text for s in self.shards):
            raise CorpusError(f"corpus {corpus} is a text corpus: TokenSource reads token "
                              "shards (Tally's, an OLMo mix)")
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
