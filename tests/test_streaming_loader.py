"""MosaicML Streaming audited live and replayed (tally.pipeline.loaders.mosaic), with the real
package.

An MDS dataset written by streaming's MDSWriter carries each sample's `id` (its index in the
dataset): the batches an audited StreamingDataLoader hands out are those of an unaudited one,
and the record keys of each step are the ids the batch holds, on 1 and 2 ranks, with and
without workers, over two epochs and across a restore; the keys and hashes are those of
`tally manifest DIR --tokens-field input_ids`. Replay from a saved state_dict() equals the live
spool row for row. A resume that forgets load_state_dict repeats the samples already consumed:
`tally reconcile` names them with their count; the resume done right is PASS.

Ranks without a cluster: streaming reads its topology from RANK / WORLD_SIZE /
LOCAL_WORLD_SIZE and initializes torch.distributed itself unless it already is; a one-process
gloo group (made here) and LOCAL_WORLD_SIZE=1 let each rank (its own node) run in turn in this
process, on streaming's own partition code. `import streaming` fails in this venv (its eager
streaming.vision import); the adapter's `streaming_module` imports the submodules it needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# MosaicML Streaming loaders with worker processes over MDS shards, replayed and reconciled.
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

from tally.pipeline.loaders import AttachError, mosaic  # noqa: E402
from tests.support.cli import tally  # noqa: E402
from tests.support.spool import spool_table  # noqa: E402
from tests.test_corpus_formats import mds_writer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N, L, BS, SEED, NCN = 200, 16, 4, 3, 2


def tokens_of(i: int) -> np.ndarray:
    return ((np.arange(L) * 31 + i * 7) % 50_000).astype(np.int32)


@pytest.fixture(scope="module")
def mds(tmp_path_factory) -> Path:
    """N samples (id, input_ids) over several shards, and Tally's manifest of them."""
    root = tmp_path_factory.mktemp("mds")
    with mds_writer()(columns={"id": "int64", "input_ids": f"ndarray:int32:{L}"},
                      out=str(root / "data"), size_limit=1500) as w:
        for i in range(N):
            w.write({"id": i, "input_ids": tokens_of(i)})
    r = tally("manifest", str(root / "data"), "-o", str(root / "m.parquet"), "-q",
              "--tokens-field", "input_ids", "--id-field", "id")
    assert r.returncode == 0, r.stderr
    return root


@pytest.fixture(scope="module")
def one_process_group():
    import torch.distributed as dist

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if made:
        dist.destroy_process_group()


@contextlib.contextmanager
def as_rank(rank: int, world: int):
    names = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")
    old = {k: os.environ.get(k) for k in names}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1",
                      LOCAL_RANK="0")
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def streaming_classes() -> tuple[type, type]:
    return (mosaic.streaming_module("streaming.base.dataset").StreamingDataset,
            mosaic.streaming_module("streaming.base.dataloader").StreamingDataLoader)


def make_loader(mds: Path, workers: int, batch_size: int = BS, ncn: int = NCN) -> object:
    dataset_cls, loader_cls = streaming_classes()
    ds = dataset_cls(local=str(mds / "data"), batch_size=batch_size, shuffle=True,
                     shuffle_seed=SEED, num_canonical_nodes=ncn)
    return loader_cls(ds, batch_size=batch_size, num_workers=workers)


def reconcile(spool: Path, m: Path, out: Path) -> dict:
    r = tally("reconcile", "--spool", str(spool), "--manifest", str(m), "--run", "r", "-o",
              str(out), "-q", "--json")
    assert r.returncode in (0, 1), r.stderr
    return json.loads((out / "report.json").read_text())


def test_streaming_module_imports_beside_a_broken_package_init():
    """`import streaming` fails here; the adapter still reaches streaming's real classes, also
    after mds_writer() registered streaming's packages bare (a fresh interpreter)."""
    code = ("import sys\n"
            "from tests.test_corpus_formats import mds_writer\n"
            "mds_writer()\n"
            "assert not getattr(sys.modules['streaming.base'], '__file__', None)\n"
            "from tally.pipeline.loaders import mosaic\n"
            "ds = mosaic.streaming_module('streaming.base.dataset').StreamingDataset\n"
            "dl = mosaic.streaming_module('streaming.base.dataloader').StreamingDataLoader\n"
            "import torch.utils.data as tud\n"
            "assert ds.__module__ == 'streaming.base.dataset' and issubclass(dl, tud.DataLoader)\n"
            "try:\n"
            "    import streaming.vision\n"
            "    print('vision imports')\n"
            "except Exception:\n"
            "    print('vision fails')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    dataset_cls, loader_cls = streaming_classes()  # and in this process, whatever came first
    assert issubclass(loader_cls, torch.utils.data.DataLoader)


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (2, 2), (2, 3)])
def test_live_batches_unchanged_keys_are_the_sample_ids(tmp_path, mds, one_process_group,
                                                         world, workers):
    """Two epochs on every rank: the audited loader's batches are an unaudited one's; each
    step's record keys are the ids its batch holds (ground truth); every id once an epoch
    over the ranks; keys are the manifest's (its doc_id is the sample's id) and so are the
    hashes of the batch's tokens."""
    seen: list[Counter] = [Counter(), Counter()]
    for rank in range(world):
        with as_rank(rank, world):
            plain = make_loader(mds, workers)
            want = [[b["id"].numpy().copy() for b in plain] for _ in range(2)]
            del plain
            loader = mosaic.audited(make_loader(mds, workers), tmp_path / "s", "r", fsync=False)
            assert (loader.writer.host, loader.writer.host_count) == (rank, world)
            got = []
            for epoch in range(2):
                batches = list(loader)
                assert len(batches) == len(want[epoch])
                for b, w in zip(batches, want[epoch], strict=True):
                    assert np.array_equal(b["id"].numpy(), w)
                    assert np.array_equal(b["input_ids"].numpy(),
                                          np.stack([tokens_of(i) for i in w]))
                    seen[epoch].update(w.tolist())
                got += [b["id"].numpy() for b in batches]
            loader.writer.close()
            del loader
        t = spool_table(tmp_path / "s")
        t = t.filter(pa.compute.equal(t["host"], rank))
        steps = t["step"].to_numpy()
        assert sorted(set(steps.tolist())) == list(range(len(got)))
        for step, ids in enumerate(got):
            assert np.array_equal(t["record_key"].to_numpy()[steps == step], ids)
        epochs = t["epoch"].to_numpy()
        assert set(epochs[steps < len(want[0])]) == {0} and set(epochs[steps >= len(want[0])]) \
            == {1}
    for c in seen:
        assert sorted(c) == list(range(N)) and set(c.values()) == {1}
    m = pq.read_table(mds / "m.parquet")
    assert m["record_key"].to_pylist() == list(range(N))
    assert m["doc_id"].to_pylist() == [str(i) for i in range(N)]
    t = spool_table(tmp_path / "s")
    keys = t["record_key"].to_numpy()
    assert np.array_equal(t["content_hash"].to_numpy(),
                          m["content_hash"].to_numpy()[keys])


def test_replay_from_state_equals_live_row_for_row(tmp_path, mds, one_process_group):
    """Two ranks, two workers: the live run from the beginning, and its state_dict() saved at
    step 7; `mosaic.replay` (a fresh dataset in one process, the topology given) from nothing
    and from each rank's state writes the live spool's rows, marked replayed."""
    world, workers, stop = 2, 2, 7
    states = {}
    for rank in range(world):
        with as_rank(rank, world):
            loader = mosaic.audited(make_loader(mds, workers), tmp_path / "live", "r",
                                    fsync=False)
            for k, _ in enumerate(loader):
                if k + 1 == stop:
                    states[rank] = loader.state_dict()
            for _ in loader:  # and epoch 1
                pass
            loader.writer.close()
            del loader
    assert states[0]["sample_in_epoch"] == stop * BS * world
    assert states[0][mosaic.STEP_KEY] == stop
    live = spool_table(tmp_path / "live")
    steps = int(live["step"].to_numpy().max()) + 1
    for name, state, first in (("all", None, 0), ("mid", states, stop)):
        for rank in range(world):
            dataset_cls, _ = streaming_classes()
            ds = dataset_cls(local=str(mds / "data"), batch_size=BS, shuffle=True,
                             shuffle_seed=SEED, num_canonical_nodes=NCN)
            done = mosaic.replay(ds, tmp_path / name, "r", host=rank, num_nodes=world,
                                 ranks_per_node=1, workers=workers, batch_size=BS,
                                 steps=steps - first, hashes=mds / "m.parquet",
                                 state=None if state is None else state[rank], fsync=False)
            assert done.first_step == first and done.last_step == steps - 1
            del ds
        want = live.filter(pa.compute.greater_equal(live["step"], first))
        assert spool_table(tmp_path / name).equals(want), name
        meta = pq.read_schema(next((tmp_path / name).rglob("seg-*.parquet"))).metadata
        assert meta[b"tally.replayed"] == b"1"


def resume(tmp_path: Path, mds: Path, name: str, *, load_state: bool, world: int = 2,
           stop: int = 10) -> None:
    """Each rank trains `stop` steps and checkpoints; a second attempt resumes from step
    `stop` to the end of the epoch, loading the saved loader state or not."""
    from tally.audit.hook.writer import LedgerWriter

    for rank in range(world):
        with as_rank(rank, world):
            loader = mosaic.audited(make_loader(mds, 2), tmp_path / name, "r", fsync=False)
            for k, _ in enumerate(loader):
                if k + 1 == stop:
                    state = loader.state_dict()
                    break
            loader.writer.finish()
            del loader
            writer = LedgerWriter(tmp_path / name, "r", host=rank, host_count=world, attempt=1,
                                  resumed_from_step=stop, records_per_epoch=N, fsync=False)
            again = mosaic.audited(make_loader(mds, 2), writer, start_step=stop)
            if load_state:
                again.load_state_dict(state)
            for _ in again:
                pass
            writer.finish()
            del again


def test_resume_without_load_state_dict_named_and_right_resume_passes(tmp_path, mds,
                                                                        one_process_group):
    """2 ranks x batch 4 stop after 10 steps (80 samples) and resume: forgetting
    load_state_dict starts epoch 0 again, so the 80 samples consumed before the checkpoint
    are read twice: reconcile names the resume (`resume_band`, attempt 1 at step 10), 80
    within-epoch repeats of 80 records (the resumed run ends the epoch, so nothing is unseen);
    loading the state is PASS."""
    world, stop = 2, 10
    resume(tmp_path, mds, "forgot", load_state=False, world=world, stop=stop)
    resume(tmp_path, mds, "right", load_state=True, world=world, stop=stop)
    consumed = world * BS * stop
    bad = reconcile(tmp_path / "forgot", mds / "m.parquet", tmp_path / "rb")
    codes = {f["code"]: f for f in bad["findings"]}
    assert bad["verdict"] == "FAIL" and "resume_band" in codes, bad["findings"]
    assert codes["resume_band"]["numbers"] == {"attempt": 1, "step": stop, "hosts": world,
                                               "previous_hosts": world, "repeated": consumed,
                                               "skipped": 0}
    assert bad["coverage"]["epoch_duplicate_records"] == consumed
    assert bad["coverage"]["epoch_duplicates"] == consumed
    assert bad["coverage"]["exposures"] == N + consumed and bad["coverage"]["never_seen"] == 0
    ok = reconcile(tmp_path / "right", mds / "m.parquet", tmp_path / "rr")
    assert ok["verdict"] == "PASS", ok["findings"]
    assert ok["coverage"]["never_seen"] == 0


def test_refused_in_one_line(tmp_path, mds):
    from torch.utils.data import DataLoader

    with pytest.raises(AttachError, match="StreamingDataset"):
        mosaic.audited(DataLoader(list(range(8)), batch_size=2), tmp_path, "r", host=0,
                       host_count=1)


def test_attach_cost_benchmark_runs():
    """bench/streaming_attach_cost.py end to end at a toy size (its own MDS directory and
    world, both undone): the figures it reports exist and the audited epoch had the plain
    one's batches."""
    from bench import streaming_attach_cost

    names = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")
    before = {k: os.environ.get(k) for k in names}
    res = streaming_attach_cost.main(["--samples", "240", "--tokens", "16", "--ranks", "2",
                                      "--rank", "1", "--steps", "2", "--step-ms", "1",
                                      "--plan-samples", "400"])
    assert res["batches"] == 240 // 2 // 8
    assert res["plain_ms"] > 0 and res["audited_ms"] > 0 and res["plan_ms"] > 0
    assert res["audited_cpu_ms"] > 0 and res["audited_main_ms"] > 0
    assert res["big_plan_ms"] > 0 and res["loop_ratio"] > 0
    assert {k: os.environ.get(k) for k in names} == before
