"""ArrayRecord files of serialized `tf.train.Example` protos (MaxText's default Grain input: a
`text` bytes feature, or token ids in an int64_list feature).

Decoded with the `protobuf` runtime (installed with apache-beam and grain) and a descriptor of
TensorFlow's example.proto (Example, Features, Feature, BytesList, FloatList, Int64List: the
field numbers are TensorFlow's wire contract) built here, in a private descriptor pool so it
cannot clash with another copy of `tensorflow.Example` in the process (TensorFlow's own, or the
`tfrecord` package's). Not with TensorFlow: it is a gigabyte install for a ten-line schema.

Tally's own token shards are ArrayRecord files too (`TLY1` records, tally.pipeline.corpus):
`matches` peeks at the first record, and a file whose records start with the `TLY1` magic is
not this format. Any other ArrayRecord file is read as Examples; a record that does not parse
as one, or lacks the named feature, is a CorpusError naming the file and the record.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tally.audit.core.errors import CorpusError
from tally.audit.core.hashing import TOKEN_DTYPE
from tally.pipeline.formats import Documents, Fields

NAME = "tf_example"
TALLY_MAGIC = b"TLY1"  # tally.pipeline.corpus.MAGIC (not imported: corpus imports this package)


def _is_array_record(path: Path) -> bool:
    # Grain / MaxText name shards `name.array_record` or `name.array_record-00000-of-00010`.
    return path.suffix == ".array_record" or ".array_record-" in path.name


def matches(path: Path) -> bool:
    """An ArrayRecord file whose first record is not a Tally `TLY1` token record."""
    path = Path(path)
    if not path.is_file() or not _is_array_record(path):
        return False
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(str(path))
    except Exception:  # damaged: tally.pipeline.corpus reports it the way it reports its own shards
        return False
    try:
        return reader.ok() and reader.num_records() > 0 and not reader.read(
            [0])[0].startswith(TALLY_MAGIC)
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):  # damaged: tally.pipeline.corpus reports it
            reader.close()


@functools.cache
def example_class() -> Any:
    """The `tensorflow.Example` message class, from a descriptor of example.proto built here."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="tally_tf_example.proto", package="tensorflow",
                                             syntax="proto3")

    def message(name: str, *fields: tuple) -> descriptor_pb2.DescriptorProto:
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name, oneof in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name
            if oneof is not None:
                f.oneof_index = oneof
        return m

    rep, opt = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    message("BytesList", ("value", 1, F.TYPE_BYTES, rep, "", None))
    message("FloatList", ("value", 1, F.TYPE_FLOAT, rep, "", None)).field[0].options.packed = True
    message("Int64List", ("value", 1, F.TYPE_INT64, rep, "", None)).field[0].options.packed = True
    feature = message("Feature",
                      ("bytes_list", 1, F.TYPE_MESSAGE, opt, ".tensorflow.BytesList", 0),
                      ("float_list", 2, F.TYPE_MESSAGE, opt, ".tensorflow.FloatList", 0),
                      ("int64_list", 3, F.TYPE_MESSAGE, opt, ".tensorflow.Int64List", 0))
    feature.oneof_decl.add(name="kind")
    features = message("Features", ("feature", 1, F.TYPE_MESSAGE, rep,
                                    ".tensorflow.Features.FeatureEntry", None))
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=opt)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=opt,
                    type_name=".tensorflow.Feature")
    message("Example", ("features", 1, F.TYPE_MESSAGE, opt, ".tensorflow.Features", None))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


def _reader(path: Path) -> Any:
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(str(path))
        if reader.ok():
            return reader
        # A damaged file opens "not ok" and then counts 0 records without an error (a
        # truncated file would read as empty); its reason is raised by close().
        reader.close()
        exc: Exception = RuntimeError("not an ArrayRecord file")
    except Exception as raised:
        exc = raised
    raise CorpusError(f"{path}: unreadable ArrayRecord file "
                      f"({str(exc).splitlines()[0] if str(exc) else 'not an ArrayRecord file'})")


def count(path: Path, fields: Fields) -> int | None:
    """Records in the file, from the ArrayRecord footer's index."""
    reader = _reader(Path(path))
    try:
        return reader.num_records()
    finally:
        reader.close()


def _scalar(feature: Any, where: str, name: str) -> str:
    """A one-value feature (id, domain) as str: bytes as UTF-8, an int64 by its digits."""
    kind = feature.WhichOneof("kind")
    values = getattr(feature, kind).value if kind else ()
    if len(values) != 1 or kind == "float_list":
        raise CorpusError(f"{where}: feature {name!r} holds {len(values)} {kind or 'values'}, "
                          "expected one bytes or int64 value")
    v = values[0]
    return v.decode("utf-8", errors="replace") if kind == "bytes_list" else str(v)


def read(path: Path, fields: Fields, start: int = 0, end: int | None = None,
         batch: int = 4096) -> Iterator[Documents]:
    path = Path(path)
    example = example_class()
    reader = _reader(path)
    try:
        n = reader.num_records()
        end = n if end is None else end
        if end > n:
            raise CorpusError(f"{path}: records {max(start, n)}..{end - 1} asked for, the file "
                              f"holds {n} (truncated or changed since it was counted)")
        for b in range(start, end, batch):
            try:
                raws = reader.read(b, min(b + batch, end))
            except Exception as exc:
                raise CorpusError(f"{path} records {b}..{min(b + batch, end) - 1}: unreadable "
                                  f"({str(exc).splitlines()[0] if str(exc) else exc!r})"
                                  ) from None
            yield _documents(raws, example, fields, f"{path}", b)
    finally:
        reader.close()


def _documents(raws: list[bytes], example: Any, fields: Fields, path: str, start: int
               ) -> Documents:
    from google.protobuf.message import DecodeError

    n = len(raws)
    doc_id: list[str | None] = [None] * n
    domain = ["default"] * n
    text: list[str] = []
    ids: list[np.ndarray] = []
    col = fields.tokens or fields.text
    domain_names = (fields.domain,) if fields.domain is not None else ("domain", "source")
    ex = example()
    for i, raw in enumerate(raws):
        where = f"{path} record {start + i}"
        if raw.startswith(TALLY_MAGIC):
            raise CorpusError(f"{where}: a Tally token record (TLY1) among tf.train.Examples")
        try:
            ex.ParseFromString(raw)
        except DecodeError:
            raise CorpusError(f"{where}: not a serialized tf.train.Example") from None
        feats = ex.features.feature
        if col not in feats:
            raise CorpusError(f"{where}: no {'token' if fields.tokens else 'text'} feature "
                              f"{col!r} (the record's features: "
                              f"{', '.join(sorted(feats)) or 'none'})")
        f = feats[col]
        kind = f.WhichOneof("kind")
        if fields.tokens:
            if kind != "int64_list":
                raise CorpusError(f"{where}: token feature {col!r} is a {kind}, expected an "
                                  "int64_list")
            v = np.asarray(f.int64_list.value, np.int64)
            if v.size and (int(v.min()) < -(2**31) or int(v.max()) >= 2**31):
                raise CorpusError(f"{where}: token ids in {col!r} do not fit in int32")
            ids.append(v.astype(TOKEN_DTYPE))
        else:
            if kind != "bytes_list" or len(f.bytes_list.value) != 1:
                got = f"{len(f.bytes_list.value)} bytes values" if kind == "bytes_list" else \
                    f"a {kind}"
                raise CorpusError(f"{where}: text feature {col!r} holds {got}, expected one "
                                  "bytes value (for token ids, name the feature with "
                                  "--tokens-field)")
            try:
                text.append(f.bytes_list.value[0].decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise CorpusError(f"{where}: text feature {col!r} is not UTF-8 ({exc.reason} "
                                  f"at byte {exc.start})") from None
        if fields.id in feats:
            doc_id[i] = _scalar(feats[fields.id], where, fields.id)
        for d in domain_names:
            if d in feats:
                domain[i] = _scalar(feats[d], where, d)
                break
    if not fields.tokens:
        return Documents(start, doc_id, domain, text=text)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum([len(x) for x in ids], out=offsets[1:])
    flat = np.concatenate(ids) if ids else np.zeros(0, TOKEN_DTYPE)
    return Documents(start, doc_id, domain, tokens=(flat, offsets))
