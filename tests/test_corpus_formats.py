"""Corpus formats read by tally.pipeline.formats: Hugging Face `save_to_disk` directories,
ArrayRecord
of tf.train.Example, MosaicML Streaming MDS. Every file here is written by the format's own
library (`datasets`, `array_record` with Examples serialized by the `tfrecord` package's
example_pb2, `streaming`'s MDSWriter), never by Tally's readers' code."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tally.audit.core.errors import CorpusError
from tally.pipeline.formats import Fields, hf_arrow, mds, tf_example
from tests.support.cli import tally
from tests.support.text_corpus import documents, loop_hashes, train_tokenizer


def read_all(fmt, files: list[Path], fields: Fields, batch: int = 4096) -> list[dict]:
    """Every document of the files, in order: {id, domain, text | tokens}, with the checks
    that each batch starts where the previous one ended."""
    out = []
    for path in files:
        expect = 0
        for d in fmt.read(path, fields, batch=batch):
            assert d.start == expect
            expect += len(d)
            out += _rows(d)
    return out


def _rows(d) -> list[dict]:
    rows = []
    for i in range(len(d)):
        row = {"id": d.doc_id[i], "domain": d.domain[i]}
        if d.text is not None:
            row["text"] = d.text[i]
        else:
            flat, offsets = d.tokens
            assert flat.dtype == np.int32
            row["tokens"] = flat[offsets[i]:offsets[i + 1]].tolist()
        rows.append(row)
    return rows


def _expected(docs: list[dict]) -> list[dict]:
    return [{"id": d["id"], "domain": d["source"], "text": d["text"]} for d in docs]


def _token_docs(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": f"tok-{i}", "source": ("a", "b")[i % 2],
             "input_ids": rng.integers(0, 50_000, rng.integers(1, 40)).tolist()}
            for i in range(n)]


def _ranges(fmt, path: Path, fields: Fields, whole: list[dict]) -> None:
    """Ranged reads [start, end) equal the slices of the whole file, at any batch size."""
    n = len(whole)
    for start, end, batch in ((0, n, 3), (1, n - 1, 4), (n // 2, n // 2 + 1, 1), (3, 3, 2),
                              (0, None, 5), (n - 2, None, 1)):
        got = []
        for d in fmt.read(path, fields, start, end, batch=batch):
            assert len(d) <= batch
            got += _rows(d)
        assert got == whole[start:end], (start, end, batch)


# --- Hugging Face datasets (save_to_disk) -----------------------------------------------------


def test_hf_dataset_reads_documents_in_order(tmp_path, monkeypatch):
    import datasets

    docs = documents(60, seed=3)
    # Several Arrow batches per shard (datasets writes 1,000 rows a batch by default), so
    # ranged reads cross batch boundaries inside a file.
    monkeypatch.setattr(datasets.config, "DEFAULT_MAX_BATCH_SIZE", 7)
    datasets.Dataset.from_list(docs).save_to_disk(str(tmp_path / "ds"), num_shards=3)
    root = tmp_path / "ds"
    assert hf_arrow.matches(root) and not hf_arrow.matches(tmp_path)
    files = hf_arrow.shards(root)
    assert [f.name for f, _ in files] == [f"data-0000{i}-of-00003.arrow" for i in range(3)]
    assert {s for _, s in files} == {"train"}
    assert all(hf_arrow.matches(f) for f, _ in files)
    fields = Fields()
    assert sum(hf_arrow.count(f, fields) for f, _ in files) == 60
    assert read_all(hf_arrow, [f for f, _ in files], fields, batch=4) == _expected(docs)
    first = files[0][0]
    _ranges(hf_arrow, first, fields, read_all(hf_arrow, [first], fields))


def test_hf_dataset_dict_splits_and_token_column(tmp_path):
    import datasets

    feats = datasets.Features({"id": datasets.Value("string"),
                               "source": datasets.Value("string"),
                               "input_ids": datasets.Sequence(datasets.Value("int32"))})
    train, val, test = _token_docs(30, 1), _token_docs(8, 2), _token_docs(5, 3)
    dd = datasets.DatasetDict({
        "validation": datasets.Dataset.from_list(val, features=feats),
        "train": datasets.Dataset.from_list(train, features=feats),
        # int64 ids (datasets' default for a list of Python ints) are read as int32 too
        "test": datasets.Dataset.from_list(test)})
    dd.save_to_disk(str(tmp_path / "dd"))
    files = hf_arrow.shards(tmp_path / "dd")
    assert [(f.parent.name, s) for f, s in files] == [
        ("train", "train"), ("test", "heldout"), ("validation", "heldout")]
    fields = Fields(tokens="input_ids")
    got = read_all(hf_arrow, [f for f, _ in files], fields)
    assert got == [{"id": d["id"], "domain": d["source"], "tokens": d["input_ids"]}
                   for d in train + test + val]


def test_hf_dataset_saved_after_shuffle_and_select_is_read_in_its_order(tmp_path):
    import datasets

    docs = documents(40, seed=5)
    view = datasets.Dataset.from_list(docs).shuffle(seed=7).select(range(5, 25))
    assert view._indices is not None  # an indices mapping in memory ...
    view.save_to_disk(str(tmp_path / "v"))
    state = json.loads((tmp_path / "v" / "state.json").read_text())
    assert not state.get("_indices_data_files")  # ... that save_to_disk flattens
    got = read_all(hf_arrow, [f for f, _ in hf_arrow.shards(tmp_path / "v")], Fields())
    assert [g["id"] for g in got] == view["id"]
    assert [g["text"] for g in got] == view["text"]
    # A directory saved with its mapping (datasets 1.x) is refused, not read in storage order.
    state["_indices_data_files"] = [{"filename": "indices.arrow"}]
    (tmp_path / "v" / "state.json").write_text(json.dumps(state))
    with pytest.raises(CorpusError, match=r"v: saved with an indices mapping"):
        hf_arrow.shards(tmp_path / "v")


def test_hf_bad_input_names_file_and_record(tmp_path):
    import datasets

    docs = documents(30, seed=2)
    datasets.Dataset.from_list(docs).save_to_disk(str(tmp_path / "ds"))
    (path, _), = hf_arrow.shards(tmp_path / "ds")
    with pytest.raises(CorpusError, match=rf"{path} record 0: no text field 'body' .*"
                                          r"columns: id, text, source, metadata"):
        list(hf_arrow.read(path, Fields(text="body")))
    with pytest.raises(CorpusError, match=rf"{path} record 0: no text field 'body'"):
        hf_arrow.count(path, Fields(text="body"))  # before the job starts
    with pytest.raises(CorpusError, match=rf"{path} record 0: token field 'text' is string"):
        list(hf_arrow.read(path, Fields(tokens="text")))
    # A document whose text is null
    rows = [dict(d) for d in docs]
    rows[4]["text"] = None
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "nulls"))
    (nulls, _), = hf_arrow.shards(tmp_path / "nulls")
    with pytest.raises(CorpusError, match=rf"{nulls} record 4: text field 'text' is null"):
        list(hf_arrow.read(nulls, Fields()))
    # Truncated: mid-batch, and cut exactly at the end-of-stream marker
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 8):
        path.write_bytes(data[:cut])
        with pytest.raises(CorpusError, match=rf"{path}: .*truncated"):
            hf_arrow.count(path, Fields())
        with pytest.raises(CorpusError, match=rf"{path}: .*truncated"):
            list(hf_arrow.read(path, Fields()))
    path.unlink()
    with pytest.raises(CorpusError, match=rf"{path}: listed in .*state.json but missing"):
        hf_arrow.shards(tmp_path / "ds")


# --- ArrayRecord of tf.train.Example ----------------------------------------------------------


def _write_examples(path: Path, records: list[bytes]) -> Path:
    from array_record.python.array_record_module import ArrayRecordWriter

    w = ArrayRecordWriter(str(path), "group_size:4")
    for r in records:
        w.write(r)
    w.close()
    return path


def _example(features: dict) -> bytes:
    """A tf.train.Example serialized by the tfrecord package's example_pb2 (generated from
    TensorFlow's example.proto; independent of the reader's descriptor)."""
    example_pb2 = import_skipping_package_init("tfrecord.example_pb2", ("tfrecord",))
    feats = {}
    for k, v in features.items():
        if isinstance(v, str):
            feats[k] = example_pb2.Feature(bytes_list=example_pb2.BytesList(value=[v.encode()]))
        elif isinstance(v, bytes):
            feats[k] = example_pb2.Feature(bytes_list=example_pb2.BytesList(value=[v]))
        else:
            feats[k] = example_pb2.Feature(int64_list=example_pb2.Int64List(value=list(v)))
    return example_pb2.Example(features=example_pb2.Features(feature=feats)).SerializeToString()


def test_tf_example_text_and_tokens(tmp_path):
    from tally.pipeline.corpus import encode_record

    docs = documents(45, seed=4)
    a = _write_examples(tmp_path / "text.array_record-00000-of-00002",
                        [_example({"text": d["text"], "id": d["id"], "source": d["source"]})
                         for d in docs[:30]])
    b = _write_examples(tmp_path / "text.array_record-00001-of-00002",
                        [_example({"text": d["text"], "id": d["id"], "source": d["source"]})
                         for d in docs[30:]])
    tally = _write_examples(tmp_path / "tally.array_record",
                            [encode_record(np.arange(5), "web")])
    assert tf_example.matches(a) and tf_example.matches(b) and not tf_example.matches(tally)
    fields = Fields()
    assert (tf_example.count(a, fields), tf_example.count(b, fields)) == (30, 15)
    assert read_all(tf_example, [a, b], fields, batch=7) == _expected(docs)
    _ranges(tf_example, a, fields, _expected(docs[:30]))

    toks = _token_docs(20)
    t = _write_examples(tmp_path / "tokens.array_record",
                        [_example({"input_ids": d["input_ids"], "doc": d["id"],
                                   "domain": d["source"]}) for d in toks])
    got = read_all(tf_example, [t], Fields(tokens="input_ids", id="doc"))
    assert got == [{"id": d["id"], "domain": d["source"], "tokens": d["input_ids"]}
                   for d in toks]


def test_tf_example_bad_input_names_file_and_record(tmp_path):
    docs = documents(12, seed=6)
    good = [_example({"text": d["text"], "id": d["id"]}) for d in docs]
    junk = _write_examples(tmp_path / "junk.array_record", good[:5] + [b"\xff\xfe not proto"])
    assert tf_example.matches(junk)
    with pytest.raises(CorpusError, match=rf"{junk} record 5: not a serialized tf.train.Example"):
        list(tf_example.read(junk, Fields()))
    # Records 0..4 read before the bad one, when the range stops short of it
    assert len(read_all_range(junk, 0, 5)) == 5
    lacking = _write_examples(tmp_path / "lacking.array_record",
                              good[:3] + [_example({"body": "x", "id": "d3"})])
    with pytest.raises(CorpusError, match=rf"{lacking} record 3: no text feature 'text' "
                                          r"\(the record's features: body, id\)"):
        list(tf_example.read(lacking, Fields()))
    with pytest.raises(CorpusError, match=rf"{lacking} record 0: token feature 'text' is a "
                                          "bytes_list"):
        list(tf_example.read(lacking, Fields(tokens="text")))
    bad_utf8 = _write_examples(tmp_path / "latin.array_record", [_example({"text": b"caf\xe9"})])
    with pytest.raises(CorpusError, match=rf"{bad_utf8} record 0: text feature 'text' is not "
                                          "UTF-8"):
        list(tf_example.read(bad_utf8, Fields()))
    # Truncated file: its footer (the record index) is gone
    whole = _write_examples(tmp_path / "whole.array_record", good)
    whole.write_bytes(whole.read_bytes()[:-40])
    with pytest.raises(CorpusError, match=rf"{whole}: unreadable ArrayRecord file"):
        tf_example.count(whole, Fields())


def read_all_range(path: Path, start: int, end: int) -> list[dict]:
    return [r for d in tf_example.read(path, Fields(), start, end) for r in _rows(d)]


# --- MosaicML Streaming MDS -------------------------------------------------------------------


def import_skipping_package_init(module: str, packages: tuple[str, ...]) -> types.ModuleType:
    """The installed `module`, imported without running the `__init__.py` of `packages`.

    `streaming/__init__.py` imports streaming.vision, which imports torchvision, and the PyPI
    torchvision beside this venv's CPU torch 2.13.0 wheel fails to import ("operator
    torchvision::nms does not exist"); `tfrecord/__init__.py` imports torch (2.6 s) for a
    generated example_pb2 that needs only protobuf. Registering a bare package module (its
    `__path__` the installed directory) for each of `packages` skips their eager imports; the
    module itself, and what it imports, run unmodified from the installed package.
    """
    top = packages[0]
    root = Path(sys.modules[top].__path__[0]) if top in sys.modules else Path(
        list(importlib.util.find_spec(top).submodule_search_locations)[0])
    for name in packages:
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = package
    return importlib.import_module(module)


@functools.cache
def mds_writer() -> type:
    """streaming's real MDSWriter (streaming.base and streaming.base.format import the dataset
    classes, hence torch, too)."""
    return import_skipping_package_init(
        "streaming.base.format.mds.writer",
        ("streaming", "streaming.base", "streaming.base.format")).MDSWriter


def _write_mds(out: Path, columns: dict, samples: list[dict], **kwargs) -> Path:
    with mds_writer()(columns=columns, out=str(out), **kwargs) as w:
        for s in samples:
            w.write(s)
    return out


@pytest.mark.parametrize("compression", [None, "zstd", "gz"])
def test_mds_text_shards_in_index_order(tmp_path, compression):
    docs = documents(80, seed=7)
    root = _write_mds(tmp_path / "mds", {"id": "str", "text": "str", "source": "str"},
                      docs, compression=compression, size_limit=4096)
    assert mds.matches(root)
    files = mds.shards(root)
    index = json.loads((root / "index.json").read_text())["shards"]
    assert len(files) == len(index) > 2
    assert [f.name for f, _ in files] == [
        (e["zip_data"] or e["raw_data"])["basename"] for e in index]
    if compression:
        assert all(f.name.endswith(f".mds.{compression}") for f, _ in files)
    fields = Fields()
    assert sum(mds.count(f, fields) for f, _ in files) == 80
    assert read_all(mds, [f for f, _ in files], fields, batch=5) == _expected(docs)
    first = files[0][0]
    _ranges(mds, first, fields, read_all(mds, [first], fields))


@pytest.mark.parametrize("encoding,dtype", [("ndarray:int32", np.int32), ("ndarray", np.uint16),
                                            ("ndarray:int64", np.int64)])
def test_mds_token_arrays_and_splits(tmp_path, encoding, dtype):
    toks = _token_docs(30)
    for split, rows in (("train", toks[:20]), ("val", toks[20:])):
        _write_mds(tmp_path / "m" / split, {"input_ids": encoding, "id": "str", "domain": "str"},
                   [{"input_ids": np.asarray(d["input_ids"], dtype), "id": d["id"],
                     "domain": d["source"]} for d in rows], size_limit=1024)
    files = mds.shards(tmp_path / "m")
    assert [(f.parent.name, s) for f, s in files][0] == ("train", "train")
    assert {f.parent.name for f, s in files if s == "heldout"} == {"val"}
    got = read_all(mds, [f for f, _ in files], Fields(tokens="input_ids"))
    assert got == [{"id": d["id"], "domain": d["source"], "tokens": d["input_ids"]}
                   for d in toks]


def test_mds_bad_input_names_file_and_record(tmp_path):
    docs = documents(20, seed=8)
    root = _write_mds(tmp_path / "raw", {"id": "str", "text": "str"}, docs)
    (shard, _), = mds.shards(root)
    with pytest.raises(CorpusError, match=rf"{shard} record 0: no text field 'body' "
                                          r"\(the shard's columns: id, text\)"):
        list(mds.read(shard, Fields(text="body")))
    with pytest.raises(CorpusError, match=rf"{shard} record 0: no text field 'body'"):
        mds.count(shard, Fields(text="body"))  # before the job starts
    with pytest.raises(CorpusError, match=rf"{shard} record 0: token field 'text' is encoded "
                                          "str"):
        list(mds.read(shard, Fields(tokens="text")))
    data = shard.read_bytes()
    shard.write_bytes(data[:-30])
    with pytest.raises(CorpusError, match=rf"{shard} record 19: truncated or corrupt MDS shard"):
        list(mds.read(shard, Fields()))
    shard.write_bytes(data[:6])
    with pytest.raises(CorpusError, match=rf"{shard}: truncated or not an MDS shard"):
        list(mds.read(shard, Fields()))

    zroot = _write_mds(tmp_path / "z", {"id": "str", "text": "str"}, docs, compression="zstd")
    (zshard, _), = mds.shards(zroot)
    zshard.write_bytes(zshard.read_bytes()[:-20])
    with pytest.raises(CorpusError, match=rf"{zshard}: corrupt zstd-compressed MDS shard"):
        list(mds.read(zshard, Fields()))

    pkl = _write_mds(tmp_path / "json", {"id": "str", "text": "json"},
                     [{"id": "a", "text": {"t": "x"}}])
    (pshard, _), = mds.shards(pkl)
    with pytest.raises(CorpusError, match=rf"{pshard} record 0: text field 'text' is encoded "
                                          "json"):
        list(mds.read(pshard, Fields()))


# --- Through `tally manifest` (CLI subprocess): the hashes a loop computes --------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def manifest(tmp_path: Path, corpus: Path, *flags: str) -> pa.Table:
    out = tmp_path / "manifest.parquet"
    res = tally("manifest", corpus, "-o", out, "-q", *flags, timeout=120)
    assert res.returncode == 0, res.stderr
    return pq.read_table(out)


def _check_manifest(table: pa.Table, docs: list[dict], splits: list[str], tokenizer: Path,
                    **settings) -> None:
    hashes, lengths = loop_hashes([d["text"] for d in docs], tokenizer, **settings)
    assert table["record_key"].to_pylist() == list(range(len(docs)))
    assert table["content_hash"].to_pylist() == hashes
    assert table["n_tokens"].to_pylist() == lengths
    assert table["doc_id"].to_pylist() == [d["id"] for d in docs]
    assert table["domain"].to_pylist() == [d["source"] for d in docs]
    assert table["split"].to_pylist() == splits


@pytest.mark.slow
def test_manifest_of_hf_dataset_dict_hashes_as_the_loop(tmp_path, tokenizer):
    import datasets

    docs = documents(40, seed=11)
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(docs[30:]),
                          "train": datasets.Dataset.from_list(docs[:30])}
                         ).save_to_disk(str(tmp_path / "hf"), num_shards={"train": 2,
                                                                          "validation": 1})
    table = manifest(tmp_path, tmp_path / "hf", "--tokenizer", str(tokenizer), "--eos-id", "1")
    _check_manifest(table, docs, ["train"] * 30 + ["heldout"] * 10, tokenizer, eos_id=1)
    assert table["source"].to_pylist()[29:31] == ["train/data-00001-of-00002.arrow",
                                                  "validation/data-00000-of-00001.arrow"]


@pytest.mark.slow
def test_manifest_of_tf_example_array_records_hashes_as_the_loop(tmp_path, tokenizer):
    docs = documents(36, seed=12)
    files = {"heldout-00000.array_record": docs[30:], "train-00000.array_record": docs[:18],
             "train-00001.array_record": docs[18:30]}
    (tmp_path / "c").mkdir()
    for name, part in files.items():
        _write_examples(tmp_path / "c" / name, [_example(
            {"text": d["text"], "id": d["id"], "source": d["source"]}) for d in part])
    table = manifest(tmp_path, tmp_path / "c", "--tokenizer", str(tokenizer))
    _check_manifest(table, docs, ["train"] * 30 + ["heldout"] * 6, tokenizer)


@pytest.mark.slow
def test_manifest_of_compressed_mds_hashes_as_the_loop(tmp_path, tokenizer):
    docs = documents(50, seed=13)
    _write_mds(tmp_path / "mds", {"id": "str", "text": "str", "source": "str"}, docs,
               compression="zstd", size_limit=4096)
    table = manifest(tmp_path, tmp_path / "mds", "--tokenizer", str(tokenizer),
                     "--special-tokens")
    _check_manifest(table, docs, ["train"] * 50, tokenizer, special_tokens=True)
    assert len(set(table["source"].to_pylist())) > 2  # several shards, in index.json's order


@pytest.mark.slow
def test_manifest_names_the_bad_record(tmp_path):
    docs = documents(10, seed=14)
    (tmp_path / "c").mkdir()
    _write_examples(tmp_path / "c" / "a.array_record",
                    [_example({"text": d["text"]}) for d in docs[:6]] + [b"\x00\x01junk"])
    out = tmp_path / "m.parquet"
    res = tally("manifest", tmp_path / "c", "-o", out, "-q", timeout=120)
    assert res.returncode != 0 and not out.exists()
    assert res.stderr.strip().splitlines() == [
        f"tally: error: {tmp_path / 'c' / 'a.array_record'} record 6: not a serialized "
        "tf.train.Example"]
