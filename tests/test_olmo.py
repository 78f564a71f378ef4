"""OLMo numpy token mixes: the index, the instances, and their manifest through the real CLI and
Beam job, against an oracle that reads the files with numpy and hashes each instance with xxhash
directly."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

from tally.audit.core.hashing import content_hash
from tally.pipeline.corpus import CorpusError
from tally.pipeline.manifest_file import MANIFEST_SCHEMA, manifest_info
from tally.pipeline.olmo import index_from_files, load_index, write_mix
from tests.support.cli import tally

L = 64  # sequence length


def _tokens(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    top = np.iinfo(dtype).max
    t = rng.integers(0, top, n, dtype=np.int64, endpoint=True).astype(dtype)
    t[:3] = [0, top, top - 1]  # the extremes: uint32 ids >= 2**31 hash as their 4 bytes
    return t


def _mix(root: Path, dtype: str, seed: int = 0) -> tuple[Path, list[tuple[str, str, Path]]]:
    """A hand-written 3-file mix: a raw file of whole instances, a raw file with 7 trailing
    tokens, a real .npy with a header (4 instances and 3 trailing tokens; given by its
    absolute path). Returns the index and (label, source, file) per file."""
    rng = np.random.default_rng(seed)
    (root / "web").mkdir(parents=True)
    (root / "code").mkdir()
    (root / "books").mkdir()
    files = [("web", "web/a.npy", 5 * L), ("code", "code/b.npy", 3 * L + 7),
             ("books", "books/c.npy", 4 * L + 3)]
    entries, offset = [], 0
    for label, rel, n in files:
        tokens = _tokens(rng, n, dtype)
        if rel.startswith("books"):
            np.save(root / rel, tokens)  # with the \x93NUMPY header
            assert (root / rel).read_bytes()[:6] == b"\x93NUMPY"
        else:
            tokens.astype(np.dtype(dtype).newbyteorder("<")).tofile(root / rel)
        path = str(root / rel) if rel.startswith("books") else rel
        entries.append({"path": path, "label": label, "n_tokens": n,
                        "n_instances": n // L, "instance_offset": offset})
        offset += n // L
    index = root / "index.json"
    index.write_text(json.dumps({
        "format_version": "1", "sequence_length": L, "dtype": dtype, "tokenizer": "t",
        "total_instances": offset, "total_tokens": sum(e["n_tokens"] for e in entries),
        "fingerprint": f"sha256:{dtype}-fixture", "files": entries}))
    return index, [(label, rel, root / rel) for label, rel, _ in files]


def oracle(files: list[tuple[str, str, Path]], dtype: str) -> pa.Table:
    """The manifest as numpy reads the files: instance after instance, each hashed with
    xxh3_64 over its ids' 4-byte little-endian values (int32, or uint32 as is)."""
    rows = {n: [] for n in MANIFEST_SCHEMA.names}
    key = 0
    for label, source, path in files:
        raw = path.read_bytes()
        if raw[:6] == b"\x93NUMPY":
            tokens = np.load(path)
        else:
            tokens = np.frombuffer(raw, np.dtype(dtype).newbyteorder("<"))
        wide = tokens.astype("<u4" if dtype == "uint32" else "<i4")
        for i in range(len(tokens) // L):
            rows["record_key"].append(key)
            rows["content_hash"].append(xxhash.xxh3_64_intdigest(wide[i * L:(i + 1) * L]
                                                                 .tobytes()))
            rows["n_tokens"].append(L)
            rows["domain"].append(label)
            rows["split"].append("train")
            rows["source"].append(source)
            rows["source_index"].append(i)
            rows["doc_id"].append(None)
            key += 1
    return pa.table(rows, schema=MANIFEST_SCHEMA)


@pytest.mark.parametrize("dtype,mode", [("uint16", "in_memory"),
                                        pytest.param("uint32", "multi_processing",
                                                     marks=pytest.mark.slow)])
def test_manifest_of_a_mix_equals_the_numpy_oracle(tmp_path, cli, dtype, mode):
    index, files = _mix(tmp_path / "mix", dtype)
    out = tmp_path / "m.parquet"
    # 3 instances per range: ranges cut inside files, across the workers.
    code, stdout, err = cli("manifest", str(index), "-o", str(out), "-q",
                            "--chunk-records", "3", "--mode", mode, "--workers", "2")
    assert code == 0, err
    assert "12 records (12 train), 768 tokens" in stdout
    got = pq.read_table(out)
    want = oracle(files, dtype)
    assert want.num_rows == 5 + 3 + 4
    assert got.equals(want)
    assert got["record_key"].to_pylist() == list(range(12))
    info = manifest_info(out)
    assert info["olmo_fingerprint"] == f"sha256:{dtype}-fixture"  # the index's own, as is
    assert (info["sequence_length"], info["dtype"], info["tokenizer"]) == (str(L), dtype, "t")
    assert info["corpus"] == str(index.resolve()) and info["records"] == "12"
    # The training hook, given the same instance as an int32 batch, hashes it the same.
    ix = load_index(index)
    for key in (0, 5, 11):
        assert content_hash(ix.instance_tokens(key)) == got["content_hash"][key].as_py()


def test_index_api_locates_instances_and_pickles(tmp_path):
    rng = np.random.default_rng(3)
    parts = [("web", rng.integers(0, 50_000, 3 * L + 1)), ("code", rng.integers(0, 9, L - 1)),
             ("web", rng.integers(0, 50_000, 2 * L))]
    index = load_index(write_mix(tmp_path, parts, L, dtype="uint16"))
    assert len(index) == index.total_instances == 5
    assert [f.n_instances for f in index.files] == [3, 0, 2]
    assert [f.source for f in index.files] == ["web-0000.npy", "code-0001.npy", "web-0002.npy"]
    assert index.dtype == np.dtype("uint16")
    ids = np.array([4, 0, 3, 2, 1])
    file_idx, local = index.locate(ids)
    # The file with no whole instance holds none of them.
    assert file_idx.tolist() == [2, 0, 2, 0, 0] and local.tolist() == [1, 0, 0, 2, 1]
    flat = [np.asarray(t)[: len(t) // L * L].reshape(-1, L) for _, t in parts]
    want = np.concatenate(flat)
    for i in range(5):
        got = index.instance_tokens(i)
        assert got.dtype == np.int32 and np.array_equal(got, want[i])
    again = pickle.loads(pickle.dumps(index))
    assert np.array_equal(again[4], want[4]) and again.locate(ids)[0].tolist() == [2, 0, 2, 0, 0]
    with pytest.raises(IndexError):
        index.locate(np.array([5]))


def test_token_files_without_an_index(tmp_path, cli):
    """index_from_files: n_tokens from each file's size, the label from its directory, the
    source relative to the files' common directory; a directory of files reads in path order."""
    rng = np.random.default_rng(5)
    index, files = _mix(tmp_path / "mix", "uint32")
    paths = [f for _, _, f in files]
    ix = index_from_files(paths, L, "uint32")
    assert [f.label for f in ix.files] == ["web", "code", "books"]
    assert [f.n_tokens for f in ix.files] == [5 * L, 3 * L + 7, 4 * L + 3]
    assert ix.fingerprint.startswith("sha256:") and ix.path is None
    out = tmp_path / "files.parquet"
    code, _, err = cli("manifest", *map(str, paths), "--sequence-length", str(L),
                       "--dtype", "uint32", "-o", str(out), "-q")
    assert code == 0, err
    assert pq.read_table(out).equals(oracle(files, "uint32"))
    assert manifest_info(out)["olmo_fingerprint"] == ix.fingerprint
    # The directory: *.npy at any depth, in path order (books, code, web).
    out = tmp_path / "dir.parquet"
    code, _, err = cli("manifest", str(tmp_path / "mix"), "--sequence-length",
                       str(L), "--dtype", "uint32", "-o", str(out), "-q")
    assert code == 0, err
    assert pq.read_table(out).equals(oracle([files[2], files[1], files[0]], "uint32"))
    # write_mix's own mix, by its index and by its files, hashes alike.
    mix = write_mix(tmp_path / "w", [("a", rng.integers(0, 99, 2 * L)),
                                     ("b", rng.integers(0, 99, 3 * L))], L, "uint16")
    code, _, err = cli("manifest", str(mix), "-o", str(tmp_path / "w1.parquet"), "-q")
    assert code == 0, err
    code, _, err = cli("manifest", str(tmp_path / "w" / "a-0000.npy"),
                       str(tmp_path / "w" / "b-0001.npy"), "--sequence-length", str(L),
                       "--dtype", "uint16", "-o", str(tmp_path / "w2.parquet"), "-q")
    assert code == 0, err
    w1, w2 = pq.read_table(tmp_path / "w1.parquet"), pq.read_table(tmp_path / "w2.parquet")
    assert w1["domain"].to_pylist() == ["a"] * 2 + ["b"] * 3
    assert w2["domain"].to_pylist() == ["w"] * 5  # no index: the directory's name
    assert w1["content_hash"].equals(w2["content_hash"])
    # Tally's fingerprint of a mix: the same files, sequence length, dtype and tokenizer
    # give the same one, with an index or without.
    w_files = [tmp_path / "w" / "a-0000.npy", tmp_path / "w" / "b-0001.npy"]
    assert (manifest_info(tmp_path / "w1.parquet")["olmo_fingerprint"]
            == json.loads(mix.read_text())["fingerprint"]
            == index_from_files(w_files, L, "uint16", tokenizer="test").fingerprint)
    assert (manifest_info(tmp_path / "w2.parquet")["olmo_fingerprint"]
            == index_from_files(w_files, L, "uint16").fingerprint)


def _edit(index: Path, change) -> None:
    doc = json.loads(index.read_text())
    change(doc)
    index.write_text(json.dumps(doc))


def _npy_of(path: Path, dtype: str) -> None:
    np.save(path.with_suffix(".tmp.npy"), np.arange(5 * L, dtype=dtype))
    path.with_suffix(".tmp.npy").replace(path)


BAD = {
    "missing_file": (lambda ix, root: (root / "code" / "b.npy").unlink(),
                     r"token file .*code/b\.npy is missing"),
    "short_file": (lambda ix, root: (root / "web" / "a.npy").write_bytes(
        (root / "web" / "a.npy").read_bytes()[:4 * L * 4 + 2]),
        r"token file .*web/a\.npy is shorter than the index says: 256 uint32 tokens, "
        r"n_tokens 320"),
    "truncated_npy": (lambda ix, root: (root / "books" / "c.npy").write_bytes(
        (root / "books" / "c.npy").read_bytes()[:-10]), r"books/c\.npy is truncated"),
    "npy_of_another_dtype": (lambda ix, root: _npy_of(root / "books" / "c.npy", "float32"),
                             r"books/c\.npy is a \.npy of float32, the mix's dtype is uint32"),
    "bad_json": (lambda ix, root: ix.write_text('{"format_version": "1", '),
                 r"index\.json: not valid JSON"),
    "wrong_dtype": (lambda ix, root: _edit(ix, lambda d: d.update(dtype="float32")),
                    r"dtype 'float32' is not one Tally reads \(uint8, uint16, uint32, int32\)"),
    "format_version": (lambda ix, root: _edit(ix, lambda d: d.update(format_version="2")),
                       r"format_version '2', Tally reads '1'"),
    "missing_key": (lambda ix, root: _edit(ix, lambda d: d.pop("sequence_length")),
                    r"missing key\(s\) 'sequence_length'"),
    "file_missing_key": (lambda ix, root: _edit(ix, lambda d: d["files"][1].pop("n_tokens")),
                         r"files\[1\] misses key\(s\) 'n_tokens'"),
    "n_instances": (lambda ix, root: _edit(ix, lambda d: d["files"][1].update(n_instances=4)),
                    r"files\[1\] \(code/b\.npy\): n_instances is 4, but n_tokens 199 // "
                    r"sequence_length 64 = 3"),
    "offsets": (lambda ix, root: _edit(ix, lambda d: d["files"][2].update(instance_offset=9)),
                r"files\[2\] \(.*c\.npy\): instance_offset is 9, but the files before it hold 8"),
    "total_instances": (lambda ix, root: _edit(ix, lambda d: d.update(total_instances=13)),
                        r"total_instances is 13, but its files add up to 12"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_index_is_one_line_and_exit_2_with_nothing_written(tmp_path, cli,
                                                               case):
    index, _ = _mix(tmp_path / "mix", "uint32")
    spoil, message = BAD[case]
    spoil(index, tmp_path / "mix")
    code, out, err = cli("manifest", str(index), "-o", str(tmp_path / "m.parquet"))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tally: error: "), err
    assert re.search(message, err), err
    assert not list(tmp_path.glob("*m.parquet*")), list(tmp_path.iterdir())


@pytest.mark.parametrize("args,message", [
    (["mix/web/a.npy"], r"token files \(.*a\.npy\) need --sequence-length and --dtype"),
    (["mix"], r"holds token files \(\*\.npy\) and no ArrayRecord or Parquet shards: give "
              r"--sequence-length and --dtype"),
    (["mix/web/a.npy", "--sequence-length", "64", "--dtype", "int64"],
     r"dtype 'int64' is not one Tally reads"),
    (["mix/web/a.npy", "--sequence-length", "64"], r"need both --sequence-length and --dtype"),
    (["mix/web/a.npy", "mix/nope.npy", "--sequence-length", "64", "--dtype", "uint32"],
     r"token file .*mix/nope\.npy is missing"),
    (["mix/index.json", "--sequence-length", "128"],
     r"says sequence_length 64, not --sequence-length 128"),
    (["mix/web/a.npy", "--sequence-length", "4096", "--dtype", "uint32"],
     r"no file holds a whole instance of 4,096 tokens"),
    (["mix/none.json"], r"index\.json: no such file|none\.json: no such file"),
])
def test_bad_token_file_arguments(tmp_path, cli, args, message):
    _mix(tmp_path / "mix", "uint32")
    code, out, err = cli("manifest", *args, "-o", "m.parquet", cwd=tmp_path)
    assert code == 2 and err.count("\n") == 1 and err.startswith("tally: error: "), err
    assert re.search(message, err), err
    assert not list(tmp_path.glob("*m.parquet*"))


@pytest.mark.slow
def test_the_real_command_line_says_one_line(tmp_path):
    """Through the supervised child process, as a user runs it."""
    index, _ = _mix(tmp_path / "mix", "uint16")
    (tmp_path / "mix" / "web" / "a.npy").unlink()
    r = tally("manifest", index, "-o", tmp_path / "m.parquet", timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"tally: error: OLMo index {index}: token file "
                        f"{tmp_path / 'mix' / 'web' / 'a.npy'} is missing\n")
    assert not list(tmp_path.glob("*m.parquet*"))


def test_load_index_raises_corpus_error(tmp_path):
    with pytest.raises(CorpusError, match="no such file"):
        load_index(tmp_path / "nope.json")


def test_the_benchmark_runs_at_toy_size(tmp_path):
    from bench import olmo_manifest

    res = olmo_manifest.main(["--files", "2", "--tokens-per-file", "9000", "--sequence-length",
                              "256", "--runners", "in_memory", "--dir", str(tmp_path / "b")])
    assert res["instances"] >= 2 * (9000 // 256) and res["runs"]["in_memory"]["gb_s"] > 0
    assert res["extrapolation"]["hours_64"] > 0
    assert not (tmp_path / "b").exists()  # it cleans up after itself


# ---- tally exposure --eos-token-id: documents inside a mix ------------------------------------

EOS = 0


def test_exposure_finds_documents_inside_the_mix(tmp_path, cli, monkeypatch):
    """Documents concatenated with EOS into two files, cut into 16-token instances; a run that
    consumed some instances (some twice). Each asked document maps to exactly the instances its
    tokens fall in (an oracle from where the test put them), duplicates in both files, across
    instance and block boundaries (blocks of 2 instances), a trailing EOS in the question or
    not; one cut by a file's dropped tail and one in no file match nothing."""
    from tally.audit.hook.writer import LedgerWriter
    from tally.audit.posthoc.exposure import exposure
    from tally.pipeline import olmo as olmo_module
    from tally.pipeline.manifest import build_manifest

    monkeypatch.setattr(olmo_module, "BLOCK_TOKENS", 2 * 16)
    n16 = 16
    rng = np.random.default_rng(9)
    docs = [rng.integers(1, 50_000, int(rng.integers(3, 41))) for _ in range(40)]
    docs[25] = docs[5].copy()  # one document in both files
    streams, where = [], {}  # doc -> [(file, start, end)]
    for f, ids in enumerate((range(0, 20), range(20, 40))):
        parts, at = [], 0
        for i in ids:
            where.setdefault(i, []).append((f, at, at + len(docs[i])))
            parts += [docs[i], [EOS]]
            at += len(docs[i]) + 1
        streams.append(np.concatenate(parts))
    index = write_mix(tmp_path / "mix", [("a", streams[0]), ("b", streams[1])], n16, "uint16")
    ix = load_index(index)
    build_manifest(index, tmp_path / "m.parquet")
    tail = {f: ix.files[f].n_instances * n16 for f in (0, 1)}
    last_in_0 = max(i for i in range(20) if where[i][0][2] > tail[0])  # cut by the tail

    def instances(i: int) -> set[int]:  # of every document with i's tokens
        same = [j for j in range(40) if np.array_equal(docs[j], docs[i])]
        return {ix.files[f].instance_offset + k for j in same for f, s, e in where[j]
                if e <= tail[f] for k in range(s // n16, (e - 1) // n16 + 1)}

    # The run: instances in order, then the first 12 again; 4 rows a step.
    keys = list(range(len(ix))) + list(range(12))
    with LedgerWriter(tmp_path / "spool", "r1", fsync=False) as w:
        for step, lo in enumerate(range(0, len(keys), 4)):
            k = np.array(keys[lo:lo + 4])
            w.write_batch(step, {"tokens": np.stack([ix.instance_tokens(int(x)) for x in k]),
                                 "key": k})
    asked = [5, 10, 33, 7, last_in_0, None]  # None: in no file
    tokens = [list(docs[i]) + ([EOS] if i in (10, 33) else []) if i is not None
              else [1, 2, 3] for i in asked]
    pq.write_table(pa.table({"tokens": pa.array(tokens, pa.list_(pa.int32()))}),
                   tmp_path / "docs.parquet")
    res = exposure(manifest=tmp_path / "m.parquet", docs=tmp_path / "docs.parquet",
                   runs=["r1"], out=tmp_path / "x", spool=tmp_path / "spool",
                   eos_token_id=EOS)
    table = pq.read_table(tmp_path / "x" / "exposure.parquet").to_pylist()
    got: dict[int, dict[int, int]] = {}
    for r in table:
        if r["record_key"] is not None:
            got.setdefault(r["document"], {})[r["record_key"]] = r["exposures"]
    want = {d: {k: keys.count(k) for k in instances(i)}
            for d, i in enumerate(asked) if i is not None and instances(i)}
    assert got == want
    assert set(ix.locate(np.array(sorted(want[0])))[0].tolist()) == {0, 1}  # both files
    assert all(len(want[d]) >= 2 for d in (1, 2, 3))  # across instances
    assert all(s // 32 != (e - 1) // 32 for i in (10, 33, 7) for _, s, e in where[i])  # blocks
    assert 4 not in got and 5 not in got  # cut by the tail, in no file
    assert res["matched"] == 4 and res["occurrences"] == 5  # doc 5 twice
    assert res["docs"]["eos_token_id"] == EOS
    assert res["runs"]["r1"]["consumed_2plus"] == sum(
        1 for v in want.values() if sum(v.values()) >= 2)
    # The command line, and a manifest that names no index.
    code, out, err = cli("exposure", "--manifest", str(tmp_path / "m.parquet"),
                         "--spool", str(tmp_path / "spool"), "--run", "r1", "--docs",
                         str(tmp_path / "docs.parquet"), "--eos-token-id", "0", "-o",
                         str(tmp_path / "cli"), "--json")
    assert code == 0, err
    assert json.loads(out)["matched"] == 4
    build_manifest([f.path for f in ix.files], tmp_path / "m2.parquet", sequence_length=n16,
                   dtype="uint16")
    code, out, err = cli("exposure", "--manifest", str(tmp_path / "m2.parquet"),
                         "--spool", str(tmp_path / "spool"), "--run", "r1", "--docs",
                         str(tmp_path / "docs.parquet"), "--eos-token-id", "0", "-o",
                         str(tmp_path / "cli2"))
    assert code == 2 and "no tally.olmo_index" in err and err.count("\n") == 1
