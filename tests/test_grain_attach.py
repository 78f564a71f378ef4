"""A user's grain.DataLoader audited live by `tally.pipeline.grain_attach.audited`: the keys come
from
the loader's index contract (never from the batch), the loop gets the same batches, a restored
loader continues its keys, and loaders that are not 1:1 are refused. Real Grain throughout; the
record ids the tests compare against travel in a batch field that the attach never reads."""

from __future__ import annotations

import glob

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from absl import flags

from tally.audit import LedgerWriter, content_hash
from tally.pipeline.grain_attach import AttachError, audited, contract_of

N = 103


class Source(grain.sources.RandomAccessDataSource):
    """Record i: tokens i .. i + (i % 5) + 2, and its id (read only by the tests)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"tokens": np.arange(i, i + i % 5 + 2, dtype=np.int32), "id": np.int64(i)}

    def __repr__(self) -> str:
        return f"Source({N})"


class Pad(grain.transforms.Map):
    """1:1: pads the tokens to 8 and keeps the id (the attach must not read it)."""

    def map(self, x: dict) -> dict:
        out = np.zeros(8, np.int32)
        out[: len(x["tokens"])] = x["tokens"]
        return {"inputs": out, "id": x["id"]}


class Odd(grain.transforms.Filter):
    def filter(self, x: dict) -> bool:
        return bool(x["id"] % 2)


# In this process, and with Grain worker processes (each case ~10-25 s more: the slow layer).
WORKERS = [0, pytest.param(2, marks=pytest.mark.slow)]


def tokens_of(i: int) -> np.ndarray:
    return np.arange(i, i + i % 5 + 2, dtype=np.int32)


def loader(sampler, host=1, hosts=4, batch=3, workers=0, drop=True, ops=None):
    return grain.DataLoader(
        data_source=Source(), sampler=sampler,
        operations=[*(ops if ops is not None else [Pad()]),
                    grain.transforms.Batch(batch, drop_remainder=drop)],
        shard_options=grain.sharding.ShardOptions(host, hosts, drop_remainder=True),
        worker_count=workers)


def spool_rows(spool):
    files = sorted(glob.glob(f"{spool}/**/seg-*.parquet", recursive=True))
    t = pa.concat_tables([pq.read_table(f, partitioning=None) for f in files])
    t = t.sort_by([("step", "ascending"), ("row", "ascending")])
    return {c: t[c].to_numpy() for c in t.column_names}


def check_rows(rows, batches, start_step=0):
    """Every batch's ids at its step, in row order, with hashes of the source's tokens."""
    want = [(start_step + k, r, int(i)) for k, b in enumerate(batches)
            for r, i in enumerate(b["id"])]
    got = [(int(s), int(r), int(k)) for s, r, k in zip(rows["step"], rows["row"],
                                                        rows["record_key"], strict=True)]
    assert got == want
    assert rows["content_hash"].tolist() == [content_hash(tokens_of(k)) for _, _, k in want]
    assert list(rows["n_tokens"]) == [len(tokens_of(k)) for _, _, k in want]
    assert (rows["offset"] == 0).all()


@pytest.fixture(autouse=True, scope="module")
def _absl():
    flags.FLAGS.mark_as_parsed()  # Grain's worker processes read absl flags


SAMPLERS = {
    "index_shuffled": lambda: grain.samplers.IndexSampler(N, shuffle=True, seed=3),
    "index_sharded_block": lambda: grain.samplers.IndexSampler(
        N, shard_options=grain.sharding.ShardOptions(1, 4), shuffle=True, seed=3),
    "index_plain_3_epochs": lambda: grain.samplers.IndexSampler(N, num_epochs=3),
}


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_keys_from_the_contract_and_the_same_batches(tmp_path, workers, kind):
    plain = iter(loader(SAMPLERS[kind](), workers=workers))
    expected = [next(plain) for _ in range(9)]
    with LedgerWriter(tmp_path, "r", host=1, host_count=4, fsync=False) as w:
        it = iter(audited(loader(SAMPLERS[kind](), workers=workers), w))
        got = [next(it) for _ in range(9)]
    for a, b in zip(expected, got, strict=True):  # the loop sees what it saw before
        assert type(a) is type(b) and sorted(a) == sorted(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k])
    check_rows(spool_rows(tmp_path), got)


def test_epochs_of_grain_index_sampler(tmp_path):
    s = grain.samplers.IndexSampler(N, shuffle=True, seed=1, num_epochs=None)
    with LedgerWriter(tmp_path, "r", host=0, host_count=1, fsync=False) as w:
        it = iter(audited(loader(s, host=0, hosts=1, batch=10), w))
        for _ in range(25):  # 250 records: epochs 0, 1, 2
            next(it)
    rows = spool_rows(tmp_path)
    position = rows["step"] * 10 + rows["row"]
    assert rows["epoch"].tolist() == (position // N).tolist()
    for e in (0, 1):
        assert sorted(rows["record_key"][rows["epoch"] == e].tolist()) == list(range(N))


@pytest.mark.parametrize("workers", WORKERS)
def test_a_restored_iterator_continues_keys_and_steps(tmp_path, workers):
    make = SAMPLERS["index_shuffled"]
    truth = iter(loader(make(), workers=workers))
    every = [next(truth) for _ in range(10)]
    with LedgerWriter(tmp_path, "r", host=1, host_count=4, fsync=False) as w:
        first = iter(audited(loader(make(), workers=workers), w))
        for _ in range(4):
            next(first)
        state = first.get_state()  # the iterator's own state, as Grain saves it
        again = iter(audited(loader(make(), workers=workers), w))
        again.set_state(state)
        for _ in range(6):
            next(again)
    check_rows(spool_rows(tmp_path), every)


def test_start_step_offsets_a_sampler_resumed_by_its_own_start(tmp_path):
    with LedgerWriter(tmp_path, "r", host=1, host_count=4, fsync=False) as w:
        it = iter(audited(loader(SAMPLERS["index_shuffled"]()), w, start_step=500))
        got = [next(it) for _ in range(3)]
    check_rows(spool_rows(tmp_path), got, start_step=500)


def test_a_finite_loader_records_its_short_last_batch(tmp_path):
    s = grain.samplers.IndexSampler(N, num_epochs=1)  # 103 // 4 = 25 positions on host 1
    with LedgerWriter(tmp_path, "r", host=1, host_count=4, fsync=False) as w:
        got = list(audited(loader(s, batch=4, drop=False), w))
    assert [len(b["id"]) for b in got] == [4] * 6 + [1]
    check_rows(spool_rows(tmp_path), got)


def test_one_line_makes_the_writer_from_the_loader(tmp_path):
    au = audited(loader(SAMPLERS["index_shuffled"](), host=2, hosts=4), tmp_path, "exp1",
                 fsync=False)
    it = iter(au)
    got = [next(it) for _ in range(3)]
    au.writer.close()
    meta = pq.read_schema(glob.glob(f"{tmp_path}/exp1/attempt=0/host=2/seg-*")[0]).metadata
    assert meta[b"tally.host"] == b"2" and meta[b"tally.host_count"] == b"4"
    assert meta[b"tally.records_per_epoch"] == str(N).encode()
    check_rows(spool_rows(tmp_path), got)


def test_loaders_that_are_not_one_to_one_are_refused():
    with pytest.raises(AttachError, match=r"operation 1 \(Odd\) is not 1:1"):
        contract_of(loader(SAMPLERS["index_shuffled"](), ops=[Pad(), Odd()]))
    no_batch = grain.DataLoader(data_source=Source(), sampler=SAMPLERS["index_shuffled"](),
                                operations=[Pad()],
                                shard_options=grain.sharding.ShardOptions(0, 1))
    with pytest.raises(AttachError, match="no Batch operation"):
        contract_of(no_batch)
    with pytest.raises(AttachError, match="expected a grain.DataLoader"):
        contract_of([1, 2, 3])


# ---- MapDataset pipelines -----------------------------------------------------------------

def pipeline(truth: bool = False, reseed: bool = True):
    """A user's MapDataset pipeline (shuffle, repeat, per-host slice, a 1:1 map). The truth
    variant also carries `map_with_index`'s epoch * N + key, which the attach never reads."""
    ds = grain.MapDataset.source(Source())
    if truth:
        ds = ds.map_with_index(lambda i, x: {**x, "g": np.int64(i)})
    ds = ds.shuffle(seed=4).repeat(reseed_each_epoch=reseed)[1::4]
    return ds.map(lambda x: {**Pad().map(x), **({"g": x["g"]} if "g" in x else {})})


def check_epochs(rows, truth_batches):
    g = np.concatenate([b["g"] for b in truth_batches])
    assert rows["record_key"].tolist() == (g % N).tolist()
    assert rows["epoch"].tolist() == (g // N).tolist()


@pytest.mark.parametrize("reseed", [True, False])
def test_a_map_dataset_pipeline_by_index(tmp_path, reseed):
    truth = pipeline(True, reseed).batch(3)
    with LedgerWriter(tmp_path, "r", host=1, host_count=4, records_per_epoch=N,
                      fsync=False) as w:
        ds = audited(pipeline(False, reseed).batch(3), w)
        got = [ds[k] for k in range(60)]  # 180 records of 26 a host-epoch: 7 epochs
    rows = spool_rows(tmp_path)
    check_rows(rows, got)
    check_epochs(rows, [truth[k] for k in range(60)])


def test_an_iter_dataset_pipeline_and_its_state(tmp_path):
    truth = pipeline(True).to_iter_dataset().batch(3)
    t_it = iter(truth)
    every = [next(t_it) for _ in range(12)]
    with LedgerWriter(tmp_path, "r", host=1, host_count=4, fsync=False) as w:
        it = iter(audited(pipeline().to_iter_dataset().batch(3), w))
        for _ in range(5):
            next(it)
        state = it.get_state()
        again = iter(audited(pipeline().to_iter_dataset().batch(3), w))
        again.set_state(state)
        got = [next(again) for _ in range(7)]
    rows = spool_rows(tmp_path)
    check_epochs(rows, every)
    assert [b["id"].tolist() for b in got] == [b["id"].tolist() for b in every[5:]]


def test_dataset_pipelines_that_do_not_keep_positions_are_refused(tmp_path):
    with LedgerWriter(tmp_path, "r", fsync=False) as w:
        with pytest.raises(AttachError, match="FilterMapDataset in the MapDataset pipeline"):
            audited(pipeline().filter(lambda x: x["id"] % 2 == 0).to_iter_dataset().batch(3), w)
        with pytest.raises(AttachError, match="expected a pipeline ending in .batch"):
            audited(pipeline(), w)
    with pytest.raises(AttachError, match="give host= and host_count="):
        audited(pipeline().batch(3), tmp_path, "r")


def test_grains_checkpoint_handler_saves_and_restores_the_audited_iterator(tmp_path):
    from etils import epath
    from grain.checkpoint import CheckpointHandler

    make = SAMPLERS["index_shuffled"]
    truth = iter(loader(make(), host=0, hosts=1))
    every = [next(truth) for _ in range(9)]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with LedgerWriter(tmp_path / "spool", "r", fsync=False) as w:
        it = iter(audited(loader(make(), host=0, hosts=1), w))
        for _ in range(4):
            next(it)
        CheckpointHandler().save(epath.Path(ckpt), it)  # process_0-of-1.json, as a job saves
        restored = CheckpointHandler().restore(
            epath.Path(ckpt), iter(audited(loader(make(), host=0, hosts=1), w)))
        for _ in range(5):
            next(restored)
    assert (ckpt / "process_0-of-1.json").is_file()
    check_rows(spool_rows(tmp_path / "spool"), every)


@pytest.mark.parametrize("drop", [False, True])
def test_a_batched_map_dataset_indexed_past_its_end_reads_later_epochs(tmp_path, drop):
    def ds(truth):
        d = grain.MapDataset.source(Source())
        if truth:
            d = d.map_with_index(lambda i, x: {**x, "g": np.int64(i)})
        return d.shuffle(seed=1).map(
            lambda x: {**Pad().map(x), **({"g": x["g"]} if "g" in x else {})}
        ).batch(4, drop_remainder=drop)

    truth = ds(True)
    with LedgerWriter(tmp_path, "r", records_per_epoch=N, fsync=False) as w:
        audited_ds = audited(ds(False), w)
        got = [audited_ds[k] for k in range(60)]  # 25 or 26 batches a pass: into pass 3
    rows = spool_rows(tmp_path)
    check_rows(rows, got)
    check_epochs(rows, [truth[k] for k in range(60)])


def test_equal_shards_that_leave_the_remainder_out_are_a_warning_naming_the_same_records(
        tmp_path):
    """Grain's IndexSampler over 103 records on 4 hosts with ShardOptions(drop_remainder=True)
    for 3 epochs: each host's shard is 25 records, so the same 3 records are left out of every
    epoch (Grain logs "Dropping 3 examples"). That is the loader's design, not a skip: reconcile
    says `drop_remainder` (WARN), the host count's remainder and the same 3 records each
    epoch, and neither `epoch_skipped` nor uneven exposure."""
    from tally.audit.reconcile import reconcile
    from tests.support.manifest import keyed_manifest

    hosts = 4
    for h in range(hosts):
        sampler = grain.samplers.IndexSampler(
            N, shuffle=True, seed=3, num_epochs=3,
            shard_options=grain.sharding.ShardOptions(h, hosts, drop_remainder=True))
        lo = audited(loader(sampler, host=h, hosts=hosts, batch=2, drop=False),
                     tmp_path / "spool", run_id="r")
        for _ in lo:
            pass
        lo.writer.finish()
    keyed_manifest(tmp_path / "m.parquet", N, fingerprint=None, hashes=lambda keys: np.array(
        [content_hash(tokens_of(int(k))) for k in keys], np.uint64))
    r = reconcile(run_id="r", manifest=tmp_path / "m.parquet", out=tmp_path / "rep",
                  spool=tmp_path / "spool")
    assert r["coverage"]["never_seen"] == N % hosts == 3
    assert r["verdict"] == "WARN", r["findings"]
    (f,) = [f for f in r["findings"] if f["code"] == "drop_remainder"]
    assert f["numbers"] == {"epochs": 3, "records": 3, "same_records": True}
    assert "do not divide by the host count of 4" in f["message"]
    assert [f["code"] for f in r["findings"]] == ["drop_remainder"]
