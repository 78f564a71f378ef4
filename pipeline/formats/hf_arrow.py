"""Hugging Face `datasets` directories written by `Dataset.save_to_disk` or
`DatasetDict.save_to_disk`.

On-disk contract (datasets' `arrow_dataset.py` / `dataset_dict.py`, checked on 5.0.1):
- a `Dataset` directory holds `state.json` (its `_data_files` list the shards in order:
  `data-00000-of-0000N.arrow`, ...), `dataset_info.json` (features), and the shards, each an
  Arrow IPC *stream* file (no footer, so a shard's row count is found by walking its batches);
- a `DatasetDict` directory holds `dataset_dict.json` (`{"splits": [...]}`) and one `Dataset`
  directory per split.
`save_to_disk` writes the rows a dataset shows: after `select` / `shuffle` / `filter` it
writes each shard by iterating the dataset through its indices mapping (checked on 5.0.1), so
the saved shards hold the rows in the dataset's order and no indices file. datasets 1.x instead
saved `indices.arrow` and listed it in state.json's `_indices_data_files`; such a directory is
refused in one line (re-save it with a current `datasets`) rather than read in storage order,
which would give every record the wrong key.

Read with pyarrow directly, memory-mapped, not with `datasets`: a manifest worker then needs
neither `datasets` nor its dependencies (fsspec, huggingface_hub, multiprocess, pandas), and a
range of records costs only the pages its batches touch (batches before the range are skipped
by their row counts, without touching their data).

Splits: `train` is the train split, every other split is held out (train first, then the
others by name); a bare `Dataset` directory is train. The unit a job reads is one shard file;
`shards(root)` lists them in the corpus' global order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tally.audit.core.errors import CorpusError
from tally.audit.core.hashing import TOKEN_DTYPE
from tally.pipeline.formats import Documents, Fields

NAME = "hf_arrow"
STATE, DATASET_DICT = "state.json", "dataset_dict.json"
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # Arrow IPC end-of-stream: continuation, length 0


def _is_dataset_dir(path: Path) -> bool:
    return (path / STATE).is_file() or (path / DATASET_DICT).is_file()


def matches(path: Path) -> bool:
    """A `save_to_disk` directory, or one of its `.arrow` shards."""
    path = Path(path)
    if path.is_dir():
        return _is_dataset_dir(path)
    return path.suffix == ".arrow" and (path.parent / STATE).is_file()


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorpusError(f"{path}: unreadable ({exc})") from None


def _split_files(split_dir: Path) -> list[Path]:
    state = _load_json(split_dir / STATE)
    if state.get("_indices_data_files"):
        raise CorpusError(f"{split_dir}: saved with an indices mapping (`_indices_data_files` in "
                          "state.json, datasets 1.x); its shards are not in the dataset's "
                          "order: load it with `datasets` and save_to_disk it again (current "
                          "versions write the rows in order)")
    try:
        names = [entry["filename"] for entry in state["_data_files"]]
    except (KeyError, TypeError):
        raise CorpusError(f"{split_dir / STATE}: no `_data_files` list of shards") from None
    files = [split_dir / n for n in names]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise CorpusError(f"{missing[0]}: listed in {split_dir / STATE} but missing")
    return files


def shards(root: Path) -> list[tuple[Path, str]]:
    """The dataset's shard files in the corpus' global order, each with its split
    ('train' | 'heldout'): the `train` split's shards in state.json's order (their names, which
    are numbered), then the other splits' by split name."""
    root = Path(root)
    if (root / STATE).is_file():
        return [(f, "train") for f in _split_files(root)]
    if not (root / DATASET_DICT).is_file():
        raise CorpusError(f"{root}: not a Hugging Face dataset directory (no {STATE} or "
                          f"{DATASET_DICT})")
    splits = _load_json(root / DATASET_DICT).get("splits")
    if not isinstance(splits, list) or not splits:
        raise CorpusError(f"{root / DATASET_DICT}: no `splits` list")
    out = []
    for split in sorted(splits, key=lambda s: (s != "train", s)):
        if not (root / split / STATE).is_file():
            raise CorpusError(f"{root / split}: split {split!r} listed in {DATASET_DICT} but "
                              f"has no {STATE}")
        out += [(f, "train" if split == "train" else "heldout")
                for f in _split_files(root / split)]
    return out


def _batches(path: Path) -> Iterator[pa.RecordBatch]:
    """The file's record batches, memory-mapped (datasets writes IPC streams; an IPC file,
    `ARROW1` magic, is read too)."""
    try:
        source = pa.memory_map(str(path))
        if source.read(6) == b"ARROW1":
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
            return
        # A stream cut at a batch boundary reads as a shorter stream without an error, so
        # the end-of-stream marker that a closed writer leaves (datasets' ArrowWriter closes
        # every shard) is checked first: a shard without it lost its tail.
        size = source.size()
        source.seek(max(size - 8, 0))
        if source.read(8) != _EOS:
            raise CorpusError(f"{path}: truncated Arrow stream (no end-of-stream marker: the "
                              "file lost its tail, or its writer did not close it)")
        source.seek(0)
        yield from pa.ipc.open_stream(source)
    except pa.ArrowException as exc:  # ArrowInvalid, ArrowIOError, ...
        raise CorpusError(f"{path}: unreadable Arrow file ({str(exc).splitlines()[0]})"
                          ) from None


def count(path: Path, fields: Fields) -> int | None:
    """Rows in the shard: the sum of its batches' row counts (a stream has no footer; the
    memory-mapped walk reads only the batches' headers). CorpusError when the field is not a
    column, so a wrong --text-field stops the job before it starts."""
    rows = 0
    for b in _batches(Path(path)):
        if not rows:
            _check_columns(b.schema, fields, Path(path), 0)
        rows += b.num_rows
    return rows


def read(path: Path, fields: Fields, start: int = 0, end: int | None = None,
         batch: int = 4096) -> Iterator[Documents]:
    path = Path(path)
    row = 0  # the file index of the current Arrow batch's first row
    checked = False
    for rb in _batches(path):
        if end is not None and row >= end:
            return
        n = rb.num_rows
        lo, hi = max(start - row, 0), n if end is None else min(end - row, n)
        if lo < hi:
            if not checked:
                _check_columns(rb.schema, fields, path, row + lo)
                checked = True
            for b in range(lo, hi, batch):
                part = rb.slice(b, min(batch, hi - b))
                yield arrow_documents(part, fields, str(path), row + b)
        row += n
    if end is not None and end > row:
        raise CorpusError(f"{path}: records {max(start, row)}..{end - 1} asked for, the file "
                          f"holds {row} (truncated or changed since it was counted)")


def _check_columns(schema: pa.Schema, fields: Fields, path: Path, first: int) -> None:
    col = fields.tokens or fields.text
    if col not in schema.names:
        what = "token" if fields.tokens else "text"
        raise CorpusError(f"{path} record {first}: no {what} field {col!r} (the file's columns: "
                          f"{', '.join(schema.names)}); name it with "
                          f"--{'tokens' if fields.tokens else 'text'}-field")


def _domain_column(batch: pa.RecordBatch, fields: Fields) -> str | None:
    if fields.domain is not None:
        return fields.domain if fields.domain in batch.schema.names else None
    return next((c for c in ("domain", "source") if c in batch.schema.names), None)


def _strings(arr: pa.Array) -> list:
    """A scalar column's values as str (ints and the like by their str), nulls as None."""
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return arr.to_pylist()
    if pa.types.is_dictionary(arr.type):
        return _strings(arr.cast(arr.type.value_type))
    return [None if v is None else str(v) for v in arr.to_pylist()]


def arrow_documents(batch: pa.RecordBatch | pa.Table, fields: Fields, where: str,
                    start: int) -> Documents:
    """The documents of Arrow rows whose first is record `start` of the file `where`: text (a
    string column) or token ids (a list column of any integer type), doc_id and domain."""
    names = batch.schema.names
    n = batch.num_rows
    doc_id = _strings(batch.column(fields.id)) if fields.id in names else [None] * n
    dcol = _domain_column(batch, fields)
    domain = ([d if d is not None else "default" for d in _strings(batch.column(dcol))]
              if dcol is not None else ["default"] * n)
    if fields.tokens:
        return Documents(start, doc_id, domain,
                         tokens=token_lists(batch.column(fields.tokens), where, start,
                                            fields.tokens))
    col = batch.column(fields.text)
    if pa.types.is_large_string(col.type) or pa.types.is_string(col.type):
        text = col.to_pylist()
    elif pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
        text = []
        for i, v in enumerate(col.to_pylist()):
            try:
                text.append(None if v is None else v.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise CorpusError(f"{where} record {start + i}: text field {fields.text!r} is "
                                  f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    else:
        raise CorpusError(f"{where} record {start}: text field {fields.text!r} is {col.type}, "
                          "expected a string (for token ids, name the column with "
                          "--tokens-field)")
    if col.null_count:
        bad = start + next(i for i, t in enumerate(text) if t is None)
        raise CorpusError(f"{where} record {bad}: text field {fields.text!r} is null")
    return Documents(start, doc_id, domain, text=text)


def token_lists(arr: pa.Array | pa.ChunkedArray, where: str, start: int, name: str
                ) -> tuple[np.ndarray, np.ndarray]:
    """(flat int32 ids, offsets of n + 1) of a list column of integers (list, large_list or
    fixed_size_list of any integer width; ids must fit int32, as the loop hashes int32)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
            ) or not pa.types.is_integer(t.value_type):
        raise CorpusError(f"{where} record {start}: token field {name!r} is {t}, expected a "
                          "list of integers")
    if arr.null_count:
        bad = start + int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise CorpusError(f"{where} record {bad}: token field {name!r} is null")
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.zeros(len(arr) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False)
    if values.dtype != TOKEN_DTYPE:
        if values.size and (int(values.min()) < -(2**31) or int(values.max()) >= 2**31):
            bad = int(np.searchsorted(offsets, int(np.flatnonzero(
                (values < -(2**31)) | (values >= 2**31))[0]), side="right")) - 1
            raise CorpusError(f"{where} record {start + bad}: token ids in {name!r} do not fit "
                              "in int32")
        values = values.astype(TOKEN_DTYPE)
    return values, offsets
