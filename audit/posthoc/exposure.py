"""Was this trained on? Documents matched to corpus records by exact content hash, and how
often each run consumed those records (exposures: effective record starts,
tally.audit.core.exposure), at which steps, on which hosts, in which epochs.

A document is identified by its content: its tokens' content hash (tally.audit.core.hashing), given
as a corpus directory in Tally's formats (hashed here), or as a Parquet file with a
`content_hash` column, a `record_key` column (the manifest says those records' hashes) or a
`tokens` column. Documents given as text (JSON lines, plain or compressed, or Parquet with a text
column) are hashed under the manifest's content basis (tally.pipeline.text): their UTF-8 bytes, or
the
token ids of the manifest's own tokenizer with its settings (`text_hashes`). A document matches
every corpus record with its hash: one that equals several records (exact duplicates in the
corpus) matches them all, and their exposures add up; each matched record is named by its
record key and by the corpus' own id of it (`doc_id`, null in manifests without the column).

The same answer comes from a run's spool (its published segment files, restart lineage applied)
or from a ledger, for the CLI (`exposure`) and for the live API (`answer`, inside the service's
snapshot).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tally.audit.core.arrays import distinct
from tally.audit.core.errors import TallyError
from tally.audit.core.exposure import (
    Findings,
    effective,
    effective_sql,
    rolled_back_from,
    start_sql,
    starts,
)
from tally.audit.hook.spool import BadFile, read_checked, replayed_run

EXPOSURE_VERSION = 1
DOC_CHUNK = 65_536  # documents hashed per read

# Per matched record: what a run's consumption says about it.
CONSUMED_SCHEMA = pa.schema([
    ("record_key", pa.int64()), ("exposures", pa.int64()), ("first_step", pa.int64()),
    ("last_step", pa.int64()), ("hosts", pa.list_(pa.int32())),
    ("epochs", pa.list_(pa.int32())),
])
# OUT/exposure.parquet: one row per document, matched record and run (a document without a
# match has one row per run with a null record_key).
TABLE_SCHEMA = pa.schema([
    ("document", pa.int64()), ("document_id", pa.string()), ("content_hash", pa.uint64()),
    ("record_key", pa.int64()), ("doc_id", pa.string()), ("split", pa.string()),
    ("domain", pa.string()), ("run_id", pa.string()),
    ("exposures", pa.int64()), ("first_step", pa.int64()), ("last_step", pa.int64()),
    ("hosts", pa.list_(pa.int32())), ("epochs", pa.list_(pa.int32())),
])
# The per-record aggregation, in DuckDB over the ledger's rows or a spool's.
_AGGREGATE = """record_key, count(*) AS exposures, min(step) AS first_step,
    max(step) AS last_step, list_sort(list_distinct(list(host))) AS hosts,
    list_sort(list_distinct(list(epoch))) AS epochs"""


# ---- the corpus side: content hashes -> record keys -------------------------------------------

@dataclass
class ManifestHashes:
    """The manifest's content hash, split and domain of every record (keys are 0..N-1)."""

    path: str
    fingerprint: str
    content_hash: pa.Array  # uint64, by record key
    split: pa.DictionaryArray
    domain: pa.DictionaryArray
    doc_id: pa.Array | None = None  # the corpus' own id of each record (None: no column)
    content_basis: str = ""  # the manifest's (tally.pipeline.text.ContentBasis JSON; "": token ids)

    @classmethod
    def load(cls, path: str | Path) -> ManifestHashes:
        p = Path(path)
        if not p.is_file():
            raise TallyError(f"no manifest at {p}")
        st = p.stat()
        return _load_hashes(str(p), st.st_mtime_ns, st.st_size)

    @property
    def records(self) -> int:
        return len(self.content_hash)

    def match(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(document index, record key) for every record whose hash equals a document's, in
        document then key order. One vectorised pass over the manifest's hashes."""
        hashes = np.asarray(hashes, np.uint64)
        distinct_hashes = distinct(hashes)
        keys = np.flatnonzero(pc.is_in(self.content_hash, value_set=pa.array(distinct_hashes))
                              .to_numpy(zero_copy_only=False))
        by_hash = np.argsort(self.content_hash.to_numpy()[keys], kind="stable")
        keys = keys[by_hash]
        matched = self.content_hash.to_numpy()[keys]
        lo = np.searchsorted(matched, hashes, "left")
        count = np.searchsorted(matched, hashes, "right") - lo
        doc = np.repeat(np.arange(len(hashes)), count)
        first = np.repeat(lo, count)
        offset = np.arange(len(doc)) - np.repeat(np.cumsum(count) - count, count)
        return doc, keys[first + offset].astype(np.int64)

    def names(self, col: str, keys: np.ndarray) -> list[str]:
        arr = getattr(self, col)
        return arr.dictionary.take(arr.indices.take(pa.array(keys))).to_pylist()

    def doc_ids(self, keys: np.ndarray) -> list[str | None]:
        """The corpus' own ids of records (None each, for a manifest without `doc_id`)."""
        if self.doc_id is None:
            return [None] * len(keys)
        return self.doc_id.take(pa.array(keys, pa.int64())).to_pylist()


@functools.lru_cache(maxsize=4)
def _load_hashes(path: str, mtime_ns: int, size: int) -> ManifestHashes:
    # Cached per file version: the live service loads a manifest once, not per request.
    from tally.pipeline.manifest_file import manifest_info

    info = manifest_info(path)
    has_ids = "doc_id" in pq.read_schema(path).names  # manifests before text corpora: none
    t = pq.read_table(path, columns=["record_key", "content_hash", "split", "domain"]
                      + ["doc_id"] * has_ids)
    if not np.array_equal(t["record_key"].to_numpy(), np.arange(t.num_rows)):
        raise TallyError(f"manifest {path}: record keys are not 0..N-1 (rebuild it with "
                         "`tally manifest`)")
    return ManifestHashes(path, info["manifest_fingerprint"],
                          t["content_hash"].combine_chunks(),
                          t["split"].combine_chunks().dictionary_encode(),
                          t["domain"].combine_chunks().dictionary_encode(),
                          t["doc_id"].combine_chunks().cast(pa.string()) if has_ids else None,
                          info.get("content_basis", ""))


# ---- the documents ------------------------------------------------------------------------------

@dataclass
class Documents:
    """The documents asked about: each one's content hash (None: no such record key)."""

    path: str
    kind: str  # "corpus" | "parquet" | "jsonl"
    by: str  # "tokens" | "content_hash" | "record_key" | "text"
    content_hash: np.ndarray  # uint64
    known: np.ndarray  # bool: False for a record key beyond the manifest (no hash)
    ids: list[str | None] | None = None  # each document's own id (text documents)
    basis: str | None = None  # text documents: what they were hashed over, in words

    def __len__(self) -> int:
        return len(self.content_hash)


def parse_hashes(values: list[Any], where: str) -> np.ndarray:
    """Content hashes given as integers, decimal strings or 0x-hex strings, as uint64."""
    out = np.empty(len(values), np.uint64)
    for i, v in enumerate(values):
        try:
            h = int(v, 0) if isinstance(v, str) and v.lower().startswith("0x") else int(v)
        except (TypeError, ValueError):
            raise TallyError(f"{where} row {i}: {v!r} is not a content hash (an integer, or "
                             "0x-hex)") from None
        if not 0 <= h < 2**64:
            raise TallyError(f"{where} row {i}: {v!r} is not an xxh3_64 value (0 <= h < 2**64)")
        out[i] = h
    return out


def text_hasher(manifest: ManifestHashes, tokenizer: str | os.PathLike | None = None) -> Any:
    """A tally.pipeline.text.TextHasher that hashes text as the manifest hashed its documents: their
    UTF-8 bytes, or the token ids of the manifest's own tokenizer (`tokenizer`, whose
    fingerprint must be the manifest's) with the manifest's settings (BOS/EOS, special tokens,
    token limit, read from its `tally.content_basis`). TallyError, in one line, otherwise."""
    from tally.pipeline.text import BYTES, TOKEN_IDS, ContentBasis, TextHasher

    basis = ContentBasis.from_json(manifest.content_basis, f"manifest {manifest.path}")
    if basis.kind == TOKEN_IDS:
        raise TallyError(f"manifest {manifest.path} hashes token ids (a corpus stored as token "
                         "ids), so documents given as text would need the tokenizer the corpus "
                         "was tokenized with, which the manifest does not name: give the "
                         "documents' token ids (a Parquet `tokens` column) or content hashes")
    if basis.kind == BYTES:
        if tokenizer is not None:
            raise TallyError(f"manifest {manifest.path} hashes each document's UTF-8 bytes (it "
                             "was built without a tokenizer): leave --tokenizer out")
        return TextHasher(None)
    if tokenizer is None:
        raise TallyError(f"manifest {manifest.path} hashes the token ids of tokenizer "
                         f"{basis.tokenizer_name or '?'} ({basis.tokenizer}): give that "
                         "tokenizer with --tokenizer (its settings are read from the manifest)")
    hasher = TextHasher(tokenizer, bos_id=basis.bos_id, eos_id=basis.eos_id,
                        special_tokens=basis.special_tokens, max_tokens=basis.max_tokens)
    if hasher.basis.tokenizer != basis.tokenizer:
        raise TallyError(f"tokenizer {tokenizer} ({hasher.basis.tokenizer}) is not the "
                         f"manifest's: manifest {manifest.path} hashes the token ids of "
                         f"tokenizer {basis.tokenizer_name or '?'} ({basis.tokenizer})")
    return hasher


def _text_format(p: Path) -> Any:
    """The tally.pipeline.formats module that reads `p` as text documents (None: neither)."""
    from tally.pipeline.formats import jsonl, parquet_text

    return next((m for m in (jsonl, parquet_text) if m.matches(p)), None)


def load_text_documents(p: Path, manifest: ManifestHashes, *, text_field: str = "text",
                        id_field: str = "id", tokenizer: str | os.PathLike | None = None
                        ) -> Documents:
    """Documents given as text (JSON lines, plain or compressed, or Parquet with a text
    column), read by tally.pipeline.formats and hashed under the manifest's basis (text_hasher),
    DOC_CHUNK at a time. Each document keeps its own id (`id_field`; absent: None)."""
    from tally.pipeline.formats import Fields, jsonl

    hasher = text_hasher(manifest, tokenizer)
    fmt = _text_format(p)
    fields = Fields(text=text_field, id=id_field)
    hashes, ids = [], []
    for docs in fmt.read(p, fields, 0, None, DOC_CHUNK):
        if docs.text is None:  # a reader that found token ids where text was asked for
            raise TallyError(f"documents {p}: no text field {text_field!r}")
        hashes.append(hasher.hash_texts(docs.text)[0])
        ids += docs.doc_id
    h = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
    return Documents(str(p), "jsonl" if fmt is jsonl else "parquet", "text", h,
                     np.ones(len(h), bool), ids, hasher.basis.describe())


def load_documents(path: str | Path, manifest: ManifestHashes, *, text_field: str = "text",
                   id_field: str = "id", tokenizer: str | os.PathLike | None = None
                   ) -> Documents:
    """The documents of a corpus directory (every shard, hashed), of a Parquet file with a
    `content_hash`, `record_key` or `tokens` column, or given as text: JSON lines (`.jsonl`,
    `.json`, gzip or zstandard) or Parquet with a `text_field` column (load_text_documents)."""
    from tally.pipeline.corpus import hash_range, list_shards

    p = Path(path)
    if p.is_dir():  # read in ranges: a shard's tokens need not fit in memory at once
        hashes = [hash_range(s, lo, min(lo + DOC_CHUNK, s.num_records))[0]
                  for s in list_shards(p) for lo in range(0, s.num_records, DOC_CHUNK)]
        h = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
        return _not_text(Documents(str(p), "corpus", "tokens", h, np.ones(len(h), bool)),
                         tokenizer)
    if not p.is_file():
        raise TallyError(f"documents {p}: no such corpus directory, JSON lines or Parquet "
                         "file")
    if p.suffix != ".parquet" and _text_format(p) is not None:
        return load_text_documents(p, manifest, text_field=text_field, id_field=id_field,
                                   tokenizer=tokenizer)
    try:
        names = pq.read_schema(p).names
    except Exception as exc:
        raise TallyError(f"documents {p}: not a Parquet or JSON lines file ({exc})") from None
    if not {"content_hash", "record_key", "tokens"} & set(names) and text_field in names:
        return load_text_documents(p, manifest, text_field=text_field, id_field=id_field,
                                   tokenizer=tokenizer)
    return _not_text(_hashed_parquet(p, names, manifest), tokenizer)


def _not_text(docs: Documents, tokenizer: str | os.PathLike | None) -> Documents:
    if tokenizer is not None:
        raise TallyError(f"documents {docs.path}: --tokenizer goes with documents given as "
                         f"text; these are given by {docs.by}")
    return docs


def _hashed_parquet(p: Path, names: list[str], manifest: ManifestHashes) -> Documents:
    """Documents of a Parquet file by content_hash, record_key or tokens column."""
    from tally.pipeline.corpus import hash_range
    if "content_hash" in names:
        col = pq.read_table(p, columns=["content_hash"])["content_hash"].combine_chunks()
        if col.null_count:
            raise TallyError(f"documents {p}: column content_hash has nulls")
        if pa.types.is_uint64(col.type):
            h = col.to_numpy()
        elif pa.types.is_integer(col.type):  # signed 64-bit: the same 64 bits
            h = col.cast(pa.int64()).to_numpy().view(np.uint64)
        elif pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            h = parse_hashes(col.to_pylist(), f"documents {p} column content_hash")
        else:
            raise TallyError(f"documents {p}: column content_hash is {col.type}, expected "
                             "uint64, int64 or strings")
        return Documents(str(p), "parquet", "content_hash", h, np.ones(len(h), bool))
    if "record_key" in names:
        col = pq.read_table(p, columns=["record_key"])["record_key"].combine_chunks()
        if not pa.types.is_integer(col.type) or col.null_count:
            raise TallyError(f"documents {p}: column record_key must be integers without nulls "
                             f"(is {col.type})")
        keys = col.cast(pa.int64()).to_numpy()
        known = (keys >= 0) & (keys < manifest.records)
        h = np.zeros(len(keys), np.uint64)
        h[known] = manifest.content_hash.to_numpy()[keys[known]]
        return Documents(str(p), "parquet", "record_key", h, known)
    if "tokens" in names:  # a corpus shard on its own
        from tally.pipeline.corpus import Shard

        n = pq.read_metadata(p).num_rows
        shard = Shard(p, "parquet", "train", n, 0)
        parts = [hash_range(shard, lo, min(lo + DOC_CHUNK, n))[0]
                 for lo in range(0, n, DOC_CHUNK)]
        h = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
        return Documents(str(p), "parquet", "tokens", h, np.ones(len(h), bool))
    raise TallyError(f"documents {p}: no content_hash, record_key, tokens or text column "
                     f"(has {', '.join(names)}; a text column of another name: --text-field)")


def load_document_tokens(path: str | Path, eos: int, manifest: ManifestHashes
                         ) -> tuple[Documents, np.ndarray | None]:
    """Documents to look for inside an OLMo mix (`--eos-token-id`): their content hashes and
    lengths, from a Parquet file's `tokens` column (a trailing EOS token dropped) or a corpus
    directory; from a `content_hash` column, hashes only (every document of the mix is then
    hashed to compare)."""
    from tally.audit.core.hashing import hash_runs
    from tally.pipeline.corpus import hash_range, list_shards

    p = Path(path)
    if p.is_dir():
        parts = [hash_range(s, lo, min(lo + DOC_CHUNK, s.num_records))[:2]
                 for s in list_shards(p) for lo in range(0, s.num_records, DOC_CHUNK)]
        h = np.concatenate([x[0] for x in parts]) if parts else np.zeros(0, np.uint64)
        n = np.concatenate([x[1] for x in parts]) if parts else np.zeros(0, np.int32)
        return Documents(str(p), "corpus", "tokens", h, np.ones(len(h), bool)), n
    if not p.is_file():
        raise TallyError(f"documents {p}: no such corpus directory or Parquet file")
    try:
        names = pq.read_schema(p).names
    except Exception as exc:
        raise TallyError(f"documents {p}: not a Parquet file ({exc})") from None
    if "tokens" not in names:
        if "content_hash" in names:
            return load_documents(p, manifest), None
        raise TallyError(f"documents {p}: --eos-token-id needs a tokens or content_hash column "
                         f"(has {', '.join(names)})")
    pf = pq.ParquetFile(p)
    hashes, lengths = [], []
    for batch in pf.iter_batches(batch_size=DOC_CHUNK, columns=["tokens"]):
        col = batch.column(0)
        if not pa.types.is_list(col.type) and not pa.types.is_large_list(col.type):
            raise TallyError(f"documents {p}: column tokens is {col.type}, expected a list of "
                             "token ids")
        if col.null_count:
            raise TallyError(f"documents {p}: column tokens has nulls")
        offsets = np.asarray(col.offsets, np.int64)
        values = col.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        flat = np.asarray(values.to_numpy(zero_copy_only=False))
        if flat.size and flat.dtype.kind not in "iu":
            raise TallyError(f"documents {p}: token ids of type {flat.dtype}")
        flat = flat.astype(np.int32)
        starts = offsets[:-1] - offsets[0]
        n = np.diff(offsets)
        ends_eos = n > 0
        ends_eos[ends_eos] = flat[(starts + n - 1)[ends_eos]] == eos
        n = n - ends_eos
        hashes.append(hash_runs(flat, starts, n))
        lengths.append(n)
    h = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
    return (Documents(str(p), "parquet", "tokens", h, np.ones(len(h), bool)),
            np.concatenate(lengths) if lengths else np.zeros(0, np.int64))


# ---- the run side: exposures of the matched records ------------------------------------------

def consumed_in_ledger(cur: duckdb.DuckDBPyConnection, run: int,
                       keys: np.ndarray) -> pa.Table:
    """Per record of `keys` that run `run` consumed: exposures, first and last step, hosts,
    epochs (one scan of the run's consumption, inside the caller's snapshot)."""
    if not len(keys):
        return CONSUMED_SCHEMA.empty_table()
    # A name of this cursor's own (each thread of the service reads with its own cursor).
    name = f"tally_wanted_{threading.get_ident()}"
    cur.register(name, pa.table({"k": pa.array(distinct(keys), pa.int64())}))
    try:
        return cur.sql(f"""
            SELECT {_AGGREGATE} FROM (
                SELECT c.record_key, c.step, c.host, c.epoch
                FROM consumption c JOIN attempts a USING (run, attempt)
                WHERE c.run = ? AND {effective_sql("c", "a")} AND {start_sql("c")}
                  AND c.record_key IN (SELECT k FROM {name}))
            GROUP BY record_key ORDER BY record_key""", params=[run]).to_arrow_table().cast(
            CONSUMED_SCHEMA)
    finally:
        cur.unregister(name)


def consumed_in_spool(spool: Path, run_id: str, keys: np.ndarray,
                      workers: int | None = None) -> tuple[pa.Table, dict[str, Any], bool]:
    """The same from a run's published spool files (restart lineage applied); the files left
    out, as reconcile counts them (tally.audit.buckets.left_out.files_left_out: entries that
    are not spool files and files that fail their checks are unreadable, repeats of a host-step
    are duplicates); and whether `tally replay` wrote the run's files
    (tally.audit.hook.spool.replayed_run)."""
    from tally.audit.buckets.left_out import files_left_out
    from tally.audit.buckets.plan import spool_inputs

    listed = spool_inputs(spool, run_id)
    files, attempts = listed.files, listed.attempts
    replayed = replayed_run(listed.replayed_files, listed.segment_files or 0)
    cutoffs = rolled_back_from({a: v["resumed_from_step"] for a, v in attempts.items()})
    wanted = pa.array(distinct(keys), pa.int64())

    def rows(f) -> pa.Table | tuple[str, str]:
        try:
            table, _ = read_checked(f.spool_file)
        except BadFile as exc:
            return f.path, str(exc)
        hit = pc.is_in(table["record_key"], value_set=wanted).to_numpy(zero_copy_only=False)
        step = table["step"].to_numpy()
        keep = hit & starts(table["offset"].to_numpy()) & effective(
            step, np.full(len(step), f.spool_file.attempt, np.int32), cutoffs)
        return table.select(["record_key", "step", "host", "epoch"]).filter(keep)

    with ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1)) as pool:
        parts = list(pool.map(rows, files)) if len(wanted) else []
    skipped = [p for p in parts if isinstance(p, tuple)]
    tables = [p for p in parts if not isinstance(p, tuple)]
    found = pa.concat_tables(tables) if tables else pa.table({
        "record_key": pa.array([], pa.int64()), "step": pa.array([], pa.int64()),
        "host": pa.array([], pa.int32()), "epoch": pa.array([], pa.int32())})
    con = duckdb.connect()
    try:
        con.register("found", found)
        out = con.sql(f"SELECT {_AGGREGATE} FROM found GROUP BY record_key "
                          "ORDER BY record_key").to_arrow_table()
    finally:
        con.close()
    return out.cast(CONSUMED_SCHEMA), files_left_out(listed.left_out, skipped,
                                                     len(skipped)), replayed


# ---- documents x records x runs ---------------------------------------------------------------

def join(docs_hash: np.ndarray, doc: np.ndarray, key: np.ndarray, index: ManifestHashes,
         consumed: dict[str, pa.Table], doc_ids: list[str | None] | None = None) -> pa.Table:
    """One row per document, matched record and run (a document without a match: one row per
    run with a null record key), in document, record and run order. `doc_ids`: each
    document's own id (`document_id`); `doc_id` is the matched record's, the corpus'."""
    unmatched = np.setdiff1d(np.arange(len(docs_hash)), doc)
    order = np.concatenate([doc, unmatched]).astype(np.int64)
    pairs = pa.table({
        "document": order,
        "document_id": pa.array([doc_ids[i] for i in order.tolist()] if doc_ids is not None
                                else [None] * len(order), pa.string()),
        "content_hash": np.concatenate([docs_hash[doc], docs_hash[unmatched]]),
        "record_key": pa.concat_arrays([pa.array(key, pa.int64()),
                                        pa.nulls(len(unmatched), pa.int64())]),
        "doc_id": pa.array(index.doc_ids(key) + [None] * len(unmatched), pa.string()),
        "split": pa.array(index.names("split", key) + [None] * len(unmatched), pa.string()),
        "domain": pa.array(index.names("domain", key) + [None] * len(unmatched), pa.string()),
    })
    runs = pa.table({"run_id": pa.array(list(consumed), pa.string())})
    found = pa.concat_tables([c.append_column("run_id", pa.array([r] * len(c), pa.string()))
                              for r, c in consumed.items()]) if consumed else None
    if found is None:
        return TABLE_SCHEMA.empty_table()
    con = duckdb.connect()
    try:
        for name, t in (("pairs", pairs), ("runs", runs), ("found", found)):
            con.register(name, t)
        return con.sql("""
            SELECT p.document, p.document_id, p.content_hash, p.record_key, p.doc_id, p.split,
                   p.domain, r.run_id,
                   coalesce(f.exposures, 0) AS exposures, f.first_step, f.last_step, f.hosts,
                   f.epochs
            FROM pairs p CROSS JOIN runs r
            LEFT JOIN found f ON f.run_id = r.run_id AND f.record_key = p.record_key
            ORDER BY p.document, p.record_key NULLS LAST, r.run_id""").to_arrow_table(
            ).cast(TABLE_SCHEMA)
    finally:
        con.close()


def summarize(table: pa.Table, documents: int, run_ids: list[str]) -> dict[str, Any]:
    """Per run: documents, matched, consumed, consumed_2plus, and the records behind them; and
    how many runs consumed each document."""
    con = duckdb.connect()
    try:
        con.register("t", table)
        rows = con.execute("""
            WITH per_doc AS (
                SELECT run_id, document, count(record_key) AS records,
                       sum(exposures) AS exposures, min(first_step) AS first_step,
                       max(last_step) AS last_step
                FROM t GROUP BY ALL)
            SELECT run_id, count(*) FILTER (WHERE records > 0),
                   count(*) FILTER (WHERE exposures >= 1),
                   count(*) FILTER (WHERE exposures >= 2), min(first_step), max(last_step)
            FROM per_doc GROUP BY run_id""").fetchall()
        records = dict(con.execute("""
            SELECT run_id, count(DISTINCT record_key) FILTER (WHERE exposures > 0)
                   FROM t GROUP BY run_id""").fetchall())
        exposures = dict(con.execute("""
            SELECT run_id, coalesce(sum(exposures), 0) FROM (
                SELECT DISTINCT run_id, record_key, exposures FROM t
                WHERE record_key IS NOT NULL) GROUP BY run_id""").fetchall())
        by_runs = dict(con.execute("""
            SELECT runs, count(*) FROM (
                SELECT document, count(DISTINCT run_id) FILTER (WHERE exposures > 0) AS runs
                FROM t GROUP BY document) GROUP BY runs""").fetchall())
    finally:
        con.close()
    out = {}
    for run_id, matched, consumed, twice, first, last in rows:
        out[run_id] = {
            "documents": documents, "matched": matched, "consumed": consumed,
            "consumed_2plus": twice, "records_consumed": int(records.get(run_id, 0)),
            "exposures": int(exposures.get(run_id, 0)), "first_step": first,
            "last_step": last,
            "headline": f"of the {documents:,} documents, {matched:,} are in the corpus and "
                        f"{consumed:,} of them were consumed, {twice:,} of them twice or more"}
    return {"runs": {r: out[r] for r in run_ids if r in out},
            "consumed_by_runs": {str(k): int(by_runs.get(k, 0))
                                 for k in range(len(run_ids) + 1)}}


def exposure(*, manifest: str | Path, docs: str | Path, runs: list[str], out: str | Path,
             spool: str | Path | None = None, ledger: str | Path | None = None,
             eos_token_id: int | None = None, text_field: str = "text", id_field: str = "id",
             tokenizer: str | os.PathLike | None = None) -> dict:
    """Documents -> matched records -> each run's exposures; writes OUT/exposure.parquet and
    OUT/exposure.json, returns the latter's content.

    Documents given as text (`text_field`, `id_field`) are hashed under the manifest's
    content basis; one hashed as token ids of a tokenizer needs that tokenizer (`tokenizer`).

    With `eos_token_id`, the manifest is an OLMo mix's (built from its index) and a document
    matches the instances that hold its tokens: every run of tokens between two EOS tokens of
    the mix with the document's content (`tally.pipeline.olmo.find_documents`)."""
    from tally.audit.buckets.left_out import files_left_out, left_out_findings
    from tally.audit.ledger.database import Ledger
    from tally.audit.ledger.queries import quarantined_of, replayed_of, run_of

    if (spool is None) == (ledger is None):
        raise TallyError("give exactly one of --spool or --ledger")
    if not runs:
        raise TallyError("give at least one --run")
    runs = list(dict.fromkeys(runs))
    index = ManifestHashes.load(manifest)
    occurrences = None
    if eos_token_id is None:
        docs_ = load_documents(docs, index, text_field=text_field, id_field=id_field,
                               tokenizer=tokenizer)
        doc, key = index.match(docs_.content_hash[docs_.known])
        doc = np.flatnonzero(docs_.known)[doc]
    else:
        docs_, doc, key, occurrences = _inside_mix(index, docs, eos_token_id)
    consumed, left_out, replayed = {}, {}, {}
    if spool is not None:
        if not Path(spool).is_dir():
            raise TallyError(f"spool {spool} is not a directory")
        for r in runs:
            consumed[r], left_out[r], replayed[r] = consumed_in_spool(Path(spool), r, key)
    else:
        with Ledger(ledger, read_only=True) as led:
            cur = led.cursor()
            for r in runs:
                try:
                    run = run_of(cur, r)
                except TallyError as exc:  # NotFound: name the ledger
                    raise TallyError(f"{exc} (ledger {ledger})") from None
                consumed[r] = consumed_in_ledger(cur, run, key)
                # What ingest set aside, counted as the spool's reader counts it.
                left_out[r] = files_left_out(quarantined_of(cur, r), [], 0)
                replayed[r] = replayed_of(cur, run)["replayed"]
    table = join(docs_.content_hash, doc, key, index, consumed, docs_.ids)
    per_run = summarize(table, len(docs_), runs)
    findings = Findings()
    for r, facts in per_run["runs"].items():
        # Written by `tally replay` from the loader's contract: what the loader would have
        # fed, not what the run consumed.
        facts["replayed"] = replayed[r]
        facts.update(left_out[r])
        left_out_findings(left_out[r], findings.add, whose=f"run {r}",
                          missing_from="these exposures", run=r)
    result = {
        "exposure_version": EXPOSURE_VERSION,
        "generated_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "docs": {"path": docs_.path, "kind": docs_.kind, "by": docs_.by,
                 **({"content_basis": docs_.basis} if docs_.basis else {})},
        "manifest": {"path": str(manifest), "fingerprint": index.fingerprint,
                     "records": index.records},
        "source": {"kind": "spool" if spool is not None else "ledger",
                   "path": str(spool if spool is not None else ledger)},
        "documents": len(docs_),
        "unknown_record_keys": int((~docs_.known).sum()),
        "matched": int(len(distinct(doc))),
        "matched_records": int(len(distinct(key))),
        **per_run,
        # The matched records, each named by its key and the corpus' own id (doc_id; null in
        # a manifest without one), the first EXAMPLES of them.
        "matches": _matches(table),
        "findings": findings.to_list(),
    }
    if occurrences is not None:  # documents found inside an OLMo mix
        result["docs"]["eos_token_id"] = eos_token_id
        result["occurrences"] = int(occurrences.sum())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / "exposure.parquet")
    (out / "exposure.json").write_text(json.dumps(result, indent=2))
    return result


EXAMPLES = 100  # matched (document, record) pairs exposure.json names; the table has all


def _matches(table: pa.Table) -> list[dict[str, Any]]:
    """The first EXAMPLES matched (document, record) pairs: the document (index, own id), the
    record (key, the corpus' doc_id) and its exposures per run."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for r in table.filter(pc.is_valid(table["record_key"])).select(
            ["document", "document_id", "record_key", "doc_id", "run_id", "exposures"]
            ).to_pylist():
        pair = (r["document"], r["record_key"])
        if pair not in out:
            if len(out) == EXAMPLES:
                break
            out[pair] = {k: r[k] for k in ("document", "document_id", "record_key", "doc_id")
                         } | {"exposures": {}}
        out[pair]["exposures"][r["run_id"]] = r["exposures"]
    return list(out.values())


def _inside_mix(manifest: ManifestHashes, docs: str | Path, eos: int
                ) -> tuple[Documents, np.ndarray, np.ndarray, np.ndarray]:
    """(documents, document index, record key, occurrences per document) of documents found
    as runs of tokens between EOS tokens in the OLMo mix the manifest was built from."""
    from tally.pipeline.manifest_file import manifest_info
    from tally.pipeline.olmo import find_documents, load_index

    mix = manifest_info(manifest.path).get("olmo_index")
    if not mix:
        raise TallyError(f"manifest {manifest.path} is not of an OLMo mix built from its index "
                         "(no tally.olmo_index): --eos-token-id looks for documents inside one")
    index = load_index(mix)
    docs_, lengths = load_document_tokens(docs, eos, manifest)
    doc, key, occurrences = find_documents(index, docs_.content_hash, lengths, eos)
    return docs_, doc, key, occurrences


def summary(result: dict, out: Path | None = None) -> str:
    lines = [f"documents {result['docs']['path']}: {result['documents']:,} documents, "
             f"{result['matched']:,} in the corpus ({result['matched_records']:,} records)"]
    for run_id, r in result["runs"].items():
        lines.append(f"  run {run_id}: {r['headline']} ({r['exposures']:,} exposures"
                     + (f", steps {r['first_step']}..{r['last_step']})" if r["consumed"]
                        else ")")
                     + (" — replayed from the loader's contract, not recorded live"
                        if r.get("replayed") else ""))
    lines += [f"  {x['severity']}: {x['message']}" for x in result.get("findings", [])]
    if out is not None:
        lines.append(f"  exposure: {out / 'exposure.parquet'}  ({out / 'exposure.json'})")
    return "\n".join(lines)
