"""Parquet files of documents: a text column (`--text-field`, default `text`), or token ids in
a list column of any integer type and any name (`--tokens-field`, e.g. `input_ids`), with an
optional id column (`doc_id`) and domain column (`domain`, else `source`).

A range of records reads only the row groups that overlap it, batch by batch
(`ParquetFile.iter_batches`), so memory is bounded by the batch and one row group's pages,
whatever the file's size. Arrow rows become Documents as a Hugging Face Arrow shard's do
(hf_arrow.arrow_documents: one home for the column rules).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from tally.audit.core.errors import CorpusError
from tally.pipeline.formats import Documents, Fields
from tally.pipeline.formats.hf_arrow import arrow_documents

NAME = "parquet_text"


def matches(path: Path) -> bool:
    """A file named *.parquet."""
    path = Path(path)
    return path.suffix == ".parquet" and not path.is_dir()


def _open(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except Exception as exc:
        raise CorpusError(f"{path}: unreadable Parquet file ({str(exc).splitlines()[0]})"
                          ) from None


def _columns(pf: pq.ParquetFile, fields: Fields, path: Path) -> list[str]:
    names = pf.schema_arrow.names
    col = fields.tokens or fields.text
    if col not in names:
        what = "token" if fields.tokens else "text"
        raise CorpusError(f"{path}: no {what} column {col!r} (the file's columns: "
                          f"{', '.join(names)}); name it with "
                          f"--{'tokens' if fields.tokens else 'text'}-field")
    extra = [fields.id] + ([fields.domain] if fields.domain else ["domain", "source"])
    return [col] + [c for c in dict.fromkeys(extra) if c in names and c != col]


def count(path: Path, fields: Fields) -> int | None:
    """Rows in the file, from its footer; CorpusError when the field is not a column."""
    pf = _open(Path(path))
    _columns(pf, fields, Path(path))
    return pf.metadata.num_rows


def read(path: Path, fields: Fields, start: int = 0, end: int | None = None,
         batch: int = 4096) -> Iterator[Documents]:
    path = Path(path)
    pf = _open(path)
    cols = _columns(pf, fields, path)
    end = pf.metadata.num_rows if end is None else end
    groups, row, first = [], 0, None
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if row + n > start and row < end:
            first = row if first is None else first
            groups.append(g)
        row += n
    if end > row:
        raise CorpusError(f"{path}: records {max(start, row)}..{end - 1} asked for, the file "
                          f"holds {row} (changed since it was counted)")
    if not groups:
        return
    at = first
    try:
        for rb in pf.iter_batches(batch_size=batch, row_groups=groups, columns=cols,
                                  use_threads=False):
            lo, hi = max(start - at, 0), min(end - at, rb.num_rows)
            if lo < hi:
                yield arrow_documents(rb.slice(lo, hi - lo), fields, str(path), at + lo)
            at += rb.num_rows
            if at >= end:
                return
    except CorpusError:
        raise
    except Exception as exc:
        raise CorpusError(f"{path} record {at}: unreadable ({str(exc).splitlines()[0]})"
                          ) from None
