"""The manifest job over text corpora (Dolma JSON lines plain/gzip/zstd, Parquet text, Parquet
token ids): its hashes equal what a loop computes of the same documents with the same tokenizer
and settings (tests/text_corpus.py, the `tokenizers` library directly), records are keyed in
the documented order, doc_id is kept, and bad input is one line naming the file and the record.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tally.audit.core.hashing import content_hash
from tally.pipeline.corpus import CorpusError
from tally.pipeline.manifest import build_manifest
from tally.pipeline.manifest_file import (
    LEGACY_SCHEMA,
    MANIFEST_SCHEMA,
    ManifestDomains,
    manifest_info,
    manifest_metadata,
)
from tally.pipeline.runners import RunnerSpec
from tally.pipeline.text import ContentBasis
from tests.support.cli import tally
from tests.support.text_corpus import documents, loop_hashes, train_tokenizer, write_jsonl

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def _dolma(root: Path, suffix: str) -> list[tuple[str, list[dict], str]]:
    """Two train files and a held-out one, written out of name order; returned in the
    documented global order (train files by name, then held out)."""
    files = [("b" + suffix, documents(23, 2, prefix="b"), "train"),
             ("heldout-0" + suffix, documents(9, 3, prefix="h"), "heldout"),
             ("a" + suffix, documents(31, 1, prefix="a"), "train")]
    for name, docs, _ in files:
        write_jsonl(root / name, docs)
    return sorted(files, key=lambda f: (f[2] != "train", f[0]))


def _expected(files, tokenizer=None, **settings) -> pa.Table:
    """The manifest a loop's view of the same documents implies, computed without the job."""
    rows = {n: [] for n in MANIFEST_SCHEMA.names}
    for name, docs, split in files:
        hashes, lengths = loop_hashes([d["text"] for d in docs], tokenizer, **settings)
        for i, d in enumerate(docs):
            rows["record_key"].append(len(rows["record_key"]))
            rows["content_hash"].append(hashes[i])
            rows["n_tokens"].append(lengths[i])
            rows["domain"].append(d["source"])
            rows["split"].append(split)
            rows["source"].append(name)
            rows["source_index"].append(i)
            rows["doc_id"].append(d["id"])
    return pa.table(rows, schema=MANIFEST_SCHEMA)


def _table(path: Path) -> pa.Table:
    return pq.read_table(path).replace_schema_metadata(None)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".json.zst"])
def test_jsonl_manifest_hashes_what_the_loop_hashes(tmp_path, tokenizer, suffix):
    files = _dolma(tmp_path / "c", suffix)
    settings = dict(eos_id=1, special_tokens=suffix == ".json.zst", max_tokens=120)
    s = build_manifest(tmp_path / "c", tmp_path / "m.parquet", tokenizer=tokenizer,
                       chunk_records=10, **settings)
    assert _table(tmp_path / "m.parquet").equals(_expected(files, tokenizer, **settings))
    info = manifest_info(tmp_path / "m.parquet")
    assert (info["records"], info["train_records"], info["format"]) == ("63", "54", "jsonl")
    basis = ContentBasis.from_json(info["content_basis"])
    assert (basis.kind, basis.eos_id, basis.max_tokens) == ("tokens", 1, 120)
    assert s.basis == basis and f"content hashes over {basis.describe()}" in s.line()
    # Some documents are longer than the limit: the limit was applied, not ignored.
    assert max(pq.read_table(tmp_path / "m.parquet")["n_tokens"].to_pylist()) == 120


def test_jsonl_on_dask_equals_the_fnapi_runner(tmp_path, tokenizer):
    # A plain file is read in ranges, a compressed one whole: both, on the two runners the
    # manifest tests use, give the same manifest.
    _dolma(tmp_path / "c", ".jsonl.gz")
    write_jsonl(tmp_path / "c" / "c.jsonl", documents(17, 5, prefix="c"))
    ref = build_manifest(tmp_path / "c", tmp_path / "ref.parquet", tokenizer=tokenizer,
                         chunk_records=6)
    s = build_manifest(tmp_path / "c", tmp_path / "dask.parquet", tokenizer=tokenizer,
                       chunk_records=6, runner=RunnerSpec("dask", workers=2))
    assert s.fingerprint == ref.fingerprint
    assert _table(tmp_path / "dask.parquet").equals(_table(tmp_path / "ref.parquet"))
    keys = pq.read_table(tmp_path / "ref.parquet", columns=["source", "record_key"])
    assert keys["source"].unique().to_pylist() == ["a.jsonl.gz", "b.jsonl.gz", "c.jsonl",
                                                   "heldout-0.jsonl.gz"]
    assert keys["record_key"].to_pylist() == list(range(31 + 23 + 17 + 9))


def test_without_a_tokenizer_the_manifest_hashes_bytes(tmp_path):
    files = _dolma(tmp_path / "c", ".jsonl")
    s = build_manifest(tmp_path / "c", tmp_path / "m.parquet", chunk_records=8)
    assert _table(tmp_path / "m.parquet").equals(_expected(files))
    assert ContentBasis.from_json(manifest_info(tmp_path / "m.parquet")["content_basis"]).kind \
        == "bytes"
    assert "bytes of text" in s.line() and "UTF-8 bytes" in s.line()


def test_parquet_text_column_read_by_row_group_ranges(tmp_path, tokenizer):
    docs = documents(40, 7, prefix="p")
    root = tmp_path / "c"
    root.mkdir()
    for k, part in enumerate([docs[:25], docs[25:]]):
        pq.write_table(pa.table({"id": [d["id"] for d in part], "text": [d["text"] for d in part],
                                 "source": [d["source"] for d in part]}),
                       root / f"part-{k}.parquet", row_group_size=7)
    settings = dict(bos_id=0, eos_id=1)
    build_manifest(root, tmp_path / "m.parquet", tokenizer=tokenizer, chunk_records=5,
                   **settings)
    want = _expected([("part-0.parquet", docs[:25], "train"),
                      ("part-1.parquet", docs[25:], "train")], tokenizer, **settings)
    assert _table(tmp_path / "m.parquet").equals(want)


def test_parquet_input_ids_through_the_cli(tmp_path):
    # Today's Tally Parquet wants a column named exactly `tokens`; `input_ids` of any integer
    # list type is read with --tokens-field, and hashed as the loop hashes the ids.
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, 70_000, rng.integers(1, 50)).tolist() for _ in range(30)]
    root = tmp_path / "c"
    root.mkdir()
    pq.write_table(pa.table({"input_ids": pa.array(ids[:20], pa.list_(pa.int64())),
                             "doc": [f"d{i}" for i in range(20)]}), root / "a.parquet",
                   row_group_size=6)
    pq.write_table(pa.table({"input_ids": pa.array(ids[20:], pa.large_list(pa.uint32())),
                             "doc": [f"d{i}" for i in range(20, 30)]}),
                   root / "heldout.parquet")
    r = tally("manifest", str(root), "-o", str(tmp_path / "m.parquet"), "--tokens-field",
              "input_ids", "--id-field", "doc", "--chunk-records", "7", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["records"] == 30 and out["train_records"] == 20
    assert out["content_basis"]["kind"] == "token_ids"
    t = pq.read_table(tmp_path / "m.parquet")
    assert t["content_hash"].to_pylist() == [content_hash(x) for x in ids]
    assert t["n_tokens"].to_pylist() == [len(x) for x in ids]
    assert t["doc_id"].to_pylist() == [f"d{i}" for i in range(30)]
    assert t["split"].to_pylist() == ["train"] * 20 + ["heldout"] * 10
    # A tokenizer does not apply to token ids: said in one line.
    r = tally("manifest", str(root), "-o", str(tmp_path / "m2.parquet"), "--tokens-field",
              "input_ids", "--eos-id", "1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "hashed as they are" in r.stderr and not (tmp_path / "m2.parquet").exists()


def test_a_manifest_without_doc_id_is_still_read(tmp_path):
    # Manifests written before doc_id existed: every reader of manifests takes them.
    n = 5
    t = pa.table({"record_key": np.arange(n), "content_hash": np.arange(n, dtype=np.uint64),
                  "n_tokens": np.full(n, 3, np.int32), "domain": ["web"] * n,
                  "split": ["train"] * 4 + ["heldout"], "source": ["s"] * n,
                  "source_index": np.arange(n)}, schema=LEGACY_SCHEMA)
    t = t.replace_schema_metadata(manifest_metadata("f", n, 4))
    pq.write_table(t, tmp_path / "old.parquet")
    assert manifest_info(tmp_path / "old.parquet")["train_records"] == "4"
    assert ManifestDomains.load(tmp_path / "old.parquet").train_records == 4


def _bad(root: Path, tmp_path: Path, case: str) -> tuple[list[str], str]:
    """A corpus with one bad thing; the extra CLI args and the error the CLI must print."""
    good = documents(12, 9)
    write_jsonl(root / "a.jsonl", good[:4])
    if case == "truncated_gz":
        data = gzip.compress("".join(json.dumps(d) + "\n" for d in good).encode())
        (root / "b.jsonl.gz").write_bytes(data[: len(data) * 2 // 3])
        return [], rf"{root / 'b.jsonl.gz'} line \d+ \(record \d+\): truncated gzip stream"
    if case == "corrupt_zst":
        p = write_jsonl(root / "b.jsonl.zst", good)
        data = bytearray(p.read_bytes())
        data[len(data) // 2: len(data) // 2 + 16] = b"\xff" * 16
        p.write_bytes(bytes(data))
        return [], rf"{root / 'b.jsonl.zst'} line \d+ \(record \d+\): corrupt zstd data"
    if case == "not_json":
        lines = [json.dumps(d) for d in good[:5]]
        lines[3] = lines[3][:-7]
        (root / "b.jsonl").write_text("\n".join(lines) + "\n")
        return [], rf"{root / 'b.jsonl'} line 4 \(record 3\): not JSON"
    if case == "no_text":
        write_jsonl(root / "b.jsonl.gz", good[:3] + [{"id": "x", "body": "hi"}])
        return [], (rf"{root / 'b.jsonl.gz'} line 4 \(record 3\): no text field 'text' "
                    r"\(the record's fields: id, body")
    assert case == "bad_tokenizer"
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"')
    return (["--tokenizer", str(tmp_path / "tokenizer.json")],
            rf"tokenizer {tmp_path / 'tokenizer.json'}: does not load")


@pytest.mark.parametrize("case", ["truncated_gz", "corrupt_zst", "not_json", "no_text",
                                  "bad_tokenizer"])
def test_bad_input_is_one_line_and_no_manifest(tmp_path, case):
    root = tmp_path / "c"
    root.mkdir()
    extra, message = _bad(root, tmp_path, case)
    out = tmp_path / "m.parquet"
    r = tally("manifest", str(root), "-o", str(out), "-q", *extra)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if not x.startswith("WARNING:root:apitools")]
    assert len(lines) == 1 and lines[0].startswith("tally: error: "), r.stderr
    import re

    assert re.search(message, lines[0]), lines[0]
    assert not out.exists() and not list(tmp_path.glob(".m.parquet*"))


def test_library_errors_are_corpus_errors(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    write_jsonl(root / "a.jsonl", documents(3))
    (root / "notes.csv").write_text("x\n")
    with pytest.raises(CorpusError, match=r"notes\.csv: in no known format"):
        build_manifest(root, tmp_path / "m.parquet")
    (root / "notes.csv").unlink()
    pq.write_table(pa.table({"text": ["x"]}), root / "b.parquet")
    with pytest.raises(CorpusError, match=r"mixes formats jsonl \(a\.jsonl\) and parquet_text"):
        build_manifest(root, tmp_path / "m.parquet")
    assert not (tmp_path / "m.parquet").exists()


def test_a_single_json_lines_file_named_json_is_read_with_format_jsonl(tmp_path):
    """A lone `*.json` argument is an OLMo mix's index by default: a Dolma file of that name
    gets a one-line error that says what to give, and --format jsonl reads it."""
    path = write_jsonl(tmp_path / "docs.json", documents(5))
    with pytest.raises(CorpusError, match=r"not valid JSON.*give --format jsonl"):
        build_manifest(path, tmp_path / "m.parquet")
    s = build_manifest(path, tmp_path / "m.parquet", fmt="jsonl")
    assert s.records == 5
    assert _table(tmp_path / "m.parquet")["doc_id"].to_pylist() == [f"doc-{i}" for i in range(5)]
