"""Lightning's litdata audited live and replayed (tally.pipeline.loaders.litdata_loader), with the
real
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
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# Real litdata loaders with worker processes, replays and pre-flights of them.
pytestmark = pytest.mark.slow

pytest.importorskip("torch")
pytest.importorskip("litdata")

from litdata import StreamingDataLoader, StreamingDataset  # noqa: E402
from litdata.streaming.cache import Cache  # noqa: E402

from tally.audit.core.hashing import content_hash  # noqa: E402
from tally.pipeline.loaders import AttachError  # noqa: E402
from tally.pipeline.loaders import litdata_loader as tally_litdata  # noqa: E402
from tally.pipeline.loaders.replayed import ReplayError  # noqa: E402
from tally.pipeline.manifest_file import write_manifest_table  # noqa: E402
from tests.support.spool import spool_table  # noqa: E402

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


def reconcile(spool: Path, m: Path, out: Path) -> dict:
    from tally.audit.cli import main

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
    """A plain DataLoader is refused with one line; so is a resume litdata itself refuses (a
    state saved on 2 ranks, drop_last forced there, loaded on 1 rank without drop_last:
    `_validate_state_dict`'s ValueError, raised in litdata's workers), live and in replay."""
    from torch.utils.data import DataLoader

    with pytest.raises(AttachError, match="StreamingDataLoader"):
        tally_litdata.audited(DataLoader(list(range(8)), batch_size=2), tmp_path, "r", host=0,
                              host_count=1)
    with as_rank(0, 2):
        loader = make_loader(data, 0)
    for k, _ in enumerate(loader):
        if k == 4:
            state = loader.state_dict()
            break
    with as_rank(None, None):
        other = tally_litdata.audited(make_loader(data, 2), tmp_path / "b", "r", fsync=False)
        ds = StreamingDataset(str(data / "data"), shuffle=True, seed=SEED)
    other.load_state_dict(state)
    with pytest.raises(AttachError, match="litdata refuses.*drop_last"):
        list(other)
    with pytest.raises(ReplayError, match="litdata refuses.*drop_last"):
        tally_litdata.replay(ds, tmp_path / "c", "r", host=0, world_size=1, workers=2,
                             batch_size=BS, steps=3, hashes=data / "m.parquet", state=state)


# ---- litdata's elastic resume: audited live, replayed, and pre-flighted ----------------------
#
# A run on 2 ranks x 2 workers x 6 rows checkpoints each rank's state after step 6 (72 samples,
# whole steps of the new grid too), and is relaunched on 3 ranks x 2 workers x 4 rows (the
# global batch kept: 12) from those states: litdata's elastic restripe of its canonical stream.
# The relaunch checkpoints after 4 more steps; resumed from that state on the same 3 x 2, litdata
# takes its same-topology replay, though its rows came from the restripe: the state saved in the
# main process lost `resume_mode` (litdata sets it in the workers' copies only).
OLD_W, OLD_BS, NEW_W, NEW_BS, WORKERS, CUT, CUT2 = 2, 6, 3, 4, 2, 6, 4


def make_job(host: int, hosts: int) -> StreamingDataLoader:
    """The job's factory (`tally replay` / `preflight --loader`): rows a rank from
    TALLY_TEST_BS, the data from TALLY_TEST_LITDATA; litdata reads the rank from its env."""
    ds = StreamingDataset(os.environ["TALLY_TEST_LITDATA"], shuffle=True, seed=SEED)
    return StreamingDataLoader(ds, batch_size=int(os.environ["TALLY_TEST_BS"]),
                               num_workers=WORKERS)


def job_loader(data: Path, rank: int, world: int, bs: int) -> StreamingDataLoader:
    with as_rank(rank, world):
        ds = StreamingDataset(str(data / "data"), shuffle=True, seed=SEED)
        return StreamingDataLoader(ds, batch_size=bs, num_workers=WORKERS)


@pytest.fixture(scope="module")
def elastic_run(data, tmp_path_factory):
    """Attempt 0 (2 ranks, 6 steps), attempt 1 (3 ranks restored from its states, 4 steps),
    attempt 2 (3 ranks restored from attempt 1's states, to the epoch's end), audited into one
    spool with the manifest's hashes, the indices each batch held (truth) by (attempt, step,
    rank); states in a/ and b/; ingested."""
    from tally.audit.cli import main

    d = tmp_path_factory.mktemp("elastic")
    m = data / "m.parquet"
    truth: dict[tuple[int, int, int], list[int]] = {}
    for name in ("a", "b"):
        (d / name).mkdir()
    plan = ((0, OLD_W, OLD_BS, None, CUT, "a"), (1, NEW_W, NEW_BS, "a", CUT2, "b"),
            (2, NEW_W, NEW_BS, "b", None, None))
    for attempt, world, bs, load, stop, save in plan:
        for rank in range(world):
            resumed = {} if attempt == 0 else {"attempt": attempt,
                                               "resumed_from_step": CUT + (attempt - 1) * CUT2}
            with as_rank(rank, world):
                loader = tally_litdata.audited(job_loader(data, rank, world, bs), d / "spool",
                                               "e", hashes=m, fsync=False, **resumed)
                if load:
                    old = sorted((d / load).glob("litdata_*.json"))
                    loader.load_state_dict(json.loads(old[rank % len(old)].read_text()))
            for k, batch in enumerate(loader):
                truth[(attempt, loader.next_step - 1, rank)] = batch["index"].tolist()
                if k + 1 == stop:
                    (d / save / f"litdata_{rank}-of-{world}.json").write_text(
                        json.dumps(loader.state_dict()))
                    break
            loader.writer.finish()
    # The relaunch done right to the epoch's end (attempt 1 not interrupted), in spool right/.
    shutil.copytree(d / "spool" / "e" / "attempt=0", d / "right" / "e" / "attempt=0")
    for rank in range(NEW_W):
        with as_rank(rank, NEW_W):
            loader = tally_litdata.audited(job_loader(data, rank, NEW_W, NEW_BS), d / "right",
                                           "e", hashes=m, fsync=False, attempt=1,
                                           resumed_from_step=CUT)
            loader.load_state_dict(json.loads((d / "a" / f"litdata_{rank % OLD_W}-of-{OLD_W}"
                                               ".json").read_text()))
        list(loader)
        loader.writer.finish()
    assert main(["ingest", str(d / "spool"), "--ledger", str(d / "ledger.duckdb"), "-q"]) == 0
    return {"dir": d, "manifest": m, "truth": truth, "data": data / "data"}


def attempt_rows(spool: Path, attempt: int) -> pa.Table:
    t = spool_table(spool, "e")
    files = sorted(Path(spool, "e", f"attempt={attempt}").rglob("seg-*.parquet"))
    steps = set(pq.read_table(files, partitioning=None)["step"].to_pylist()) if files else set()
    return t.filter(pa.compute.is_in(t["step"], pa.array(sorted(steps), pa.int64())))


def test_elastic_resume_audited_keys_are_what_litdata_read(elastic_run):
    """The relaunch on 3 ranks (another world size, batch size: litdata's elastic restripe) is
    audited, not refused: each step's record keys are the indices its batch held; the 72
    samples before and the 48 after are 120 distinct (the restripe done right)."""
    truth, spool = elastic_run["truth"], elastic_run["dir"] / "spool"
    for attempt in (0, 1):
        rows = pq.read_table(sorted(Path(spool, "e", f"attempt={attempt}").rglob("seg-*")),
                             partitioning=None)
        got: dict[tuple[int, int], list[int]] = {}
        for s, h, k in zip(rows["step"].to_pylist(), rows["host"].to_pylist(),
                           rows["record_key"].to_pylist(), strict=True):
            got.setdefault((s, h), []).append(k)
        want = {(s, h): v for (a, s, h), v in truth.items() if a == attempt}
        assert got == want and len(want) == (OLD_W * CUT if attempt == 0 else NEW_W * CUT2)
    read = [i for (a, _, _), v in truth.items() if a < 2 for i in v]
    assert len(read) == len(set(read)) == OLD_W * OLD_BS * CUT + NEW_W * NEW_BS * CUT2


def test_reconcile_elastic_relaunch_passes_lost_elastic_mode_fails(elastic_run):
    """`tally reconcile` of the run: the elastic relaunch to the epoch's end reads every record
    once: PASS; resumed again from the states it saved (attempt 2), the epoch reads records
    twice and leaves others unread, as many as the real loaders' batches show: named on
    attempt 2 (`resume_band`, its repeats and the epoch's unread records), not on attempt 1's
    restripe, which repeated nothing."""
    d, m, truth = elastic_run["dir"], elastic_run["manifest"], elastic_run["truth"]

    def report(spool: Path) -> dict:
        from tally.audit.cli import main

        out = spool.parent / f"rep-{spool.name}"
        assert main(["reconcile", "--spool", str(spool), "--manifest", str(m), "--run", "e",
                     "-o", str(out), "-q", "--json"]) in (0, 1)
        return json.loads((out / "report.json").read_text())

    ok = report(d / "right")
    assert ok["verdict"] == "PASS", ok["findings"]
    assert ok["coverage"]["never_seen"] == 0 and ok["coverage"]["epoch_duplicates"] == 0
    bad = report(d / "spool")
    read = np.bincount([i for x in truth.values() for i in x], minlength=N)
    assert bad["verdict"] == "FAIL", bad["findings"]
    assert bad["coverage"]["epoch_duplicate_records"] == int((read > 1).sum()) > 0
    assert bad["coverage"]["never_seen"] == int((read == 0).sum()) > 0
    again = CUT + CUT2  # attempt 2's resume step
    seen: set[int] = set()
    repeated = 0
    for (_, step, _), keys in sorted(truth.items(), key=lambda kv: kv[0][1]):
        repeated += sum(k in seen for k in keys) if step >= again else 0
        seen.update(keys)
    codes = {f["code"]: f for f in bad["findings"]}
    assert "reshard_band" not in codes, bad["findings"]
    assert codes["resume_band"]["numbers"] == {
        "attempt": 2, "step": again, "hosts": NEW_W, "previous_hosts": NEW_W,
        "repeated": repeated, "skipped": int((read == 0).sum())}
    assert codes["resharded"]["severity"] == "INFO"


def test_replay_of_a_litdata_factory_equals_live(cli, elastic_run, tmp_path):
    """`tally replay --loader` of a litdata factory: kind litdata, from the beginning on 2 ranks
    and from the 2-rank states on 3 ranks (the elastic restripe), row for row the live spool."""
    m, env = str(elastic_run["manifest"]), {"TALLY_TEST_LITDATA": str(elastic_run["data"])}
    live = elastic_run["dir"] / "spool"
    for hosts, bs, steps, states, attempt in ((OLD_W, OLD_BS, CUT, None, 0),
                                               (NEW_W, NEW_BS, CUT2, "a", 1)):
        out_dir = tmp_path / f"r{attempt}"
        extra = ["--states", str(elastic_run["dir"] / states)] if states else []
        code, out, err = cli("replay", "--loader", "tests.test_litdata_loader:make_job",
                             "--hosts", str(hosts), "--steps", str(steps), "--spool",
                             str(out_dir), "--run", "e", "--manifest", m, "--json", *extra,
                             TALLY_TEST_BS=str(bs), **env)
        assert code == 0, err
        want = attempt_rows(live, attempt)
        assert json.loads(out)["rows"] == len(want) == hosts * bs * steps
        assert spool_table(out_dir, "e").equals(want)
    code, _, err = cli("replay", "--loader", "tests.test_litdata_loader:make_job", "--hosts",
                       "3", "--steps", "2", "--spool", str(tmp_path / "x"), "--run", "e",
                       "--manifest", m, "--states", str(tmp_path), TALLY_TEST_BS="4", **env)
    assert code == 2 and "litdata_<h>-of-<n>.json" in err and len(err.strip().splitlines()) == 1


def test_preflight_elastic_resume_passes_fresh_and_lost_elastic_mode_refused(cli, elastic_run):
    """Pre-flight of the 3-rank relaunch: restored from the 2-rank states (litdata's restripe)
    SAFE; fresh at step 6 without them, repeats the 72 samples read; resumed from the states
    the 3-rank relaunch saved (elastic mode lost with workers: litdata replays the standard
    order of the new grid), repeats and skips, counted as the real restored loaders read."""
    d = elastic_run["dir"]

    def preflight(*extra: str) -> dict:
        code, out, err = cli("preflight", "--run", "e", "--ledger", str(d / "ledger.duckdb"),
                             "--manifest", str(elastic_run["manifest"]), "--loader",
                             "tests.test_litdata_loader:make_job", "--hosts", str(NEW_W),
                             "--json", "-q", *extra, TALLY_TEST_BS=str(NEW_BS),
                             TALLY_TEST_LITDATA=str(elastic_run["data"]))
        assert code in (0, 1), err
        v = json.loads(out)
        assert code == {"safe": 0, "unsafe": 1}[v["status"]]
        return v

    v = preflight("--states", str(d / "a"))
    n = v["numbers"]
    assert v["status"] == "safe", v["findings"]
    assert (n["loader_kind"], n["checkpoint_step"], n["old_hosts"]) == ("litdata", CUT, OLD_W)
    assert n["old_global_batch"] == n["new_global_batch"] == OLD_W * OLD_BS
    assert n["repeats"] == 0 and n["skipped"] == 0 and n["reached_multiple"]
    # Ground truth: what the real fresh loaders of the new grid read first, against the run.
    truth = elastic_run["truth"]
    read = np.bincount([i for (a, s, _), x in truth.items() if a == 0 for i in x], minlength=N)
    v = preflight("--at-step", str(CUT))
    fresh = []
    for rank in range(NEW_W):
        for k, batch in enumerate(job_loader(elastic_run["data"].parent, rank, NEW_W, NEW_BS)):
            fresh += batch["index"].tolist()
            if k + 1 == v["numbers"]["horizon_steps"]:
                break
    again = int(read[fresh].sum())
    assert v["status"] == "unsafe" and "repeats" in {f["code"] for f in v["findings"]}
    assert again > 0 and v["numbers"]["repeats"] == again
    # Ground truth: what the real loaders restored from b/ read (attempt 2), against the run.
    v = preflight("--states", str(d / "b"))
    before = np.bincount([i for (a, _, _), x in truth.items() if a < 2 for i in x], minlength=N)
    horizon = v["numbers"]["horizon_steps"]
    after = before + np.bincount([i for (a, s, _), x in truth.items()
                                  if a == 2 and s < CUT + CUT2 + horizon for i in x],
                                 minlength=N)
    repeats = int(np.maximum(after - 1, 0).sum())
    assert repeats > 0 and v["status"] == "unsafe"
    assert v["numbers"]["checkpoint_step"] == CUT + CUT2 and v["numbers"]["repeats"] == repeats
