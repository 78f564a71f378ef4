"""OLMo numpy token mixes: flat token files cut into fixed-length instances.

OLMo and MaxText train on token files that are flat dumps of token ids: raw little-endian
uint16 or uint32 (usually named `*.npy` although they have no .npy header; a real .npy file,
with its `\\x93NUMPY` header, is read too: the header gives the data's offset, dtype and shape).
Each file is cut into `n_tokens // sequence_length` instances of exactly `sequence_length`
tokens (trailing tokens are dropped), and the mix's global instance order is the files'
instances in the index's file order: instance i of the mix is instance
`i - instance_offset` of the file whose `[instance_offset, instance_offset + n_instances)`
holds it. Tally's record key for an OLMo mix is that global instance id.

The index is MaxText's `OlmoNpyIndex` JSON (format_version "1")::

    {"format_version": "1", "sequence_length": 2048, "dtype": "uint32",
     "tokenizer": "allenai/dolma3-tokenizer", "total_instances": N, "total_tokens": T,
     "fingerprint": "sha256:...",
     "files": [{"path": "web/part-0.npy", "label": "web", "n_tokens": 123,
                "n_instances": 0, "instance_offset": 0}, ...]}

A relative `path` is relative to the JSON's directory. `load_index` checks everything it can
before a job starts (format version, keys, the counts and offsets, every file's presence, size
and dtype) and raises `CorpusError` with one line naming the file and what is wrong. Token
dtypes: uint8, uint16, uint32, int32.

A file list without an index (`index_from_files`) takes n_tokens from each file's size and
labels each file with its parent directory's name (OLMo mixes keep one source per directory,
e.g. `.../dclm/part-003.npy`). `write_mix` writes a small mix with its index (tests, demo,
benchmarks).

Hashing: an instance's content hash is `tally.audit.core.hashing`'s, over its token ids as
little-endian int32, exactly as the training hook hashes a batch of int32 ids. uint8 and
uint16 ids widen to int32. uint32 ids are hashed as their own 4 bytes, which is what the hook
hashes after the usual `astype(np.int32)` of a batch: an id of 2**31 or more (no real
vocabulary has one) wraps to a negative int32 and still hashes the same on both sides.
`instance_tokens` returns that same int32 view of the ids.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tally.audit.core.errors import CorpusError
from tally.audit.core.hashing import TOKEN_DTYPE, content_hash, hash_runs

FORMAT_VERSION = "1"
DTYPES = ("uint8", "uint16", "uint32", "int32")
NPY_MAGIC = b"\x93NUMPY"
# Tokens hashed per memory-mapped block: each block is mapped, hashed and unmapped, so a
# worker's memory stays near 4 bytes x this whatever its record range.
BLOCK_TOKENS = 1 << 23
_REQUIRED = ("format_version", "sequence_length", "dtype", "files")
_FILE_REQUIRED = ("path", "n_tokens", "n_instances", "instance_offset")


@dataclass(frozen=True)
class OlmoFile:
    """One token file of a mix, with what it takes to read its instances."""

    path: Path  # absolute
    label: str  # the manifest's domain
    n_tokens: int
    n_instances: int
    instance_offset: int  # global id of the file's first instance
    sequence_length: int
    dtype: str  # the tokens' dtype on disk ('<u4'; a .npy header may say '>u4')
    data_offset: int = 0  # bytes before the first token: a .npy header's length, or 0
    source: str = ""  # the manifest's source: path relative to the mix's common directory

    def instances(self, start: int, end: int) -> np.ndarray:
        """Instances [start, end) of this file as an int32 [n, sequence_length] array (a copy)."""
        out = _as_int32(_map_range(self, start, end))
        return out if out.base is None else np.array(out)  # not a view of the map

    def hashes(self, start: int, end: int) -> np.ndarray:
        """Content hashes (uint64) of instances [start, end): each block of instances is
        mapped, viewed (or widened) as int32 rows and hashed row by row without a copy per
        row (`hash_runs`), then unmapped."""
        if not 0 <= start <= end <= self.n_instances:
            raise CorpusError(f"{self.path}: instances {start}..{end - 1} outside "
                              f"0..{self.n_instances - 1}")
        length = self.sequence_length
        per_block = max(1, BLOCK_TOKENS // length)
        out = np.empty(end - start, np.uint64)
        for lo in range(start, end, per_block):
            hi = min(lo + per_block, end)
            flat = _as_int32(_map_range(self, lo, hi)).reshape(-1)
            starts = np.arange(hi - lo, dtype=np.int64) * length
            out[lo - start:hi - start] = hash_runs(flat, starts,
                                                   np.full(hi - lo, length, np.int64))
            del flat
        return out


def _as_int32(tokens: np.ndarray) -> np.ndarray:
    """Little-endian int32 ids: uint32 and int32 are viewed as they are (no copy when they are
    little-endian; uint32 >= 2**31 wraps, see the module's docstring), narrower ids widen."""
    if tokens.dtype.itemsize == 4:
        if tokens.dtype.byteorder == ">":
            tokens = tokens.astype(tokens.dtype.newbyteorder("<"))
        return np.ascontiguousarray(tokens).view(TOKEN_DTYPE)
    return tokens.astype(TOKEN_DTYPE)


def _map_range(f: OlmoFile, start: int, end: int) -> np.ndarray:
    """Instances [start, end) of `f` as a read-only [n, sequence_length] memory map of just
    those bytes (unmapped when the array goes)."""
    dtype = np.dtype(f.dtype)
    n = end - start
    if n == 0:
        return np.empty((0, f.sequence_length), dtype)
    offset = f.data_offset + start * f.sequence_length * dtype.itemsize
    return np.memmap(f.path, dtype=dtype, mode="r", offset=offset,
                     shape=(n, f.sequence_length))


@functools.lru_cache(maxsize=128)
def _whole_file(path: Path, dtype: str, data_offset: int, n_tokens: int) -> np.ndarray:
    # One map per file and process, for random access (a Grain source); never pickled.
    return np.memmap(path, dtype=np.dtype(dtype), mode="r", offset=data_offset,
                     shape=(n_tokens,))


@dataclass(frozen=True)
class OlmoIndex:
    """A mix: its files in global order, and the instance <-> (file, local instance) maps.

    `instance_tokens(i)` (also `index[i]`, so the index is a Grain random-access source) reads
    through memory maps cached per process and per file; the index itself holds no map and
    pickles into worker processes as plain data."""

    path: Path | None  # the index JSON (None: built from a file list)
    sequence_length: int
    dtype: np.dtype
    tokenizer: str
    fingerprint: str
    files: tuple[OlmoFile, ...]
    total_instances: int
    _offsets: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_offsets",
                           np.array([f.instance_offset for f in self.files], np.int64))

    def __len__(self) -> int:
        return self.total_instances

    def __getitem__(self, i: int) -> np.ndarray:
        return self.instance_tokens(i)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file index, instance within the file) of each global instance id."""
        ids = np.asarray(ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.total_instances):
            bad = ids[(ids < 0) | (ids >= self.total_instances)][0]
            raise IndexError(f"instance {bad} outside 0..{self.total_instances - 1}")
        # side="right": a file with no instances shares its offset with the next one, and
        # the last file starting at or before the id is the one that holds it.
        file_idx = np.searchsorted(self._offsets, ids, side="right") - 1
        return file_idx, ids - self._offsets[file_idx]

    def instance_tokens(self, i: int) -> np.ndarray:
        """Instance i's token ids, as an int32 copy."""
        file_idx, local = self.locate(np.array([i]))
        f = self.files[int(file_idx[0])]
        length = self.sequence_length
        lo = int(local[0]) * length
        tokens = _whole_file(f.path, f.dtype, f.data_offset, f.n_tokens)[lo:lo + length]
        return np.array(_as_int32(tokens), copy=True)

    @property
    def total_tokens(self) -> int:
        return sum(f.n_tokens for f in self.files)

    def metadata(self) -> dict[str, str]:
        """What a manifest of this mix records about it (`tally.*` keys)."""
        return {"tally.olmo_fingerprint": self.fingerprint,
                **({"tally.olmo_index": str(self.path)} if self.path is not None else {}),
                "tally.sequence_length": str(self.sequence_length),
                "tally.dtype": self.dtype.name,
                "tally.tokenizer": self.tokenizer}


# ---- documents inside a mix --------------------------------------------------------------------

def _spans(f: OlmoFile, eos: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """The documents of `f`'s instances, block by block: (starts, ends) token offsets in the
    file of each run of tokens between EOS tokens (EOS excluded, empty runs left out), the
    block's int32 tokens and the block's first offset. Only the tokens of whole instances
    count: a document that runs into the file's dropped tail is cut there (and so matches
    no whole document)."""
    total = f.n_instances * f.sequence_length
    per_block = max(1, BLOCK_TOKENS // f.sequence_length)
    begin = 0  # start of the document running into the next block
    for lo in range(0, f.n_instances, per_block):
        hi = min(lo + per_block, f.n_instances)
        block = _as_int32(_map_range(f, lo, hi)).reshape(-1)
        first = lo * f.sequence_length
        eos_at = np.flatnonzero(block == eos) + first
        starts = np.concatenate([[begin], eos_at + 1])
        ends = np.concatenate([eos_at, [total]]) if hi == f.n_instances else eos_at
        starts = starts[:len(ends)]
        if len(eos_at):
            begin = int(eos_at[-1]) + 1
        keep = ends > starts
        yield starts[keep], ends[keep], block, first


def find_documents(index: OlmoIndex, hashes: np.ndarray, lengths: np.ndarray | None,
                   eos: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where documents sit in the mix, a document being the tokens between two EOS tokens
    (or a file's start or end) and matched by content hash (and length, when known, which
    spares hashing the mix's other documents).

    Returns (document index, global instance id) for every instance that holds tokens of an
    occurrence of a document (sorted, without repeats), and each document's occurrences. One
    pass over the mix's tokens, block by block (memory maps; a comparison with the EOS id and
    the hashes of the candidate spans)."""
    hashes = np.asarray(hashes, np.uint64)
    order = np.argsort(hashes, kind="stable")
    by_hash = hashes[order]
    wanted_lengths = None if lengths is None else np.unique(np.asarray(lengths, np.int64))
    docs_out, keys_out = [], []
    occurrences = np.zeros(len(hashes), np.int64)
    length = index.sequence_length
    for f in index.files:
        if not f.n_instances:
            continue
        whole = None
        for starts, ends, block, first in _spans(f, eos):
            n = ends - starts
            if wanted_lengths is not None:
                keep = np.isin(n, wanted_lengths)
                starts, ends, n = starts[keep], ends[keep], n[keep]
            if not len(starts):
                continue
            inside = starts >= first
            h = np.empty(len(starts), np.uint64)
            h[inside] = hash_runs(block, starts[inside] - first, n[inside])
            for j in np.flatnonzero(~inside):  # a document begun in an earlier block
                if whole is None:
                    whole = _whole_file(f.path, f.dtype, f.data_offset, f.n_tokens)
                h[j] = content_hash(_as_int32(whole[starts[j]:ends[j]]))
            lo = np.searchsorted(by_hash, h, "left")
            count = np.searchsorted(by_hash, h, "right") - lo
            span = np.repeat(np.arange(len(h)), count)
            if not len(span):
                continue
            doc = order[np.repeat(lo, count) + (np.arange(len(span)) - np.repeat(
                np.cumsum(count) - count, count))]
            np.add.at(occurrences, doc, 1)
            first_inst = starts[span] // length
            last_inst = (ends[span] - 1) // length
            per = last_inst - first_inst + 1
            docs_out.append(np.repeat(doc, per))
            keys_out.append(f.instance_offset + np.repeat(first_inst, per) + (
                np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)))
    if not docs_out:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), occurrences
    pairs = np.unique(np.stack([np.concatenate(docs_out), np.concatenate(keys_out)]), axis=1)
    return pairs[0].astype(np.int64), pairs[1].astype(np.int64), occurrences


# ---- reading an index ---------------------------------------------------------------------

def _int(value: object, where: str, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CorpusError(f"{where}: {name} is {value!r}, expected an integer >= {minimum}")
    return value


def _dtype(name: object, where: str) -> np.dtype:
    if name not in DTYPES:
        raise CorpusError(f"{where}: dtype {name!r} is not one Tally reads "
                          f"({', '.join(DTYPES)})")
    return np.dtype(str(name)).newbyteorder("<")


def _probe(path: Path, dtype: np.dtype, where: str) -> tuple[str, int, int]:
    """(dtype on disk, data offset, tokens in the file) of a raw token file or a .npy file."""
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise CorpusError(f"{where}: token file {path} is not a file")
        with open(path, "rb") as fh:
            if fh.read(len(NPY_MAGIC)) != NPY_MAGIC:
                return dtype.str, 0, size // dtype.itemsize
            fh.seek(0)
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, fortran, found = np.lib.format.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, fortran, found = np.lib.format.read_array_header_2_0(fh)
            else:
                raise CorpusError(f"{where}: token file {path}: .npy format version "
                                  f"{version[0]}.{version[1]}, Tally reads 1.0 and 2.0")
            offset = fh.tell()
    except FileNotFoundError:
        raise CorpusError(f"{where}: token file {path} is missing") from None
    except CorpusError:
        raise
    except (OSError, ValueError) as exc:
        raise CorpusError(f"{where}: token file {path}: unreadable ({exc})") from None
    if found.kind != dtype.kind or found.itemsize != dtype.itemsize:
        raise CorpusError(f"{where}: token file {path} is a .npy of {found}, the mix's dtype "
                          f"is {dtype.name}")
    if fortran and len(shape) > 1:
        raise CorpusError(f"{where}: token file {path} is a Fortran-ordered .npy; Tally reads "
                          "tokens in C order")
    n = int(np.prod(shape, dtype=np.int64))
    if offset + n * found.itemsize > size:
        raise CorpusError(f"{where}: token file {path} is truncated: its .npy header says "
                          f"{n:,} tokens, the file holds {(size - offset) // found.itemsize:,}")
    return found.str, offset, n


def common_dir(paths: Sequence[Path]) -> Path:
    """The deepest directory that holds every one of `paths` (absolute paths)."""
    return Path(os.path.commonpath([str(p.parent) for p in paths])) if paths else Path()


def _sources(paths: Sequence[Path]) -> list[str]:
    """Each file's path relative to the common directory of all of them (unique, short)."""
    common = common_dir(paths)
    return [os.path.relpath(p, common) for p in paths]


def fingerprint(sequence_length: int, dtype: str, tokenizer: str,
                files: Sequence[tuple[str, int]]) -> str:
    """Tally's fingerprint of a mix it indexes itself: sha256 over the format version,
    sequence length, dtype, tokenizer and each file's path and n_tokens, NUL-separated. An
    index written by MaxText keeps its own fingerprint string, whatever it is."""
    parts = [FORMAT_VERSION, str(sequence_length), dtype, tokenizer]
    for path, n in files:
        parts += [path, str(n)]
    return "sha256:" + hashlib.sha256("\0".join(parts).encode()).hexdigest()


def load_index(path: str | Path) -> OlmoIndex:
    """Read and check an `OlmoNpyIndex` JSON file; CorpusError (one line) when it is wrong."""
    path = Path(path).absolute()
    where = f"OLMo index {path}"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise CorpusError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CorpusError(f"{where}: unreadable ({exc})") from None
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CorpusError(f"{where}: expected a JSON object, found {type(doc).__name__}")
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise CorpusError(f"{where}: missing key(s) {', '.join(map(repr, missing))}")
    if str(doc["format_version"]) != FORMAT_VERSION:
        raise CorpusError(f"{where}: format_version {doc['format_version']!r}, Tally reads "
                          f"{FORMAT_VERSION!r}")
    length = _int(doc["sequence_length"], where, "sequence_length", 1)
    dtype = _dtype(doc["dtype"], where)
    entries = doc["files"]
    if not isinstance(entries, list) or not entries:
        raise CorpusError(f"{where}: 'files' must be a non-empty list")
    rows: list[tuple[Path, str | None, int, int, int]] = []
    expected_offset = 0
    for i, e in enumerate(entries):
        at = f"{where}: files[{i}]"
        if not isinstance(e, dict):
            raise CorpusError(f"{at} is not an object")
        missing = [k for k in _FILE_REQUIRED if k not in e]
        if missing:
            raise CorpusError(f"{at} misses key(s) {', '.join(map(repr, missing))}")
        if not isinstance(e["path"], str) or not e["path"]:
            raise CorpusError(f"{at}: path is {e['path']!r}, expected a file path")
        at = f"{where}: files[{i}] ({e['path']})"
        n_tokens = _int(e["n_tokens"], at, "n_tokens")
        n_instances = _int(e["n_instances"], at, "n_instances")
        offset = _int(e["instance_offset"], at, "instance_offset")
        if n_instances != n_tokens // length:
            raise CorpusError(f"{at}: n_instances is {n_instances:,}, but n_tokens "
                              f"{n_tokens:,} // sequence_length {length:,} = "
                              f"{n_tokens // length:,}")
        if offset != expected_offset:
            raise CorpusError(f"{at}: instance_offset is {offset:,}, but the files before it "
                              f"hold {expected_offset:,} instances")
        expected_offset += n_instances
        label = e.get("label")
        if label is not None and not isinstance(label, str):
            raise CorpusError(f"{at}: label is {label!r}, expected a string")
        rows.append((path.parent / e["path"], label, n_tokens, n_instances, offset))
    for key, want in (("total_instances", expected_offset),
                      ("total_tokens", sum(r[2] for r in rows))):
        if key in doc and doc[key] != want:
            raise CorpusError(f"{where}: {key} is {doc[key]!r}, but its files add up to "
                              f"{want:,}")
    files = _checked_files(rows, length, dtype, where)
    return OlmoIndex(path, length, dtype, str(doc.get("tokenizer", "")),
                     str(doc.get("fingerprint", "")), files, expected_offset)


def _checked_files(rows: Sequence[tuple[Path, str | None, int, int, int]], length: int,
                   dtype: np.dtype, where: str) -> tuple[OlmoFile, ...]:
    """The files of `rows` (path, label, n_tokens, n_instances, instance_offset), each checked
    for presence, dtype and size."""
    sources = _sources([r[0] for r in rows])
    out = []
    for (p, label, n_tokens, n_instances, offset), source in zip(rows, sources, strict=True):
        on_disk, data_offset, held = _probe(p, dtype, where)
        if held < n_tokens:
            raise CorpusError(f"{where}: token file {p} is shorter than the index says: "
                              f"{held:,} {dtype.name} tokens, n_tokens {n_tokens:,}")
        out.append(OlmoFile(p, label if label is not None else p.parent.name, n_tokens,
                            n_instances, offset, length, on_disk, data_offset, source))
    return tuple(out)


def index_from_files(paths: Sequence[str | Path], sequence_length: int, dtype: str,
                     labels: Sequence[str] | None = None, tokenizer: str = "") -> OlmoIndex:
    """A mix of plain token files, in the order given: n_tokens from each file's size (or its
    .npy header), label = `labels[i]`, by default the file's parent directory's name."""
    where = "OLMo token files"
    length = _int(sequence_length, where, "sequence_length", 1)
    dt = _dtype(dtype, where)
    if not paths:
        raise CorpusError(f"{where}: no files given")
    if labels is not None and len(labels) != len(paths):
        raise CorpusError(f"{where}: {len(labels)} labels for {len(paths)} files")
    abs_paths = [Path(p).absolute() for p in paths]
    rows, offset = [], 0
    for i, p in enumerate(abs_paths):
        _, _, n_tokens = _probe(p, dt, where)
        n = n_tokens // length
        rows.append((p, labels[i] if labels is not None else None, n_tokens, n, offset))
        offset += n
    files = _checked_files(rows, length, dt, where)
    fp = fingerprint(length, dt.name, tokenizer, [(f.source, f.n_tokens) for f in files])
    return OlmoIndex(None, length, dt, tokenizer, fp, files, offset)


def write_mix(directory: str | Path, files: Iterable[tuple[str, np.ndarray]],
              sequence_length: int, dtype: str = "uint32", tokenizer: str = "test") -> Path:
    """Write each (label, tokens) as a raw token file `<directory>/<label>-<i:04d>.npy` and the
    mix's `<directory>/index.json` (paths relative to it); returns the index's path. `files`
    may be a generator, so that a large mix is never in memory at once."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dt = _dtype(dtype, f"mix {directory}")
    info = np.iinfo(dt)
    entries, offset = [], 0
    for i, (label, tokens) in enumerate(files):
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise ValueError(f"file {i} ({label}): token ids do not fit in {dt.name}")
        name = f"{label}-{i:04d}.npy"
        arr.reshape(-1).astype(dt, copy=False).tofile(directory / name)
        n = arr.size // sequence_length
        entries.append({"path": name, "label": label, "n_tokens": int(arr.size),
                        "n_instances": n, "instance_offset": offset})
        offset += n
    index = {"format_version": FORMAT_VERSION, "sequence_length": sequence_length,
             "dtype": dt.name, "tokenizer": tokenizer, "total_instances": offset,
             "total_tokens": sum(e["n_tokens"] for e in entries),
             "fingerprint": fingerprint(sequence_length, dt.name, tokenizer,
                                        [(e["path"], e["n_tokens"]) for e in entries]),
             "files": entries}
    out = directory / "index.json"
    out.write_text(json.dumps(index, indent=1) + "\n")
    return out
