"""The manifest job (Beam): one row per corpus record, in the corpus' global order.

Columns: record_key, content_hash, n_tokens, domain, split, source, source_index, doc_id. The
file's metadata holds the manifest fingerprint (`tally.manifest_fingerprint`), which a run
records to say which corpus it trained against, and the content basis the hashes are taken
under (`tally.content_basis`, tally.pipeline.text).

The pipeline's elements are record ranges of a shard; each range is read, hashed with the
project's one hash function, and written as an Arrow part file by one worker, so no element is
one Python object per record. A text corpus' file whose records are counted only by reading it
(compressed JSON lines) is one element, read once, its part written batch by batch. The driver
then concatenates the parts in corpus order into the manifest, numbering the records (so keys
after a file of unknown count need no first pass over it) and checking that the parts cover
every element, each range whole. Bad input (a record without tokens, a token array of the wrong
type, an undecodable line, a missing text field) is reported by the worker that found it and
raised by the driver as one clear error naming the file and the record; no manifest is written.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tally.audit.core.hashing import hash_runs
from tally.pipeline import formats, progress
from tally.pipeline.corpus import CorpusArg, CorpusError, Shard, hash_range, open_corpus, repeat
from tally.pipeline.formats import Documents, Fields
from tally.pipeline.manifest_file import (  # noqa: F401
    FINGERPRINT_KEY,
    MANIFEST_SCHEMA,
    ROW_GROUP_RECORDS,
    Fingerprint,
    manifest_info,
    manifest_metadata,
)
from tally.pipeline.runners import RunnerSpec, pipeline
from tally.pipeline.text import TOKEN_IDS, ContentBasis, TextHasher

TEXT_BATCH = 1024  # documents per batch a worker tokenizes and writes (one row group each)


def manifest_rows(shard: Shard, start: int, end: int) -> pa.Table:
    """Manifest rows for records [start, end) of one shard."""
    hashes, lengths, domains = hash_range(shard, start, end)
    n = end - start
    return pa.Table.from_pydict({
        "record_key": np.arange(shard.base_key + start, shard.base_key + end, dtype=np.int64),
        "content_hash": hashes,
        "n_tokens": lengths,
        "domain": domains if shard.domain is None else repeat(shard.domain, n),
        "split": repeat(shard.split, n),
        "source": repeat(shard.source, n),
        "source_index": np.arange(start, end, dtype=np.int64),
        "doc_id": pa.nulls(n, pa.string()),
    }, schema=MANIFEST_SCHEMA)


def document_rows(shard: Shard, docs: Documents, hasher: TextHasher | None) -> pa.Table:
    """Manifest rows of a batch of a text shard's documents: token ids hashed as they are,
    text under the hasher's basis. `record_key` is the final key when the shard's base key is
    known, else -1 (the driver numbers the records)."""
    n = len(docs)
    if docs.tokens is not None:
        flat, offsets = docs.tokens
        lengths = np.diff(offsets)
        hashes, lengths = hash_runs(flat, offsets[:-1], lengths), lengths.astype(np.int32)
    else:
        assert hasher is not None and docs.text is not None
        hashes, lengths = hasher.hash_texts(docs.text)
    index = np.arange(docs.start, docs.start + n, dtype=np.int64)
    return pa.Table.from_pydict({
        "record_key": index + shard.base_key if shard.base_key is not None else
        np.full(n, -1, np.int64),
        "content_hash": hashes,
        "n_tokens": lengths,
        "domain": docs.domain if shard.domain is None else repeat(shard.domain, n),
        "split": repeat(shard.split, n),
        "source": repeat(shard.source, n),
        "source_index": index,
        "doc_id": pa.array(docs.doc_id, pa.string()),
    }, schema=MANIFEST_SCHEMA)


def part_name(index: int, start: int) -> str:
    """The part file of the element that reads shard `index` from record `start`."""
    return f"part-{index:06d}-{start:012d}.parquet"


class _WritePart(beam.DoFn):
    """Writes one record range's manifest rows as a part file (or an error file)."""

    def __init__(self, parts: str, hasher: TextHasher | None = None) -> None:
        self.parts = parts
        self.hasher = hasher

    def process(self, chunk: tuple[int, Shard, int, int | None]):
        index, shard, start, end = chunk
        final = Path(self.parts, part_name(index, start))
        tmp = final.with_name("." + final.name)
        try:
            if shard.text:
                rows = self._write_text(shard, start, end, tmp)
            else:
                table = manifest_rows(shard, start, end)
                pq.write_table(table, tmp)
                rows = table.num_rows
        except CorpusError as exc:
            tmp.unlink(missing_ok=True)
            Path(self.parts, f"error-{index:06d}-{start:012d}.txt").write_text(str(exc))
            return
        os.replace(tmp, final)
        yield index, rows

    def _write_text(self, shard: Shard, start: int, end: int | None, tmp: Path) -> int:
        """Streams the range's documents into the part, one row group per batch: memory is a
        batch's, whatever the file's size."""
        mod, rows = formats.module(shard.fmt), 0
        with pq.ParquetWriter(tmp, MANIFEST_SCHEMA) as w:
            for docs in mod.read(shard.path, shard.fields, start, end, batch=TEXT_BATCH):
                if docs.start != start + rows:
                    raise CorpusError(f"{shard.path}: the {shard.fmt} reader gave record "
                                      f"{docs.start} where {start + rows} was due")
                w.write_table(document_rows(shard, docs, self.hasher))
                rows += len(docs)
        return rows


@dataclass
class ManifestSummary:
    path: Path
    records: int
    train_records: int
    tokens: int
    fingerprint: str
    seconds: float
    bytes_read: int
    basis: ContentBasis = ContentBasis()

    def line(self) -> str:
        unit = "bytes of text" if self.basis.kind == "bytes" else "tokens"
        return (f"manifest {self.path}: {self.records:,} records ({self.train_records:,} train), "
                f"{self.tokens:,} {unit}, fingerprint {self.fingerprint}, "
                f"{self.seconds:.1f} s ({self.records / max(self.seconds, 1e-9):,.0f} records/s, "
                f"{self.bytes_read / 1e6 / max(self.seconds, 1e-9):,.0f} MB/s); content hashes "
                f"over {self.basis.describe()}")


def build_manifest(corpus: CorpusArg, out: str | Path, *, runner: RunnerSpec | None = None,
                   chunk_records: int = 20_000, progress: bool = False,
                   sequence_length: int | None = None, dtype: str | None = None,
                   fmt: str | None = None, fields: Fields | None = None,
                   tokenizer: str | Path | None = None, bos_id: int | None = None,
                   eos_id: int | None = None, special_tokens: bool = False,
                   max_tokens: int | None = None,
                   domains: Sequence[str] | None = None) -> ManifestSummary:
    """Run the manifest job over `corpus` and write `out` (Parquet) atomically.

    `corpus`: a directory of shards, an OLMo mix's index JSON, OLMo token files (a list, or
    a directory of them) with their `sequence_length` and `dtype` (`tally.pipeline.corpus`), or a
    text corpus (a directory or files of a format of tally.pipeline.formats, `fmt` to name it,
    `fields` to say which field holds what). A text corpus is hashed over the token ids
    `tokenizer` makes of each document with the run's settings (tally.pipeline.text), or over its
    bytes without a tokenizer; a token field is hashed as it is. `domains`: "NAME=GLOB" each,
    every record of a file whose path (under the corpus directory, or whole) matches GLOB has
    domain NAME, the first that matches (a mixture's components, MaxText's
    `grain_train_files="web/*:0.7;code/*:0.3"`, as the domains the reconcile measures)."""
    runner = runner or RunnerSpec()
    t0 = time.perf_counter()
    settings = dict(bos_id=bos_id, eos_id=eos_id, special_tokens=special_tokens,
                    max_tokens=max_tokens)
    # Loaded before the corpus is listed: a tokenizer that does not load fails in a second.
    hasher = TextHasher(tokenizer, **settings) if tokenizer is not None else None
    # Absolute paths: workers of a cluster do not share this process's working directory.
    source = open_corpus([Path(c).absolute() for c in (
        [corpus] if isinstance(corpus, str | Path) else corpus)],
        sequence_length=sequence_length, dtype=dtype, fmt=fmt, fields=fields)
    shards = by_domain(source.shards, domains or ())
    basis = _basis(shards, hasher, tokenizer, settings)
    if hasher is None and basis.kind != TOKEN_IDS:
        hasher = TextHasher(None)
    chunks: list[tuple[int, Shard, int, int | None]] = []
    for i, s in enumerate(shards):
        if s.num_records is None:
            chunks.append((i, s, 0, None))
        else:
            chunks += [(i, s, a, min(a + chunk_records, s.num_records))
                       for a in range(0, s.num_records, chunk_records)]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = out.absolute().with_name(f".{out.name}.parts")
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir()
    try:
        with _progress(parts, len(chunks), progress), \
                pipeline(runner, partitions=len(chunks)) as p:
            _ = (p | "ranges" >> beam.Create(chunks)
                   | "spread" >> beam.Reshuffle()
                   | "hash" >> beam.ParDo(_WritePart(str(parts), hasher)))
        errors = sorted(parts.glob("error-*.txt"))
        if errors:
            raise CorpusError(errors[0].read_text()
                              + (f" (and {len(errors) - 1} more bad ranges)" if len(errors) > 1
                                 else ""))
        summary = _concatenate(parts, out, chunks, source.name,
                               {**source.metadata, **{f"tally.{k}": v
                                                      for k, v in basis.metadata().items()}})
    finally:
        shutil.rmtree(parts, ignore_errors=True)
    summary.seconds = time.perf_counter() - t0
    summary.bytes_read = sum(s.size_bytes for s in shards)
    summary.basis = basis
    return summary


def by_domain(shards: list[Shard], domains: Sequence[str]) -> list[Shard]:
    """`shards` with the domain of each file that a "NAME=GLOB" of `domains` matches (its
    `source` or its whole path, fnmatch); CorpusError for a malformed one or a GLOB that
    matches no file (a typo would otherwise leave the files in their own domains)."""
    rules = []
    for d in domains:
        name, sep, pattern = d.partition("=")
        if not sep or not name.strip() or not pattern.strip():
            raise CorpusError(f"--domain {d!r}: expected NAME=GLOB (e.g. web='web/*')")
        rules.append((name.strip(), pattern.strip()))

    def matches(s: Shard, pattern: str) -> bool:
        return fnmatch.fnmatch(s.source, pattern) or fnmatch.fnmatch(str(s.path), pattern)

    for name, pattern in rules:
        if not any(matches(s, pattern) for s in shards):
            raise CorpusError(f"--domain {name}={pattern}: matches none of the corpus' files "
                              f"(they are named as {shards[0].source!r})")
    return [next((dataclasses.replace(s, domain=n) for n, g in rules if matches(s, g)), s)
            for s in shards]


def _basis(shards: list[Shard], hasher: TextHasher | None, tokenizer: str | Path | None,
           settings: dict) -> ContentBasis:
    """What the manifest's hashes rest on; CorpusError when the settings do not apply."""
    tokens = [s for s in shards if not s.text or s.fields.tokens]
    given = tokenizer is not None or any(v not in (None, False) for v in settings.values())
    if tokens and given:
        what = "token ids" if not tokens[0].text else f"token ids ({tokens[0].fields.tokens!r})"
        raise CorpusError(f"corpus file {tokens[0].path} holds {what}, which are hashed as "
                          "they are: --tokenizer, --bos-id, --eos-id, --special-tokens and "
                          "--max-tokens apply to text")
    if tokens:
        return ContentBasis(TOKEN_IDS)
    return hasher.basis if hasher is not None else TextHasher(None, **settings).basis


def _concatenate(parts: Path, out: Path, chunks: list[tuple[int, Shard, int, int | None]],
                 corpus: str, metadata: dict[str, str]) -> ManifestSummary:
    """The parts in corpus order into `out`, records numbered as they come; CorpusError when
    an element's part is missing or holds other than its range."""
    fp = Fingerprint()
    tmp = out.with_name(f".{out.name}.tmp")
    key, tokens, n_train = 0, 0, 0
    pending: list[pa.Table] = []  # rows not yet written: row groups are cut at equal sizes
    with pq.ParquetWriter(tmp, MANIFEST_SCHEMA) as w:
        for index, shard, start, end in chunks:
            part = parts / part_name(index, start)
            want = f"records {start}..{end - 1}" if end is not None else "records"
            if not part.exists():
                raise CorpusError(f"manifest job lost {want} of {shard.path} (keys from {key}; "
                                  "a worker failed without an error?)")
            pf = pq.ParquetFile(part)
            n = pf.metadata.num_rows
            if end is not None and n != end - start:
                raise CorpusError(f"manifest job wrote {n} rows for records {start}..{end - 1} "
                                  f"of {shard.path}")
            if shard.base_key is not None and shard.base_key + start != key:
                raise CorpusError(f"manifest job lost records {key}..{shard.base_key + start - 1}"
                                  " (a worker failed without an error?)")
            for g in range(pf.num_row_groups):
                table = pf.read_row_group(g)
                table = table.set_column(0, "record_key", pa.array(
                    np.arange(key, key + table.num_rows, dtype=np.int64)))
                pending.append(table)
                if sum(t.num_rows for t in pending) >= ROW_GROUP_RECORDS:
                    rows = pa.concat_tables(pending)
                    whole = rows.num_rows // ROW_GROUP_RECORDS * ROW_GROUP_RECORDS
                    w.write_table(rows.slice(0, whole), row_group_size=ROW_GROUP_RECORDS)
                    pending = [rows.slice(whole)] if whole < rows.num_rows else []
                fp.update(table)
                key += table.num_rows
                tokens += int(np.sum(table["n_tokens"].to_numpy(), dtype=np.int64))
            n_train += n if shard.split == "train" else 0
        if pending:
            w.write_table(pa.concat_tables(pending))
        w.add_key_value_metadata({**manifest_metadata(fp.hexdigest(), key, n_train,
                                                      corpus=corpus), **metadata})
    os.replace(tmp, out)
    return ManifestSummary(out, key, n_train, tokens, fp.hexdigest(), 0.0, 0)


class _progress:
    """A progress bar fed by the part files appearing, whatever runner does the work."""

    def __init__(self, parts: Path, total: int, enabled: bool) -> None:
        self.parts, self.total, self.enabled = parts, total, enabled
        self._stop = threading.Event()

    def __enter__(self) -> None:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        with progress.bar(True, total=self.total, unit="range", desc="manifest") as bar:
            while True:
                done = len(list(self.parts.glob("*-*.*")))
                bar.update(done - bar.n)
                if self._stop.wait(0.5):
                    bar.update(len(list(self.parts.glob("*-*.*"))) - bar.n)
                    return

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()
