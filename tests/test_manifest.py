"""The manifest job on real Beam runners against a reference computed directly with pyarrow."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from tally.pipeline.corpus import CorpusError, encode_record, list_shards
from tally.pipeline.manifest import MANIFEST_SCHEMA, build_manifest, manifest_info
from tally.pipeline.manifest_file import uniform_row_groups
from tally.pipeline.runners import RunnerSpec


@pytest.fixture(scope="module")
def corpus(corpora):
    return corpora.corpus(records=2500, seed=11, shards=3, length_scale=0.2)


def reference(root):
    """Keys, hashes and lengths read record by record, independently of the pipeline code."""
    rows = {n: [] for n in MANIFEST_SCHEMA.names}
    paths = sorted(root.glob("train-*.array_record")) + sorted(root.glob("heldout-*"))
    key = 0
    for p in paths:
        r = ArrayRecordReader(str(p))
        for i, raw in enumerate(r.read(0, r.num_records())):
            dlen = raw[5]
            toks = raw[6 + dlen:]
            rows["record_key"].append(key)
            rows["content_hash"].append(xxhash.xxh3_64_intdigest(toks))
            rows["n_tokens"].append(len(toks) // 4)
            rows["domain"].append(raw[6:6 + dlen].decode())
            rows["split"].append("heldout" if p.name.startswith("heldout") else "train")
            rows["source"].append(p.name)
            rows["source_index"].append(i)
            rows["doc_id"].append(None)
            key += 1
        r.close()
    return pa.table(rows, schema=MANIFEST_SCHEMA)


def _check(out, corpus):
    got = pq.read_table(out)
    assert got.schema.remove_metadata().equals(MANIFEST_SCHEMA)
    assert got.equals(reference(corpus))
    info = manifest_info(out)
    assert info["records"] == "2500" and int(info["train_records"]) == 2450
    return info["manifest_fingerprint"]


def test_manifest_on_fnapi_runner_equals_the_reference(corpus, tmp_path):
    s = build_manifest(corpus, tmp_path / "m.parquet", chunk_records=300)
    fp = _check(tmp_path / "m.parquet", corpus)
    assert s.fingerprint == fp and s.records == 2500
    # The fingerprint does not depend on how the job split the work.
    build_manifest(corpus, tmp_path / "m2.parquet", chunk_records=1000)
    assert manifest_info(tmp_path / "m2.parquet")["manifest_fingerprint"] == fp


def test_row_groups_are_equal_whatever_the_job_split(corpus, tmp_path, monkeypatch):
    # Reconcile cuts its key buckets on row-group boundaries when the groups are equal.
    monkeypatch.setattr("tally.pipeline.manifest.ROW_GROUP_RECORDS", 256)
    build_manifest(corpus, tmp_path / "m.parquet", chunk_records=300)
    _check(tmp_path / "m.parquet", corpus)
    meta = pq.read_metadata(tmp_path / "m.parquet")
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [256] * 9 + [196]
    assert uniform_row_groups(meta) == 256


@pytest.mark.slow
def test_manifest_on_dask_runner_equals_the_reference(corpus, tmp_path):
    build_manifest(corpus, tmp_path / "m.parquet", chunk_records=400,
                   runner=RunnerSpec("dask", workers=2))
    fp = _check(tmp_path / "m.parquet", corpus)
    build_manifest(corpus, tmp_path / "ref.parquet", chunk_records=400)
    assert manifest_info(tmp_path / "ref.parquet")["manifest_fingerprint"] == fp


@pytest.mark.slow
def test_parquet_corpus_on_multiprocessing_fnapi_gives_the_same_manifest(corpus, tmp_path):
    pq_root = tmp_path / "pq"
    pq_root.mkdir()
    for shard in list_shards(corpus):
        r = ArrayRecordReader(str(shard.path))
        raws = r.read(0, r.num_records())
        r.close()
        pq.write_table(pa.table({
            "tokens": pa.array([list(memoryview(x[6 + x[5]:]).cast("i")) for x in raws],
                               pa.list_(pa.int32())),
            "domain": [x[6:6 + x[5]].decode() for x in raws],
        }), pq_root / shard.path.name.replace(".array_record", ".parquet"), row_group_size=500)
    build_manifest(pq_root, tmp_path / "m.parquet", chunk_records=700,
                   runner=RunnerSpec("direct", mode="multi_processing", workers=2))
    got = pq.read_table(tmp_path / "m.parquet")
    want = reference(corpus)
    want = want.set_column(5, "source", pa.array(
        [s.replace(".array_record", ".parquet") for s in want["source"].to_pylist()]))
    assert got.equals(want)


def test_changed_corpus_changes_the_fingerprint(corpus, tmp_path):
    build_manifest(corpus, tmp_path / "a.parquet")
    changed = tmp_path / "changed"
    changed.mkdir()
    for shard in list_shards(corpus):
        r = ArrayRecordReader(str(shard.path))
        raws = r.read(0, r.num_records())
        r.close()
        if shard.base_key == 0:
            raws[7] = raws[7][:-1] + bytes([raws[7][-1] ^ 1])
        w = ArrayRecordWriter(str(changed / shard.path.name), "group_size:1")
        for x in raws:
            w.write(x)
        w.close()
    build_manifest(changed, tmp_path / "b.parquet")
    a, b = pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")
    diff = [i for i in range(a.num_rows) if a["content_hash"][i] != b["content_hash"][i]]
    assert diff == [7]
    assert (manifest_info(tmp_path / "a.parquet")["manifest_fingerprint"]
            != manifest_info(tmp_path / "b.parquet")["manifest_fingerprint"])


def _ar(path, records):
    w = ArrayRecordWriter(str(path), "group_size:1")
    for x in records:
        w.write(x)
    w.close()


@pytest.mark.parametrize("case,message", [
    ("empty_record", r"train-0\.array_record record 2: record without tokens"),
    ("float_tokens", r"train-0\.array_record record 1: token array of type code b'f'"),
    ("odd_bytes", r"train-0\.array_record record 0: 11 token bytes, not a whole number"),
    ("parquet_float", r"train-0\.parquet: column 'tokens' is list<.*float>, expected list<int32>"),
    ("parquet_empty", r"train-0\.parquet record 1: record without tokens"),
    ("garbage", r"train-0\.array_record: unreadable array_record shard"),
    ("no_shards", r"holds no shards"),
])
def test_bad_input_names_the_file_and_the_record(tmp_path, case, message):
    root = tmp_path / "c"
    root.mkdir()
    good = encode_record([1, 2, 3], "web")
    if case == "empty_record":
        _ar(root / "train-0.array_record", [good, good, encode_record([], "web"), good])
    elif case == "float_tokens":
        _ar(root / "train-0.array_record", [good, good[:4] + b"f" + good[5:]])
    elif case == "odd_bytes":
        _ar(root / "train-0.array_record", [good[:-1]])
    elif case == "parquet_float":
        pq.write_table(pa.table({"tokens": pa.array([[1.0]], pa.list_(pa.float32()))}),
                       root / "train-0.parquet")
    elif case == "parquet_empty":
        pq.write_table(pa.table({"tokens": pa.array([[1], []], pa.list_(pa.int32()))}),
                       root / "train-0.parquet")
    elif case == "garbage":
        (root / "train-0.array_record").write_bytes(b"\0" * 100)
    with pytest.raises(CorpusError, match=message):
        build_manifest(root, tmp_path / "m.parquet")
    assert not (tmp_path / "m.parquet").exists()
