"""Real Grain loaders with the fault switches, through the writer, reconciled: the report
catches each fault and names it; the correct loader passes."""

import json

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from audit.hook.segments import Segments
from audit.hook.writer import LedgerWriter
from audit.reconcile import reconcile
from pipeline.corpus import TokenSource
from pipeline.loader import KeyedLoader, LoaderConfig
from pipeline.manifest import build_manifest, manifest_info
from pipeline.synth import synth_corpus

HOSTS = 64


def _cfg(**kw) -> LoaderConfig:
    # Many hosts in one process: read on demand, no read-ahead threads per loader.
    return LoaderConfig(seq_len=32, read_threads=0, read_buffer=0, **kw)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    # 19,584 train records = 64 hosts x 2 rows x 153 steps: one epoch exactly.
    synth_corpus(root / "c", records=20_000, seed=4, heldout_fraction=0.0208,
                 length_scale=0.02, min_len=1, max_len=32)
    build_manifest(root / "c", root / "m.parquet")
    return root, TokenSource(root / "c")


def _run(spool, source, cfg, hosts, steps, *, attempt=0, first=0, run="r", restore=None):
    """Each host consumes `steps` batches into the spool; returns the loaders' states."""
    out = []
    for h in range(hosts):
        loader = KeyedLoader(source, cfg, h, hosts)
        if restore is not None:
            restore(loader, h)
        with LedgerWriter(spool, run, host=h, host_count=hosts, attempt=attempt,
                          resumed_from_step=first if attempt else None,
                          records_per_epoch=len(source), flush_every=64, fsync=False) as w:
            for step in range(first, first + steps):
                w.write_batch(step, next(loader))
        out.append(loader.get_state())
    return out


def _reconcile(root, spool, name):
    return reconcile(run_id="r", manifest=root / "m.parquet", out=root / name, spool=spool)


def test_seed_check_per_host_seeds_on_64_hosts_match_the_analytic_values(corpus, tmp_path):
    root, source = corpus
    assert len(source) == HOSTS * 2 * 153
    cfg = _cfg(global_batch=HOSTS * 2, fault="per_host_seed", seed=7)
    _run(tmp_path / "spool", source, cfg, HOSTS, 153)
    r = _reconcile(root, tmp_path / "spool", "seeds")
    p0 = (1 - 1 / HOSTS) ** HOSTS
    p1 = (1 - 1 / HOSTS) ** (HOSTS - 1)
    f = r["coverage"]["histogram_fraction"]
    assert abs(f["0"] - p0) < 0.01
    assert abs(f["2"] + f["3+"] - (1 - p0 - p1)) < 0.01
    assert r["verdict"] == "FAIL"
    (finding,) = [x for x in r["findings"] if x["code"] == "with_replacement"]
    assert "sampling with replacement" in finding["message"]
    assert "per-host shuffle seeds" in finding["message"]


def test_correct_loader_on_64_hosts_sees_every_record_once(corpus, tmp_path):
    root, source = corpus
    cfg = _cfg(global_batch=HOSTS * 2, seed=7)
    _run(tmp_path / "spool", source, cfg, HOSTS, 153)
    r = _reconcile(root, tmp_path / "spool", "good")
    assert r["coverage"]["coverage"] == 1.0
    assert r["coverage"]["histogram"] == {"0": 0, "1": len(source), "2": 0, "3+": 0}
    assert r["verdict"] == "PASS" and r["findings"] == []
    assert r["first_bad_step"] is None
    # Disjoint hosts: the overlap matrix is diagonal.
    m = r["hosts"]["overlap_matrix"]
    assert all(m[i][j] == 0 for i in range(HOSTS) for j in range(HOSTS) if i != j)


def test_no_sharding_is_named(corpus, tmp_path):
    root, source = corpus
    cfg = _cfg(global_batch=8, fault="no_sharding", seed=1)
    _run(tmp_path / "spool", source, cfg, 4, 200)
    r = _reconcile(root, tmp_path / "spool", "nosh")
    codes = [x["code"] for x in r["findings"]]
    assert codes == ["no_sharding"]
    assert "each of 4 hosts saw the same records" in r["findings"][0]["message"]


def test_double_slicing_is_caught(corpus, tmp_path):
    root, source = corpus
    cfg = _cfg(global_batch=32, fault="double_slice", seed=1)
    _run(tmp_path / "spool", source, cfg, 4, len(source) // 32)
    r = _reconcile(root, tmp_path / "spool", "double")
    (finding,) = r["findings"]
    assert finding["code"] == "with_replacement"
    assert "applied twice" in finding["message"]


def test_naive_reshard_8_to_4_is_named(corpus, tmp_path):
    root, source = corpus
    cfg = _cfg(global_batch=32, seed=2, fault="naive_reshard")
    states = _run(tmp_path / "spool", source, cfg, 8, 100)
    _run(tmp_path / "spool", source, cfg, 4, 200, attempt=1, first=100,
         restore=lambda loader, h: loader.set_state(states[h]))
    r = _reconcile(root, tmp_path / "spool", "reshard")
    (finding,) = r["findings"]
    assert finding["code"] == "reshard_band"
    assert "resume at step 100 on 4 hosts (was 8)" in finding["message"]


def test_global_batch_changed_on_resume_is_named(corpus, tmp_path):
    root, source = corpus
    old = _cfg(global_batch=16, seed=3, elastic=True)
    new = _cfg(global_batch=32, seed=3, elastic=True)
    _run(tmp_path / "spool", source, old, 4, 100)
    # The resumed job recomputes its position as step x (new) global batch.
    _run(tmp_path / "spool", source, new, 4, 100, attempt=1, first=100,
         restore=lambda loader, h: loader._it.set_state({"global_next_index": 100 * 32}))
    r = _reconcile(root, tmp_path / "spool", "batch")
    (finding,) = r["findings"]
    assert finding["code"] == "batch_changed"
    assert "from 16 to 32 rows at step 100" in finding["message"]
    assert json.loads((root / "batch" / "report.json").read_text())["batch_changes"] == [
        {"step": 100, "before": 16, "after": 32}]


def _consume(spool, man, keys_per_host_step):
    """Write exact segments: keys_per_host_step[h][s] is the list of keys host h reads at s."""
    hosts = len(keys_per_host_step)
    for h, per_step in enumerate(keys_per_host_step):
        with LedgerWriter(spool, "r", host=h, host_count=hosts, fsync=False) as w:
            for step, keys in enumerate(per_step):
                keys = np.asarray(keys)
                w.write_segments(step, Segments.build(
                    row=np.arange(len(keys)), record_key=keys, epoch=np.zeros(len(keys)),
                    n_tokens=man["n_tokens"].to_numpy()[keys],
                    content_hash=man["content_hash"].to_numpy()[keys]))


def test_sampler_padding_is_named(corpus, tmp_path):
    root, _ = corpus
    man = pq.read_table(root / "m.parquet")
    n = int(manifest_info(root / "m.parquet")["train_records"])
    # 5 hosts, 8 rows a step; the epoch is padded to a multiple of 40 by repeating records.
    order = np.random.default_rng(0).permutation(n)
    pad = -n % 40
    padded = np.concatenate([order, order[:pad]])
    per_host = [[padded[s * 40 + h * 8: s * 40 + h * 8 + 8] for s in range(len(padded) // 40)]
                for h in range(5)]
    _consume(tmp_path / "spool", man, per_host)
    r = _reconcile(root, tmp_path / "spool", "padding")
    assert pad and r["coverage"]["histogram"]["2"] == pad
    assert r["coverage"]["epoch_duplicates"] == pad
    (finding,) = r["findings"]
    assert finding["code"] == "padding"
    assert f"{pad} records seen twice within an epoch" in finding["message"]


def test_files_never_read_are_named(corpus, tmp_path):
    root, _ = corpus
    man = pq.read_table(root / "m.parquet")
    train = man.filter(pc.equal(man["split"], "train"))
    # File-level sharding over 4 files on 3 hosts, two epochs: host h reads file h twice;
    # file 3 is never read.
    sources = sorted(set(train["source"].to_pylist()))
    per_host = []
    for h in range(3):
        keys = train.filter(pc.equal(train["source"], sources[h]))["record_key"].to_numpy()
        keys = np.concatenate([keys, keys])
        per_host.append([keys[i:i + 8] for i in range(0, len(keys) - len(keys) % 8, 8)])
    _consume(tmp_path / "spool", man, per_host)
    r = _reconcile(root, tmp_path / "spool", "files")
    codes = [f["code"] for f in r["findings"]]
    assert "files_unread" in codes
    (finding,) = [f for f in r["findings"] if f["code"] == "files_unread"]
    assert sources[3] in finding["message"] and "1 corpus file(s) were never read" in \
        finding["message"]
