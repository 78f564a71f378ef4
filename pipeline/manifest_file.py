"""The manifest file's contract: its schema, its metadata keys, and how to read them.

Apart from the Beam job that writes manifests (pipeline/manifest.py), so that training hosts,
the pre-flight check and the API read manifests without importing Beam.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from tally.audit.core.errors import TallyError
from tally.audit.core.paths import atomic_write
from tally.audit.hook.segments import Segments
from tally.pipeline.corpus import CorpusError
from tally.pipeline.text import ContentBasis, basis_differences

MANIFEST_SCHEMA = pa.schema([
    ("record_key", pa.int64()),
    ("content_hash", pa.uint64()),
    ("n_tokens", pa.int32()),
    ("domain", pa.string()),
    ("split", pa.string()),
    ("source", pa.string()),
    ("source_index", pa.int64()),
    ("doc_id", pa.string()),  # the document's own id in a text corpus; null when it has none
])
# Manifests written before `doc_id` lack it; every reader takes both.
LEGACY_SCHEMA = pa.schema([f for f in MANIFEST_SCHEMA if f.name != "doc_id"])
# The fingerprint covers these columns, and `doc_id` only when some record has one: a token
# corpus' fingerprint is the one it had before `doc_id` existed, so runs that recorded it still
# match a rebuilt manifest.
FINGERPRINT_COLUMNS = LEGACY_SCHEMA.names
FINGERPRINT_KEY = b"tally.manifest_fingerprint"
# Records per row group, the same in every group but the last. Reconcile reads the manifest key
# range by key range; equal groups let it cut its ranges on group boundaries, so that no group
# is decoded twice (twice the manifest's decode cost with 1M-record groups cut in halves).
ROW_GROUP_RECORDS = 1 << 17


class Fingerprint:
    """xxh3_64 per column over the manifest in key order, then over the column digests
    (`doc_id`'s only when some record has one; a null one is hashed as the byte 0xff, which no
    UTF-8 string is).

    Fed table by table; the result does not depend on how the rows were batched.
    """

    def __init__(self) -> None:
        self._h = {name: xxhash.xxh3_64() for name in FINGERPRINT_COLUMNS}
        self._doc_id = xxhash.xxh3_64()
        self._any_doc_id = False

    def update(self, table: pa.Table) -> None:
        if "doc_id" in table.column_names:
            ids = table["doc_id"]
            if ids.null_count < len(ids):
                self._any_doc_id = True
            self._doc_id.update(b"".join(b"\xff\0" if v is None else v.encode() + b"\0"
                                         for v in ids.to_pylist()))
        for name in FINGERPRINT_COLUMNS:
            col = table[name]
            if pa.types.is_string(col.type):
                vals = col.to_pylist()
                self._h[name].update(("\0".join(vals) + "\0").encode() if vals else b"")
            else:
                arr = col.to_numpy()
                self._h[name].update(np.ascontiguousarray(arr, arr.dtype.newbyteorder("<")))

    def hexdigest(self) -> str:
        digests = [h.digest() for h in self._h.values()]
        if self._any_doc_id:
            digests.append(self._doc_id.digest())
        return xxhash.xxh3_64_hexdigest(b"".join(digests))


def manifest_metadata(fingerprint: str, records: int, train_records: int,
                      **extra: str) -> dict[str, str]:
    """The manifest's `tally.*` metadata block, as manifest_info reads it back: the
    fingerprint, the records, the train records, and `extra` keys (e.g. `corpus`)."""
    return {FINGERPRINT_KEY.decode(): fingerprint, "tally.records": str(records),
            "tally.train_records": str(train_records),
            **{f"tally.{k}": str(v) for k, v in extra.items()}}


def write_manifest_table(table: pa.Table, path: str | Path, *, fingerprint: str | None = None,
                         row_group_size: int | None = None, **extra: str) -> Path:
    """A manifest held whole in one table (tests, benchmarks, small corpora) written with its
    metadata block: train records counted from `split`, the fingerprint computed (Fingerprint)
    unless given; a table without `doc_id` gets a null one. The Beam job (tally.pipeline.manifest)
    streams its own with manifest_metadata."""
    if "doc_id" not in table.column_names:
        table = table.append_column("doc_id", pa.nulls(table.num_rows, pa.string()))
    table = table.select(MANIFEST_SCHEMA.names).cast(MANIFEST_SCHEMA)
    if fingerprint is None:
        fp = Fingerprint()
        fp.update(table)
        fingerprint = fp.hexdigest()
    train = int(pc.sum(pc.equal(table["split"], "train")).as_py() or 0)
    with pq.ParquetWriter(path, MANIFEST_SCHEMA) as w:
        w.write_table(table, row_group_size=row_group_size)
        w.add_key_value_metadata(manifest_metadata(fingerprint, table.num_rows, train, **extra))
    return Path(path)


def uniform_row_groups(meta: pq.FileMetaData) -> int | None:
    """The records per row group when every group but the last holds the same number."""
    sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    if not sizes or any(n != sizes[0] for n in sizes[:-1]) or sizes[-1] > sizes[0]:
        return None
    return sizes[0]


def manifest_info(path: str | Path) -> dict[str, str]:
    """The manifest's `tally.*` metadata: fingerprint, records, train_records, corpus."""
    try:
        meta = pq.read_metadata(path)
    except Exception as exc:
        raise CorpusError(f"cannot read manifest {path}: {exc}") from None
    md = meta.metadata or {}
    schema = meta.schema.to_arrow_schema().remove_metadata()
    if not (schema.equals(MANIFEST_SCHEMA) or schema.equals(LEGACY_SCHEMA)) or not all(
            k in md for k in (FINGERPRINT_KEY, b"tally.records", b"tally.train_records")):
        raise CorpusError(f"{path} is not a Tally manifest (build one with `tally manifest`)")
    return {k.decode()[len("tally."):]: v.decode() for k, v in md.items()
            if k.startswith(b"tally.")}


@dataclass
class ManifestDomains:
    """The manifest as the live service needs it: sizes and each train record's domain."""

    path: str
    fingerprint: str
    records: int
    train_records: int
    domain_codes: np.ndarray  # int32 per record key
    domain_names: list[str]

    @classmethod
    def load(cls, path: str | Path) -> ManifestDomains:
        info = manifest_info(path)
        t = pq.read_table(path, columns=["record_key", "domain", "split"])
        n = int(info["train_records"])
        keys = t["record_key"].to_numpy()
        split = t["split"].to_numpy(zero_copy_only=False)
        if not np.array_equal(keys, np.arange(len(keys))) or not (
                (split[:n] == "train").all() and (split[n:] != "train").all()):
            raise TallyError(f"manifest {path}: record keys are not 0..N-1 with the train split "
                             "first (rebuild it with `tally manifest`)")
        dom = t["domain"].dictionary_encode().combine_chunks()
        return cls(str(path), info["manifest_fingerprint"], len(keys), n,
                   dom.indices.to_numpy(zero_copy_only=False).astype(np.int32),
                   dom.dictionary.to_pylist())


class ManifestHashes:
    """Hashes and lengths from the manifest's train split (8 + 4 bytes a record in memory);
    nothing is read from the corpus, so integrity figures prove only the keys. Here, not beside
    Grain's attach (which re-exports it), so that the PyTorch-side adapters' audits and replays
    read it without Grain."""

    def __init__(self, manifest: str | os.PathLike) -> None:
        info = manifest_info(manifest)
        table = pq.read_table(manifest, columns=["record_key", "content_hash", "n_tokens",
                                                 "split"])
        train = table.filter(pc.equal(table["split"], "train"))
        keys = train["record_key"].to_numpy()
        if not np.array_equal(keys, np.arange(len(keys))):
            raise TallyError(f"manifest {manifest}: train record keys are not "
                             f"0..{len(keys) - 1} in order")
        self.hash = train["content_hash"].to_numpy()
        self.n_tokens = train["n_tokens"].to_numpy()
        self.path = os.fspath(manifest)
        self.fingerprint = info["manifest_fingerprint"]
        # Hashes taken from the manifest are under its content basis (tally.pipeline.text), which
        # the run's spool then says ("" for a manifest that records none: token ids).
        self.content_basis = info.get("content_basis", "")

    def __len__(self) -> int:
        return len(self.hash)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(content hashes, lengths) of record keys, or TallyError for keys beyond the split."""
        if len(keys) and (keys.min() < 0 or keys.max() >= len(self.hash)):
            bad = keys[(keys < 0) | (keys >= len(self.hash))][0]
            raise TallyError(f"record key {bad} is outside the manifest's train split "
                             f"(0..{len(self.hash) - 1}): is it this corpus' manifest?")
        return self.hash[keys], self.n_tokens[keys]

    def segments(self, keys: np.ndarray, epochs: np.ndarray) -> Segments:
        h, n = self.lookup(keys)
        return Segments.build(row=np.arange(len(keys)), record_key=keys, n_tokens=n,
                              content_hash=h, epoch=epochs)


# One manifest record in the integrity cache: its content hash and length, packed (12 bytes).
KEY_INDEX_DTYPE = np.dtype([("hash", "<u8"), ("n_tokens", "<i4")], align=False)


def check_key_order(path: str, record_key: pa.Array, split: pa.Array, done: int,
                    train_records: int) -> np.ndarray:
    """A batch of a manifest's rows read in order from row `done`: its keys, checked to be
    `done`, `done` + 1, ... with the train split first (held out is a key at or past the train
    records), which what reads the manifest by key relies on; TallyError otherwise."""
    keys = record_key.to_numpy()
    train = pc.equal(split, "train").to_numpy(zero_copy_only=False)
    if not np.array_equal(keys, np.arange(done, done + len(keys))) or \
            not np.array_equal(train, keys < train_records):
        raise TallyError(f"manifest {path}: record keys are not 0..N-1 with the train split "
                         "first (rebuild it with `tally manifest`)")
    return keys


class ManifestKeyIndex:
    """Every manifest record's content hash and length by record key (all splits: the train
    split first, then the held-out ones), memory-mapped from a cache file of 12 bytes a record
    (`<cache_dir>/<fingerprint>.npy`): what ingest checks each consumed row against
    (tally.audit.ledger.integrity). The pages live in the page cache, not in the process'
    anonymous memory, and a run's rows touch only the pages of the keys it consumed.

    The cache is built once per manifest fingerprint, row group by row group (a row group's
    memory at a time), and published whole (a kill leaves the old one or none)."""

    def __init__(self, path: str | os.PathLike, cache_dir: str | os.PathLike) -> None:
        info = manifest_info(path)
        self.path = str(path)
        self.fingerprint = info["manifest_fingerprint"]
        self.records = int(info["records"])
        self.train_records = int(info["train_records"])
        self.content_basis = info.get("content_basis", "")
        ContentBasis.from_json(self.content_basis, f"manifest {path}")  # readable, or said now
        cache = Path(cache_dir) / f"{self.fingerprint}.npy"
        table = self._load(cache) if cache.exists() else None
        if table is None:  # none yet, or damaged (derived data: built again)
            try:
                self._build(cache)
            except OSError as exc:
                raise TallyError(f"cannot write the integrity cache {cache}: {exc}") from None
            table = self._load(cache)
            if table is None:
                raise TallyError(f"integrity cache {cache} cannot be read back")
        self.hash, self.n_tokens = table["hash"], table["n_tokens"]

    def _load(self, cache: Path) -> np.ndarray | None:
        try:
            table = np.load(cache, mmap_mode="r")
        except (ValueError, OSError, EOFError):
            return None
        ok = table.dtype == KEY_INDEX_DTYPE and table.shape == (self.records,)
        return table if ok else None

    def _build(self, cache: Path) -> None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        f = pq.ParquetFile(self.path)
        with atomic_write(cache, tmp) as out:
            np.lib.format.write_array_header_1_0(out, {
                "descr": np.lib.format.dtype_to_descr(KEY_INDEX_DTYPE), "fortran_order": False,
                "shape": (self.records,)})
            done = 0
            for batch in f.iter_batches(columns=["record_key", "content_hash", "n_tokens",
                                                 "split"], batch_size=ROW_GROUP_RECORDS):
                keys = check_key_order(self.path, batch.column(0), batch.column(3), done,
                                       self.train_records)
                part = np.empty(len(keys), KEY_INDEX_DTYPE)
                part["hash"] = batch.column(1).to_numpy()
                part["n_tokens"] = batch.column(2).to_numpy()
                out.write(part.tobytes())
                done += len(keys)
            if done != self.records:
                raise TallyError(f"manifest {self.path} holds {done} records, its metadata "
                                 f"says {self.records}")

    def basis_differences(self, run_basis: str | None) -> list[str]:
        """How the run's content basis (JSON from its spool) differs from the manifest's, in
        words; [] when the run's hashes are comparable."""
        return basis_differences(self.content_basis, [run_basis])
