"""Readers of the corpus formats people train on, one module per format, behind one contract.

A reader turns one file (or one shard of a dataset directory) into batches of `Documents`:
each document's text or token ids, its own id (`doc_id`, as the corpus names it) and its
domain, in file order. The manifest job (tally.pipeline.manifest) hashes them under the run's
content basis (tally.pipeline.text) and numbers them in the corpus' global order: files sorted
by name within each split (train first), records in file order.

Formats (module: what it reads):
- jsonl: Dolma-style JSON lines, plain or compressed (.jsonl, .json, .jsonl.gz, .json.gz,
  .jsonl.zst, .json.zst)
- parquet_text: Parquet with a text column, or a token column of another name (`input_ids`)
- hf_arrow: a Hugging Face `datasets` directory written by `save_to_disk` (Arrow files)
- tf_example: ArrayRecord files of serialized `tf.train.Example` (MaxText's default input)
- mds: MosaicML Streaming shards (a directory with `index.json`)
Tally's own token shards (TLY1 ArrayRecord, Parquet `tokens`) and OLMo mixes stay in
tally.pipeline.corpus / tally.pipeline.olmo.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # not at run time: `tally --help` builds its parser from FORMATS, and numpy
    import numpy as np  # would add 0.1 s to every command's start


@dataclass(frozen=True)
class Fields:
    """Which field of a record holds what (the `tally manifest` flags of the same names).
    `tokens` set: the records hold token ids there (no tokenizer); else text in `text`.
    `id` / `domain`: absent fields give a null doc_id / the domain "default"."""

    text: str = "text"
    tokens: str | None = None
    id: str = "id"
    domain: str | None = None  # None: `domain` if the record has it, else Dolma's `source`


@dataclass
class Documents:
    """One batch of documents read from a file, in file order."""

    start: int  # the first document's index in its file
    doc_id: list[str | None]
    domain: list[str]
    text: list[str] | None = None  # text corpora
    tokens: tuple[np.ndarray, np.ndarray] | None = None  # (flat int32 ids, offsets of n + 1)

    def __len__(self) -> int:
        return len(self.doc_id)


class Format(Protocol):
    """What each format module provides (module-level functions, not a class)."""

    NAME: str

    def matches(self, path: Path) -> bool:
        """The file (or directory) is in this format, by its name or layout."""

    def count(self, path: Path, fields: Fields) -> int | None:
        """Records in the file, from its metadata; None when only reading it tells
        (a compressed JSON lines file)."""

    def read(self, path: Path, fields: Fields, start: int = 0, end: int | None = None,
             batch: int = 4096) -> Iterator[Documents]:
        """Documents [start, end) of the file (end None: to the end), `batch` at a time.
        CorpusError naming the file and the record for a record that cannot be read."""


# The registry: one module per format, in the order auto-detection tries them (a file's name
# decides, so the order matters only for a directory a format recognises by its layout). A new
# format is one line here and one module beside this file. A module may also define
# `shards(root) -> list[tuple[Path, str]]`: the files of a dataset directory it recognises
# (matches(root)) in the corpus' global order, each with its split ('train' | 'heldout');
# without it, a directory's files are sorted by path, held out when their name starts with
# `heldout`.
FORMATS: tuple[str, ...] = (
    "jsonl",
    "parquet_text",
    "hf_arrow",
    "tf_example",
    "mds",
)


def module(name: str) -> Format:
    """The module of format `name` (CorpusError, in one line, for an unknown one)."""
    import importlib

    from tally.audit.core.errors import CorpusError

    if name not in FORMATS:
        raise CorpusError(f"unknown corpus format {name!r}: expected one of {', '.join(FORMATS)}")
    return importlib.import_module(f"{__name__}.{name}")  # type: ignore[return-value]


def detect(path: Path) -> Format | None:
    """The first registered format whose `matches` takes the file (or directory)."""
    for name in FORMATS:
        mod = module(name)
        if mod.matches(path):
            return mod
    return None
