"""torch's DataLoader and torchdata's StatefulDataLoader audited in one line
(tally.pipeline.loaders.torch_loader): the loop gets the same batches; the spool's record keys,
epochs
and steps are what the batches held (truth read back from the tokens); a restored
StatefulDataLoader continues them exactly, workers or not; `tally replay` writes the same rows
from the loader factory; DistributedSampler's padding is named by reconcile with its numbers,
and the same setup without a remainder is PASS."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

# torch DataLoaders with worker processes, replayed and reconciled through the CLI.
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")

from torch.utils.data import (  # noqa: E402
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    get_worker_info,
)
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler  # noqa: E402

from tally.audit.core.hashing import content_hash  # noqa: E402
from tally.audit.hook.segments import Segments  # noqa: E402
from tally.audit.hook.writer import LedgerWriter  # noqa: E402
from tally.pipeline.loaders import AttachError  # noqa: E402
from tally.pipeline.loaders import torch_loader as tally_torch  # noqa: E402
from tests.support.cli import tally  # noqa: E402
from tests.support.manifest import keyed_manifest  # noqa: E402
from tests.support.spool import spool_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SEQ = 8


def record_tokens(i: int) -> np.ndarray:
    return np.random.default_rng(7_000 + i).integers(1, 50_000, SEQ, dtype=np.int64)


class Records(Dataset):
    """Record i: SEQ random tokens (so the tokens name the record), padded to SEQ + 2."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = np.zeros(SEQ + 2, np.int64)
        ids[1:SEQ + 1] = record_tokens(i)  # left and right padding
        mask = (ids != 0).astype(np.int64)
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


class EveryThird(torch.utils.data.Sampler):
    """A user batch sampler: batches of 3 indices, strided."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        order = [i for s in range(3) for i in range(s, self.n, 3)]
        return iter([order[k:k + 3] for k in range(0, len(order), 3)])

    def __len__(self) -> int:
        return -(-self.n // 3)


def manifest(path: Path, n: int) -> Path:
    """Records 0..n-1 whose content is record_tokens(key)."""
    return keyed_manifest(path, n, tokens=SEQ, fingerprint=None, hashes=lambda keys: np.array(
        [content_hash(record_tokens(int(k))) for k in keys], np.uint64))


def truth_of(batch: dict, by_tokens: dict) -> list[int]:
    return [by_tokens[row[m.bool()].numpy().tobytes()]
            for row, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)]


def by_tokens_of(n: int) -> dict:
    return {record_tokens(i).tobytes(): i for i in range(n)}


def make_loader(host: int, hosts: int, kind: str | None = None, n: int | None = None,
                workers: int = 0) -> DataLoader:
    """The factory `tally replay --loader tests.test_torch_loader:make_loader` calls."""
    kind = kind or os.environ.get("TALLY_TEST_KIND", "distributed")
    n = n or int(os.environ.get("TALLY_TEST_N", "203"))
    ds = Records(n)
    if kind == "distributed":
        return DataLoader(ds, batch_size=4, sampler=DistributedSampler(
            ds, num_replicas=hosts, rank=host, shuffle=True, seed=3), num_workers=workers)
    if kind == "random":
        return DataLoader(ds, batch_size=5, sampler=RandomSampler(
            ds, generator=torch.Generator().manual_seed(11)), num_workers=workers)
    if kind == "sequential":
        return DataLoader(ds, batch_size=6, sampler=SequentialSampler(ds), num_workers=workers)
    if kind == "batch_sampler":
        return DataLoader(ds, batch_sampler=EveryThird(n), num_workers=workers)
    if kind == "stateful":
        return StatefulDataLoader(ds, batch_size=4, sampler=StatefulDistributedSampler(
            ds, num_replicas=hosts, rank=host, shuffle=True, seed=5), num_workers=workers)
    raise ValueError(kind)


def run_epochs(loader, epochs: int, steps: int | None = None) -> list:
    out = []
    sampler = getattr(loader, "sampler", None)
    for e in range(epochs):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(e)
        for b in loader:
            out.append(b)
            if steps is not None and len(out) == steps:
                return out
    return out


@pytest.mark.parametrize("kind,hosts,workers", [
    ("distributed", 3, 0), ("random", 1, 0), ("sequential", 1, 0), ("batch_sampler", 1, 0),
    ("stateful", 2, 0), ("distributed", 2, 2)])
def test_same_batches_and_true_keys(tmp_path, kind, hosts, workers):
    n, host = 203, hosts - 1
    bare = run_epochs(make_loader(host, hosts, kind, n, workers), 2)
    loader = tally_torch.audited(make_loader(host, hosts, kind, n, workers), tmp_path, "r",
                                 host=host, host_count=hosts, mask_field="attention_mask",
                                 fsync=False)
    got = run_epochs(loader, 2)
    loader.writer.finish()
    assert len(got) == len(bare) == 2 * len(loader)
    for a, b in zip(got, bare, strict=True):  # the loop's batches: unchanged
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    by_tokens = by_tokens_of(n)
    t = spool_table(tmp_path, "r").to_pydict()
    steps = np.array(t["step"])
    assert sorted(set(steps.tolist())) == list(range(len(got)))
    per_epoch = len(got) // 2
    for s, batch in enumerate(got):
        at = steps == s
        assert np.array(t["record_key"])[at].tolist() == truth_of(batch, by_tokens)
        want_epoch = s // per_epoch if kind in ("distributed", "stateful") else -1
        assert set(np.array(t["epoch"])[at].tolist()) == {want_epoch}
    assert set(t["n_tokens"]) == {SEQ}  # the padding mask left the padding out
    assert set(t["host"]) == {host}
    # Hashes from the rows' tokens are the manifest's: the integrity check holds.
    want = {i: content_hash(record_tokens(i)) for i in range(n)}
    assert all(want[k] == h for k, h in zip(t["record_key"], t["content_hash"], strict=True))


def test_key_of_and_hash_sources(tmp_path):
    n = 40
    m = manifest(tmp_path / "m.parquet", n)
    runs = {}
    for name, opts in {"batch": {"mask_field": "attention_mask"},
                       "source": {"content": "source"},
                       "manifest": {"hashes": m}}.items():
        loader = tally_torch.audited(make_loader(0, 1, "sequential", n), tmp_path / name, "r",
                                     host=0, host_count=1, fsync=False, **opts)
        run_epochs(loader, 1)
        loader.writer.close()
        runs[name] = spool_table(tmp_path / name, "r")
    assert runs["manifest"].equals(runs["batch"])
    # Read again from the dataset: the padded row as the dataset stores it (SEQ + 2 tokens).
    assert set(runs["source"]["n_tokens"].to_pylist()) == {SEQ + 2}
    assert runs["source"]["record_key"].equals(runs["batch"]["record_key"])
    loader = tally_torch.audited(make_loader(0, 1, "sequential", n), tmp_path / "k", "r",
                                 host=0, host_count=1, key_of=lambda i: i + 1000,
                                 mask_field="attention_mask", start_step=50, fsync=False)
    run_epochs(loader, 1)
    loader.writer.close()
    t = spool_table(tmp_path / "k", "r")
    assert t["record_key"].to_pylist() == [i + 1000 for i in range(n)]
    assert t["step"].to_pylist()[0] == 50


def test_refused_in_one_line(tmp_path):
    ds = Records(10)
    cases = [(DataLoader(Stream(), batch_size=2), "IterableDataset"),
             (DataLoader(ds, batch_size=None), "batch_size=None"),
             (DataLoader(ds, batch_size=2, num_workers=1, in_order=False), "in_order=False")]
    for loader, says in cases:
        with pytest.raises(AttachError, match=says):
            tally_torch.audited(loader, tmp_path, "r", host=0, host_count=1)
    with pytest.raises(AttachError, match="host="):
        tally_torch.audited(DataLoader(ds, batch_size=2), tmp_path, "r")
    with pytest.raises(AttachError, match="generator"):
        tally_torch.check_deterministic(DataLoader(ds, batch_size=2, shuffle=True))


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_restore_continues_keys_and_steps(tmp_path, workers):
    """Saved mid-epoch 1 (of 0, 1, 2), restored in a new loader: the restored run's rows
    (another spool) and the rows before the save are, together, the uninterrupted run's."""
    n, hosts, host, cut = 101, 2, 1, 19  # 13 batches an epoch: the cut is inside epoch 1

    def fresh():
        return make_loader(host, hosts, "stateful", n, workers)

    whole = tally_torch.audited(fresh(), tmp_path / "whole", "r", host=host, host_count=hosts,
                                mask_field="attention_mask", fsync=False)
    run_epochs(whole, 3)
    whole.writer.close()

    first = tally_torch.audited(fresh(), tmp_path / "a", "r", host=host, host_count=hosts,
                                mask_field="attention_mask", fsync=False)
    sampler, k = first.sampler, 0
    for e in range(3):
        sampler.set_epoch(e)
        for _ in first:
            k += 1
            if k == cut:
                break
        if k == cut:
            break
    state = first.state_dict()
    assert state[tally_torch.STATE_KEY] == 13  # epoch 1 began at step 13
    first.writer.close()
    state = json.loads(json.dumps(state))  # what a checkpoint keeps

    second = tally_torch.audited(fresh(), tmp_path / "b", "r", host=host, host_count=hosts,
                                 mask_field="attention_mask", fsync=False)
    second.load_state_dict(state)
    for e in (1, 2):
        second.sampler.set_epoch(e)
        for _ in second:
            pass
    second.writer.close()
    both = pa.concat_tables([spool_table(tmp_path / "a", "r"), spool_table(tmp_path / "b", "r")])
    assert both.equals(spool_table(tmp_path / "whole", "r"))


def test_replay_equals_live_row_for_row(tmp_path):
    """`tally replay` with a torch loader factory: the live spool row for row, from the
    beginning (two epochs, set_epoch between) and from saved StatefulDataLoader states."""
    n, hosts, steps = 203, 3, 30  # 17 batches an epoch
    for h in range(hosts):
        loader = tally_torch.audited(make_loader(h, hosts, "distributed", n), tmp_path / "live",
                                     "r", host=h, host_count=hosts,
                                     mask_field="attention_mask", fsync=False)
        run_epochs(loader, 2, steps)
        loader.writer.close()
    m = manifest(tmp_path / "m.parquet", n)
    env = {"TALLY_TEST_KIND": "distributed", "TALLY_TEST_N": str(n)}
    r = tally("replay", "--loader", "tests.test_torch_loader:make_loader", "--hosts", str(hosts),
              "--steps", str(steps), "--spool", str(tmp_path / "replay"), "--run", "r",
              "--manifest", str(m), "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rows"] == hosts * steps * 4
    assert spool_table(tmp_path / "replay", "r").equals(spool_table(tmp_path / "live", "r"))

    # From saved states (StatefulDataLoader, mid-epoch 0): the rest of the live run.
    states = tmp_path / "states"
    states.mkdir()
    for h in range(hosts):
        loader = tally_torch.audited(make_loader(h, hosts, "stateful", n), tmp_path / "s-live",
                                     "r", host=h, host_count=hosts,
                                     mask_field="attention_mask", fsync=False)
        it = iter(loader)
        for _ in range(5):
            next(it)
        (states / f"dataloader_{h}-of-{hosts}.json").write_text(json.dumps(loader.state_dict()))
        for _ in it:
            pass
        loader.writer.close()
    from tally.pipeline.replay import ReplaySpec, replay  # in process: the CLI was run above

    os.environ.update({**env, "TALLY_TEST_KIND": "stateful"})
    try:
        done = replay(ReplaySpec(loader="tests.test_torch_loader:make_loader", hosts=hosts,
                                 steps=12, spool=tmp_path / "s-replay", run_id="r", manifest=m,
                                 states=states, fsync=False))
    finally:
        os.environ.pop("TALLY_TEST_KIND")
        os.environ.pop("TALLY_TEST_N")
    assert [h.first_step for h in done] == [5] * hosts
    live = spool_table(tmp_path / "s-live", "r")
    live = live.filter(pa.compute.greater_equal(live["step"], 5))
    assert spool_table(tmp_path / "s-replay", "r").equals(live)


def reconcile(spool: Path, m: Path, out: Path) -> dict:
    r = tally("reconcile", "--spool", str(spool), "--manifest", str(m), "--run", "r", "-o",
              str(out), "-q", "--json")
    assert r.returncode in (0, 1), r.stderr
    return json.loads((out / "report.json").read_text())


def test_distributed_sampler_padding_named_and_clean_setup_passes(tmp_path):
    """DistributedSampler(drop_last=False) over 203 records on 4 ranks pads each epoch to 204
    with the permutation's first record again: reconcile names `padding` with that count (one a
    epoch, two over two epochs). 200 records on 4 ranks (a multiple) is PASS."""
    hosts, epochs = 4, 2
    for n, name in ((203, "padded"), (200, "clean")):
        for h in range(hosts):
            loader = tally_torch.audited(make_loader(h, hosts, "distributed", n),
                                         tmp_path / name, "r", host=h, host_count=hosts,
                                         mask_field="attention_mask", fsync=False)
            run_epochs(loader, epochs)
            loader.writer.finish()
        manifest(tmp_path / f"{name}.parquet", n)
    pad = 4 - 203 % 4  # DistributedSampler's padding per epoch: 1 record
    rep = reconcile(tmp_path / "padded", tmp_path / "padded.parquet", tmp_path / "rp")
    codes = {f["code"]: f for f in rep["findings"]}
    assert rep["verdict"] == "FAIL" and "padding" in codes, rep["findings"]
    assert codes["padding"]["numbers"]["duplicates"] == pad * epochs, codes["padding"]
    assert rep["coverage"]["epoch_duplicate_records"] <= pad * epochs
    assert rep["coverage"]["never_seen"] == 0
    ok = reconcile(tmp_path / "clean", tmp_path / "clean.parquet", tmp_path / "rc")
    assert ok["verdict"] == "PASS", ok["findings"]
    assert ok["coverage"]["never_seen"] == 0 and ok["coverage"]["epoch_duplicates"] == 0


def test_distributed_samplers_that_share_shards_are_named_and_many_epochs_pass(tmp_path):
    """Four hosts whose DistributedSamplers share shards. `local`: 2 nodes x 2 ranks given
    the rank within the node (LOCAL_RANK, num_replicas=4): hosts 0 and 2 read shard 0, hosts
    1 and 3 shard 1, shards 2 and 3 never, every epoch. `replicas`: num_replicas=2 with rank
    h // 2 (as tensor-parallel pairs audited as hosts of their own would write): hosts 0 and 1
    read one half, 2 and 3 the other, so every record is read twice an epoch and none is left
    out. `shared_shard` names the groups, and which of the two it is, over 2 and 3 epochs (the
    loop sets each epoch). The clean trap beside them: the right ranks for 12 epochs over 200
    records, where every host reads nearly every record and all pairs of hosts overlap: PASS."""
    hosts = 4
    cases = {"local": (400, 2, 4, lambda h: h % 2), "replicas": (400, 3, 2, lambda h: h // 2),
             "clean": (200, 12, 4, lambda h: h)}
    for name, (n, epochs, replicas, rank) in cases.items():
        ds = Records(n)
        for h in range(hosts):
            dl = DataLoader(ds, batch_size=4, sampler=DistributedSampler(
                ds, num_replicas=replicas, rank=rank(h), shuffle=True, seed=3))
            loader = tally_torch.audited(dl, tmp_path / name, "r", host=h, host_count=hosts,
                                         mask_field="attention_mask", fsync=False)
            run_epochs(loader, epochs)
            loader.writer.finish()
        manifest(tmp_path / f"{name}.parquet", n)
    for name, groups, why, dups in (
            ("local", [[0, 2], [1, 3]], "the shards those hosts were meant to read are not "
             "read at all", 2 * 400 // 2),
            ("replicas", [[0, 1], [2, 3]], "every record was still read", 3 * 800 // 2)):
        rep = reconcile(tmp_path / name, tmp_path / f"{name}.parquet", tmp_path / f"r{name}")
        shared = [f for f in rep["findings"] if f["code"] == "shared_shard"]
        assert rep["verdict"] == "FAIL" and len(shared) == 1, (name, rep["findings"])
        assert shared[0]["numbers"]["groups"] == groups and why in shared[0]["message"]
        assert rep["coverage"]["epoch_duplicates"] == dups  # half of each epoch's exposures
        assert {f["code"] for f in rep["findings"]} <= {"shared_shard", "final_epoch_short"}
    ok = reconcile(tmp_path / "clean", tmp_path / "clean.parquet", tmp_path / "rc")
    assert ok["verdict"] == "PASS" and ok["findings"] == [], ok["findings"]
    overlap = ok["hosts"]["overlap_matrix"]
    assert min(overlap[i][j] for i in range(hosts) for j in range(hosts)) > 0.9 * 200


@pytest.mark.parametrize("batch_drop, records, hosts, epochs", [
    (False, 3, 4, 3), (True, 11, 4, 3), (True, 3, 2, 12)])
def test_drop_last_samplers_are_a_warning_over_many_epochs(tmp_path, batch_drop, records,
                                                           hosts, epochs):
    """DistributedSampler(drop_last=True) on 4 ranks over 203 records trims each epoch to 200
    (203 mod 4 = 3 left out, others each epoch), and a DataLoader(drop_last=True) of 4 on top
    of it leaves 11 out (203 mod 16). Over 3 epochs some records are left out twice and fall
    below the ideal: that is the samplers' design, named `drop_remainder` (WARN) with its unit,
    never `epoch_skipped` or uneven exposure (a FAIL before). On 2 ranks over 12 epochs every
    record has been read on both hosts: never `no_sharding` (a FAIL before), which would
    repeat every record within each epoch."""
    n = 203
    ds = Records(n)
    for h in range(hosts):
        dl = DataLoader(ds, batch_size=4, drop_last=batch_drop, sampler=DistributedSampler(
            ds, num_replicas=hosts, rank=h, shuffle=True, seed=3, drop_last=True))
        loader = tally_torch.audited(dl, tmp_path / "spool", "r", mask_field="attention_mask",
                                     fsync=False)
        run_epochs(loader, epochs)
        loader.writer.finish()
    rep = reconcile(tmp_path / "spool", manifest(tmp_path / "m.parquet", n), tmp_path / "rep")
    assert rep["verdict"] == "WARN", rep["findings"]
    (f,) = [f for f in rep["findings"] if f["code"] == "drop_remainder"]
    assert f["numbers"] == {"epochs": epochs - 1, "records": records, "same_records": False}
    unit = (f"global batch of {4 * hosts}" if batch_drop else "host count of 4")
    assert f"do not divide by the {unit}" in f["message"]
    assert {f["code"] for f in rep["findings"]} == {"drop_remainder", "final_epoch_short"}


def test_a_sampler_whose_set_epoch_is_never_called_passes_each_epoch_as_its_own(tmp_path):
    """DistributedSampler on 2 ranks over 3 passes without set_epoch (torch's documented
    pitfall: the same order every epoch): every record is still read once a pass. The
    sampler's epoch stays 0, which read as every record repeated 3 times within epoch 0 (FAIL);
    each pass after a whole one is now recorded as the next epoch, with a warning: PASS."""
    n, hosts = 202, 2  # no padding
    ds = Records(n)
    for h in range(hosts):
        sampler = DistributedSampler(ds, num_replicas=hosts, rank=h, shuffle=True, seed=3)
        loader = tally_torch.audited(DataLoader(ds, batch_size=4, sampler=sampler),
                                     tmp_path / "spool", "r", mask_field="attention_mask",
                                     fsync=False)
        with pytest.warns(UserWarning, match=r"call sampler.set_epoch\(epoch\)"):
            for _ in range(3):
                list(loader)
        loader.writer.finish()
    epochs = sorted(set(spool_table(tmp_path / "spool")["epoch"].to_pylist()))
    assert epochs == [0, 1, 2]
    rep = reconcile(tmp_path / "spool", manifest(tmp_path / "m.parquet", n), tmp_path / "rep")
    assert rep["verdict"] == "PASS", rep["findings"]
    assert rep["coverage"]["epoch_duplicates"] == 0 and rep["findings"] == []


class _HostStream(IterableDataset):
    """Host `rank`'s share of `n` records, reshuffled each epoch, as dicts of key and epoch;
    split between the DataLoader's workers only when `split_workers`."""

    def __init__(self, n: int, rank: int, world: int, split_workers: bool,
                 shuffle_in_worker: bool = False) -> None:
        self.n, self.rank, self.world, self.split, self.epoch = n, rank, world, split_workers, 0
        self.shuffle = shuffle_in_worker

    def __iter__(self):
        keys = np.random.default_rng(self.epoch).permutation(self.n)[self.rank::self.world]
        info = get_worker_info()
        if self.split and info is not None:
            keys = keys[info.id::info.num_workers]
        if self.shuffle:  # torch seeds each worker's generator apart
            keys = keys[torch.randperm(len(keys)).numpy()]
        for k in keys.tolist():
            yield {"key": k, "epoch": self.epoch}


@pytest.mark.parametrize("workers, shuffled", [(2, False), (3, False), (2, True)])
def test_an_iterable_dataset_copied_into_every_worker_is_named(tmp_path, workers, shuffled):
    """An IterableDataset that does not split its records between a DataLoader's workers (the
    torch pitfall): each worker makes the host's whole share. In one order, the loader hands
    their identical batches out in turn: reconcile names the lockstep repeats as the workers'
    copies (`repeated_batches` with the worker count), not a stalled pipeline. Each worker
    shuffling its copy: every record W times in its epoch, on its host (`worker_copies`), not
    bare within-epoch repeats. The same dataset split by get_worker_info() passes."""
    n, hosts = 200, 2  # whole batches of 4 (two copies' last short batches may agree)
    for name, split in (("copies", False), ("split", True)):
        for h in range(hosts):
            ds = _HostStream(n, h, hosts, split, shuffle_in_worker=shuffled and not split)
            loader = DataLoader(ds, batch_size=4, num_workers=workers,  # workers' seeds
                                generator=torch.Generator().manual_seed(h))
            with LedgerWriter(tmp_path / name, "r", host=h, host_count=hosts,
                              records_per_epoch=n, fsync=False) as w:
                step = 0
                for epoch in range(2):
                    ds.epoch = epoch
                    for batch in loader:
                        keys = batch["key"].numpy()
                        w.write_segments(step, Segments.build(
                            row=np.arange(len(keys)), record_key=keys,
                            n_tokens=np.full(len(keys), SEQ), epoch=batch["epoch"].numpy(),
                            content_hash=np.array([content_hash(record_tokens(int(k)))
                                                   for k in keys], np.uint64)))
                        step += 1
                w.finish()
    m = manifest(tmp_path / "m.parquet", n)
    ok = reconcile(tmp_path / "split", m, tmp_path / "r-split")
    assert ok["verdict"] == "PASS", ok["findings"]
    bad = reconcile(tmp_path / "copies", m, tmp_path / "r-copies")
    found = [f for f in bad["findings"] if f["severity"] == "FAIL"]
    if shuffled:
        (f,) = found
        assert f["code"] == "worker_copies" and f["numbers"]["workers"] == workers, found
        assert f"makes {workers} copies of its share" in f["message"]
        return
    assert {f["code"] for f in found} == {"repeated_batches"}, bad["findings"]
    assert sorted(f["numbers"]["host"] for f in found) == list(range(hosts))
    for f in found:
        assert f["numbers"]["workers"] == workers
        assert f"its DataLoader's {workers} workers each make the same batches" in f["message"]
        # 2 epochs of 25 batches a worker: 50 runs of repeats, 16 of them listed
        assert len(f["numbers"]["ranges"]) == 16 and f["numbers"]["ranges_in_all"] == 50


def test_attach_cost_benchmark_runs():
    from bench import torch_attach_cost

    res = torch_attach_cost.main(["--batches", "5", "--steps", "2", "--step-ms", "1"])
    assert res["plain_ms"] > 0 and res["audited_ms"] > 0 and res["loop_ratio"] > 0
