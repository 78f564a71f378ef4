"""Lightning's litdata audited live and replayed (pipeline.loaders.litdata_loader), with the real
package.

A dataset written by litdata's own chunk writer (`Cache`, what `litdata.optimize` uses) carries
each sample's `index` (its global index): the batches an audited StreamingDataLoader hands out
are those of an unaudited one, and the record keys of each step are the indices its batch holds,
on 1 and 2 ranks, with and without workers, over two epochs; a loader restored from
`state_dict()` continues keys and steps; `litdata_loader.replay` from nothing and from a saved
state equals the live spool row for row. Ranks that litdata does not see as ranks (litdata
issue #411: no torch.distributed group and no WORLD_SIZE / GLOBAL_RANK, so each believes it is
alone) each read the whole dataset: `tally reconcile` names it (`no_sharding`, with its
numbers); the same ranks with the env vars litdata reads are PASS.

Ranks without a cluster: litdata freezes its topology when the dataset is made, from
torch.distributed or WORLD_SIZE / GLOBAL_RANK, so each rank's dataset is made in turn in this
process under that rank's env vars, and runs litdata's own partition code.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("torch")
pytest.importorskip("litdata")

from litdata import StreamingDataLoader, StreamingDataset  # noqa: E402
from litdata.streaming.cache import Cache  # noqa: E402

from audit.core.hashing import content_hash  # noqa: E402
from pipeline.loaders import AttachError  # noqa: E402
from pipeline.loaders import litdata_loader as tally_litdata  # noqa: E402
from pipeline.loaders.replayed import ReplayError  # noqa: E402
from pipeline.manifest_file import write_manifest_table  # noqa: E402

N, L, BS, SEED = 192, 16, 4, 3


def tokens_of(i: int) -> np.ndarray:
    return ((np.arange(L) * 31 + i * 7) % 50_000).astype(np.int32)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """N samples (index, input_ids) in chunks of 23 (uneven over workers), and a manifest of
    the same token arrays keyed by the global index."""
    root = tmp_path_factory.mktemp("litdata")
    cache = Cache(str(root / "data"), chunk_size=23)
    for i in range(N):
        cache[i] = {"index": i, "input_ids": tokens_of(i)}
    cache.done()
    cache.merge()
    keys = np.arange(N)
    write_manifest_table(pa.table({
        "record_key": keys,
        "content_hash": np.array([content_hash(tokens_of(i)) for i in range(N)], np.uint64),
        "n_tokens": np.full(N, L, np.int32), "domain": ["web"] * N, "split": ["train"] * N,
        "source": ["litdata"] * N, "source_index": keys}), root / "m.parquet")
    return root


@contextlib.contextmanager
def as_rank(rank: int | None, world: int | None, rank_var: str = "GLOBAL_RANK"):
    """The env vars litdata's _DistributedEnv.detect reads (None: none of them set);
    `rank_var="RANK"`: torchrun's, which litdata does not read."""
    names = ("WORLD_SIZE", "GLOBAL_RANK", "NNODES", "RANK")
    old = {k: os.environ.pop(k, None) for k in names}
    if world is not None:
        os.environ.update({"WORLD_SIZE": str(world), rank_var: str(rank)})
    try:
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def make_loader(data: Path, workers: int) -> StreamingDataLoader:
    ds = StreamingDataset(str(data / "data"), shuffle=True, seed=SEED)
    return StreamingDataLoader(ds, batch_size=BS, num_workers=workers)


def spool_table(spool: Path, run: str = "r") -> pa.Table:
    files = sorted(Path(spool, run).rglob("seg-*.parquet"))
    t = pa.concat_tables([pq.read_table(f, partitioning=None) for f in files])
    cols = ["step", "host", "row", "record_key", "content_hash", "n_tokens", "epoch"]
    return t.select(cols).sort_by([("step", "ascending"), ("host", "ascending"),
                                   ("row", "ascending")])


def reconcile(spool: Path, m: Path, out: Path) -> dict:
    from audit.cli import main

    rc = main(["reconcile", "--spool", str(spool), "--manifest", str(m), "--run", "r", "-o",
               str(out), "-q", "--json"])
    assert rc in (0, 1)
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (2, 3)])
def test_live_batches_unchanged_keys_are_the_indices(tmp_path, data, world, workers):
    """Two epochs on every rank: the audited loader's batches are an unaudited one's; each
    step's record keys are the indices its batch holds (ground truth); every index at most
    once an epoch over the ranks; the hashes of the batch's tokens are the manifest's."""
    seen: list[Counter] = [Counter(), Counter()]
    for rank in range(world):
        with as_rank(rank, world):
            plain = make_loader(data, workers)
            want = [[b["index"].numpy().copy() for b in plain] for _ in range(2)]
            loader = tally_litdata.audited(make_loader(data, workers), tmp_path / "s", "r",
                                           fsync=False)
        assert (loader.writer.host, loader.writer.host_count) == (rank, world)
        got = []
        for epoch in range(2):
            batches = list(loader)
            assert len(batches) == len(want[epoch])
            for b, w in zip(batches, want[epoch], strict=True):
                assert np.array_equal(b["index"].numpy(), w)
                assert np.array_equal(b["input_ids"].numpy(),
                                      np.stack([tokens_of(i) for i in w]))
                seen[epoch].update(w.tolist())
            got += [b["index"].numpy() for b in batches]
        assert not np.array_equal(np.concatenate(want[0]), np.concatenate(want[1]))  # reshuffled
        loader.writer.close()
        t = spool_table(tmp_path / "s")
        t = t.filter(pa.compute.equal(t["host"], rank))
        steps = t["step"].to_numpy()
        assert sorted(set(steps.tolist())) == list(range(len(got)))
        for step, ids in enumerate(got):
            assert np.array_equal(t["record_key"].to_numpy()[steps == step], ids)
        epochs = t["epoch"].to_numpy()
        first = sum(len(b) for b in want[0])
        assert set(epochs[:first]) == {0} and set(epochs[first:]) == {1}
    for c in seen:
        assert set(c.values()) == {1} and len(c) > N - world * max(1, workers) * BS
    m = pq.read_table(data / "m.parquet")
    t = spool_table(tmp_path / "s")
    assert np.array_equal(t["content_hash"].to_numpy(),
                          m["content_hash"].to_numpy()[t["record_key"].to_numpy()])


def test_restore_continues_and_replay_equals_live(tmp_path, data):
    """Two ranks, two workers, two epochs, the state_dict() saved at step 7: a loader restored
    from it writes the whole run's rows from step 7 on (keys, steps, epochs); `replay` (a fresh
    dataset in one process, the topology given) from nothing and from each rank's state
    writes the live spool's rows, marked replayed."""
    world, workers, stop = 2, 2, 7
    states = {}
    for rank in range(world):
        with as_rank(rank, world):
            loader = tally_litdata.audited(make_loader(data, workers), tmp_path / "live", "r",
                                           fsync=False)
            again = tally_litdata.audited(make_loader(data, workers), tmp_path / "again", "r",
                                          fsync=False)
        for k, _ in enumerate(loader):
            if k + 1 == stop:
                states[rank] = loader.state_dict()
        list(loader)  # and epoch 2
        loader.writer.close()
        with as_rank(rank, world):  # litdata's load_state_dict detects the world again
            again.load_state_dict(states[rank])
        list(again)  # the rest of epoch 1
        list(again)  # epoch 2
        again.writer.close()
    assert states[0][tally_litdata.STEP_KEY] == stop
    assert states[0]["num_samples_yielded"] == stop * BS
    live = spool_table(tmp_path / "live")
    assert spool_table(tmp_path / "again").equals(
        live.filter(pa.compute.greater_equal(live["step"], stop)))
    steps = int(live["step"].to_numpy().max()) + 1
    for name, first in (("all", 0), ("mid", stop)):
        for rank in range(world):
            with as_rank(None, None):  # replay: no cluster, the topology given
                ds = StreamingDataset(str(data / "data"), shuffle=True, seed=SEED)
            done = tally_litdata.replay(
                ds, tmp_path / name, "r", host=rank, world_size=world, workers=workers,
                batch_size=BS, steps=steps - first, hashes=data / "m.parquet", fsync=False,
                state=states[rank] if first else None)
            assert done.first_step == first and done.last_step == steps - 1
        want = live.filter(pa.compute.greater_equal(live["step"], first))
        assert spool_table(tmp_path / name).equals(want), name
        meta = pq.read_schema(next((tmp_path / name).rglob("seg-*.parquet"))).metadata
        assert meta[b"tally.replayed"] == b"1"


def test_ranks_litdata_does_not_see_named_and_seen_ranks_pass(tmp_path, data):
    """Two ranks whose launcher set neither torch.distributed nor WORLD_SIZE / GLOBAL_RANK
    (litdata #411): each rank's dataset believes world size 1 and reads all N samples, so the
    epoch reads every record twice, once per host: reconcile names `no_sharding` (2 hosts, N
    of N records shared). With torchrun's RANK (not read) and WORLD_SIZE, both ranks believe
    they are rank 0 and read its half twice: `no_sharding` (N/2 of N/2 shared) and the other
    half never (`final_epoch_short`). The same ranks with litdata's env vars read disjoint
    shares: PASS."""
    world = 2
    for name, env_world, var in (("unseen", None, ""), ("seen", world, "GLOBAL_RANK"),
                                 ("torchrun", world, "RANK")):
        for rank in range(world):
            with as_rank(rank, env_world, var):
                loader = tally_litdata.audited(make_loader(data, 2), tmp_path / name, "r",
                                               host=rank, host_count=world, fsync=False)
            list(loader)
            loader.writer.finish()
    ok = reconcile(tmp_path / "seen", data / "m.parquet", tmp_path / "rs")
    assert ok["verdict"] == "PASS", ok["findings"]
    bad = reconcile(tmp_path / "unseen", data / "m.parquet", tmp_path / "ru")
    codes = {f["code"]: f for f in bad["findings"]}
    assert bad["verdict"] == "FAIL" and "no_sharding" in codes, bad["findings"]
    assert codes["no_sharding"]["numbers"]["hosts"] == world
    assert f"{N} of {N} shared" in codes["no_sharding"]["message"]
    assert bad["coverage"]["epoch_duplicate_records"] == N
    assert bad["coverage"]["histogram"]["2"] == N and bad["coverage"]["never_seen"] == 0
    half = reconcile(tmp_path / "torchrun", data / "m.parquet", tmp_path / "rt")
    codes = {f["code"]: f for f in half["findings"]}
    assert half["verdict"] == "FAIL" and {"no_sharding", "final_epoch_short"} <= set(codes)
    assert f"{N // 2} of {N // 2} shared" in codes["no_sharding"]["message"]
    assert half["coverage"]["never_seen"] == N // 2


def test_refused_in_one_line(tmp_path, data):
    """A plain DataLoader, and a resume on another worker count (litdata's elastic
    restripe), are refused with one line; so is a replay from such a state."""
    from torch.utils.data import DataLoader

    with pytest.raises(AttachError, match="StreamingDataLoader"):
        tally_litdata.audited(DataLoader(list(range(8)), batch_size=2), tmp_path, "r", host=0,
                              host_count=1)
    with as_rank(None, None):
        loader = tally_litdata.audited(make_loader(data, 0), tmp_path / "a", "r", fsync=False)
        other = tally_litdata.audited(make_loader(data, 2), tmp_path / "b", "r", fsync=False)
    for k, _ in enumerate(loader):
        if k == 4:
            state = loader.state_dict()
            break
    other.load_state_dict(state)
    with pytest.raises(AttachError, match="1 workers.*2 workers"):
        list(other)
    with as_rank(None, None):
        ds = StreamingDataset(str(data / "data"), shuffle=True, seed=SEED)
    with pytest.raises(ReplayError, match="elastic"):
        tally_litdata.replay(ds, tmp_path / "c", "r", host=0, world_size=1, workers=2,
                             batch_size=BS, steps=3, hashes=data / "m.parquet", state=state)
