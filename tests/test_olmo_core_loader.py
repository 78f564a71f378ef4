"""OLMo-core audited live and replayed (tally.pipeline.loaders.olmo_core), with the real package.

A small OLMo numpy mix (tally.pipeline.olmo.write_mix: two raw uint32 token files with EOS ids
inside
and trailing tokens) is read by OLMo-core's own NumpyFSLDataset and NumpyFSLDataLoader. Its
instance i is the manifest's record key i (`tally manifest index.json`). The real Trainer (a
tiny model, one process, CPU) runs with TallyCallback, is checkpointed and resumed: every step's
record keys are the batch's `index`, the instances' tokens say so too, and reconcile passes. A
plain loop over two data-parallel ranks gets the loader's own batches; `replay` from the
configuration (and from a saved state) equals the live spool row for row. Resumes: at another
data-parallel world size and with another configured seed OLMo-core continues exactly (PASS);
a loader state not restored repeats the consumed instances and a resume at another global
batch size rounds the consumed tokens down to whole batches and repeats the remainder: reconcile
names both with their counts.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# OLMo-core's real data loader and Trainer, replays and pre-flights of them.
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("olmo_core")

from olmo_core.data import DataCollator, NumpyFSLDataLoader, NumpyFSLDataset  # noqa: E402
from olmo_core.train import Duration, TrainerConfig  # noqa: E402
from olmo_core.train.callbacks import Callback, CheckpointerCallback  # noqa: E402
from olmo_core.train.train_module import BasicTrainModule  # noqa: E402

from tally.audit.cli import main  # noqa: E402
from tally.audit.core.hashing import content_hash  # noqa: E402
from tally.audit.hook.writer import LedgerWriter  # noqa: E402
from tally.pipeline.loaders import AttachError  # noqa: E402
from tally.pipeline.loaders import olmo_core as tally_olmo  # noqa: E402
from tally.pipeline.olmo import load_index, write_mix  # noqa: E402
from tests.support.spool import spool_table  # noqa: E402

L, EOS, VOCAB, SEED = 16, 0, 1000, 3
N = 100 + 60  # instances: 100 in the first file, 60 in the second (trailing tokens dropped)
GB = 8  # instances a global batch


@contextlib.contextmanager
def supervised_child():
    """`tally.audit.cli.main` runs the command in this process (as its supervised child does)."""
    old = os.environ.get("TALLY_SUPERVISED")
    os.environ["TALLY_SUPERVISED"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TALLY_SUPERVISED")
        else:
            os.environ["TALLY_SUPERVISED"] = old


@pytest.fixture(scope="module")
def mix(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("olmo")
    rng = np.random.default_rng(0)
    files = []
    for label, n in (("web", 100 * L + 5), ("code", 60 * L + 3)):
        tokens = rng.integers(1, VOCAB, n)
        tokens[rng.random(n) < 0.05] = EOS  # documents end anywhere, instances cut regardless
        files.append((label, tokens))
    index = write_mix(root / "mix", files, sequence_length=L, dtype="uint32")
    with supervised_child():
        assert main(["manifest", str(index), "-o", str(root / "m.parquet"), "-q"]) == 0
    return {"root": root, "index": index, "manifest": root / "m.parquet",
            "paths": [str(f.path) for f in load_index(index).files]}


def dataset(mix: dict) -> NumpyFSLDataset:
    return NumpyFSLDataset(*mix["paths"], sequence_length=L, pad_token_id=EOS,
                           eos_token_id=EOS, vocab_size=VOCAB, dtype=np.uint32)


def make_loader(mix: dict, work: Path, *, world: int = 1, rank: int = 0, seed: int = SEED,
                gb: int = GB) -> NumpyFSLDataLoader:
    return NumpyFSLDataLoader(dataset(mix), collator=DataCollator(pad_token_id=EOS),
                              global_batch_size=gb * L, work_dir=work, seed=seed,
                              dp_world_size=world, dp_rank=rank, fs_local_rank=0)


def truth(mix: dict, batch: dict) -> list[int]:
    """The instances a batch holds, read back from its tokens (the mix's instances are
    distinct)."""
    if "by_tokens" not in mix:
        olmo = load_index(mix["index"])
        mix["by_tokens"] = {olmo.instance_tokens(i).tobytes(): i for i in range(N)}
    by_tokens = mix["by_tokens"]
    return [by_tokens[row.astype(np.int32).tobytes()] for row in batch["input_ids"].numpy()]


def reconcile(spool: Path, mix: dict, out: Path) -> dict:
    with supervised_child():
        code = main(["reconcile", "--spool", str(spool), "--manifest", str(mix["manifest"]),
                     "--run", "r", "-o", str(out), "-q", "--json"])
    assert code in (0, 1)
    return json.loads((out / "report.json").read_text())


def test_instances_are_the_manifests_record_keys(mix):
    """OLMo-core's NumpyFSLDataset over the mix's files (same order, sequence length, EOS) has
    tally.pipeline.olmo's instances: instance i's tokens are the mix's instance i, whose manifest
    row is record key i with the hash of those tokens."""
    ds, olmo = dataset(mix), load_index(mix["index"])
    m = pq.read_table(mix["manifest"])
    assert len(ds) == len(olmo) == m.num_rows == N
    assert m["record_key"].to_pylist() == list(range(N))
    for i in range(N):
        tokens = ds[i]["input_ids"].numpy().astype(np.int32)
        assert np.array_equal(tokens, olmo.instance_tokens(i))
        assert content_hash(tokens) == m["content_hash"][i].as_py()
    assert ds.offsets == ((0, 100), (100, N))


class TinyModule(BasicTrainModule):
    def num_flops_per_token(self, seq_len):
        return None

    def global_num_flops_in_batch(self, batch):
        return None


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids, **_):
        return self.out(self.emb(input_ids))


class Seen(Callback):
    """Ground truth: what the trainer handed the step, read after Tally's callback."""

    priority = -5

    def __init__(self, mix):
        self.mix, self.rows = mix, []

    def pre_step(self, batch):
        self.rows.append((self.trainer.global_step - 1, batch["index"].tolist(),
                          truth(self.mix, batch)))


def fit(mix: dict, root: Path, steps: int, seen: Seen, **options) -> tally_olmo.TallyCallback:
    model = Tiny()
    module = TinyModule(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        rank_microbatch_size=GB * L)
    tally = tally_olmo.TallyCallback(root / "spool", "r", fsync=False, **options)
    config = TrainerConfig(save_folder=str(root / "save"), work_dir=str(root / "work"),
                           max_duration=Duration.steps(steps), metrics_collect_interval=1000,
                           callbacks={"tally": tally, "seen": seen,
                                      "checkpointer": CheckpointerCallback(
                                          save_interval=10, save_async=False)})
    config.build(module, make_loader(mix, root / "work")).fit()
    return tally


@pytest.fixture(scope="module")
def trained(tmp_path_factory, mix) -> dict:
    """The real Trainer (one rank) runs 13 steps, checkpointing at step 10 and at its end;
    restarted with a longer duration it restores that checkpoint and runs on into epoch 2."""
    root, seen = tmp_path_factory.mktemp("trained"), Seen(mix)
    first = fit(mix, root, 13, seen)
    again = fit(mix, root, 27, seen)  # N / GB = 20 steps an epoch
    return {"root": root, "seen": seen, "first": first, "again": again}


def test_trainer_callback_records_each_step_across_a_checkpoint(trained, mix):
    """Each step's record keys are the batch's `index` (and the instances its tokens hold), the
    hashes the manifest's; the second run is attempt 1 resumed at step 13; reconcile: PASS;
    `replay` from the step-13 checkpoint's trainer state writes the second run's rows."""
    tmp_path, seen, first, again = (trained[k] for k in ("root", "seen", "first", "again"))
    assert (first.writer.attempt, first.writer.host, first.writer.host_count) == (0, 0, 1)
    assert again.writer.attempt == 1
    meta = pq.read_schema(next((tmp_path / "spool/r/attempt=1").rglob("seg-*"))).metadata
    assert meta[b"tally.resumed_from_step"] == b"13"
    assert [s for s, *_ in seen.rows] == list(range(27))
    t = spool_table(tmp_path / "spool")
    assert t["step"].to_pylist() == [s for s, *_ in seen.rows for _ in range(GB)]
    for step, index, held in seen.rows:
        assert index == held
        assert t.filter(pa.compute.equal(t["step"], step))["record_key"].to_pylist() == index
    assert set(t["epoch"].to_numpy()[t["step"].to_numpy() < 20]) == {1}
    assert set(t["epoch"].to_numpy()[t["step"].to_numpy() >= 20]) == {2}
    m = pq.read_table(mix["manifest"])
    keys = t["record_key"].to_numpy()
    assert np.array_equal(t["content_hash"].to_numpy(), m["content_hash"].to_numpy()[keys])
    rep = reconcile(tmp_path / "spool", mix, tmp_path / "report")
    assert rep["verdict"] == "PASS", rep["findings"]
    assert rep["coverage"]["never_seen"] == 0
    # Replay from the Trainer's own checkpoint (its data loader state and global step).
    state = torch.load(tmp_path / "save/step13/train/rank0.pt", weights_only=False)
    assert state["callbacks"]["tally"] == {"attempt": 0}
    done = tally_olmo.replay(make_loader(mix, tmp_path / "replay-work"), tmp_path / "replay",
                             "r", steps=27 - 13, hashes=mix["manifest"], state=state,
                             fsync=False)
    assert (done.first_step, done.last_step, done.rows) == (13, 26, 14 * GB)
    assert spool_table(tmp_path / "replay").equals(
        t.filter(pa.compute.greater_equal(t["step"], 13)))


def live(mix: dict, work: Path, spool: Path, world: int, epochs: int, stop: int = -1
         ) -> tuple[list[list], dict]:
    """Each rank iterates its audited loader `epochs` epochs (reshuffle / reset, as OLMo-core
    asks of a loop of one's own); the batches are an unaudited loader's, the same objects the
    loader yields. Returns the indices per rank and step, and each rank's state at `stop`."""
    got, states = [], {}
    for rank in range(world):
        plain, loader = make_loader(mix, work, world=world, rank=rank), None
        want = []
        for epoch in range(1, epochs + 1):
            plain.reshuffle(epoch)
            want += [b["index"].tolist() for b in plain]
            plain.reset()
        loader = tally_olmo.audited(make_loader(mix, work, world=world, rank=rank), spool, "r",
                                    fsync=False)
        assert (loader.writer.host, loader.writer.host_count) == (rank, world)
        mine = []
        for epoch in range(1, epochs + 1):
            loader.reshuffle(epoch)
            for batch in loader:
                assert batch["index"].tolist() == truth(mix, batch)
                mine.append(batch["index"].tolist())
                if len(mine) == stop:
                    states[rank] = loader.state_dict()
            loader.reset()
        assert mine == want
        loader.writer.finish()
        got.append(mine)
    return got, states


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, mix) -> dict:
    """Two ranks, two epochs of a plain loop (`live`), each rank's audited loader state saved
    at step 7 where a Trainer checkpoint keeps a rank's state: `train/rank<r>.pt`."""
    root, world, stop = tmp_path_factory.mktemp("two"), 2, 7
    got, states = live(mix, root / "work", root / "live", world, 2, stop)
    (root / "states/train").mkdir(parents=True)
    for rank, state in states.items():
        torch.save(state, root / f"states/train/rank{rank}.pt")
    return {"root": root, "world": world, "stop": stop, "got": got, "states": states}


def test_plain_loop_two_ranks_and_replay_equal_row_for_row(tmp_path, mix, two_ranks):
    """Two ranks, two epochs: every instance once an epoch over the ranks, the spool's keys the
    batches'; `replay` of each rank from a loader of the same configuration, from nothing and
    from the state saved at step 7, writes the live rows, marked replayed."""
    world, stop, got, states = (two_ranks[k] for k in ("world", "stop", "got", "states"))
    per_epoch = N // GB
    for epoch in range(2):
        ids = [i for rank in got for b in rank[epoch * per_epoch:(epoch + 1) * per_epoch]
               for i in b]
        assert sorted(ids) == list(range(N))
    assert states[0]["batches_processed"] == stop and states[0][tally_olmo.STEP_KEY] == stop
    live_t = spool_table(two_ranks["root"] / "live")
    assert live_t["record_key"].to_pylist() == [
        i for step in range(2 * per_epoch) for rank in range(world) for i in got[rank][step]]
    for name, first in (("all", 0), ("mid", stop)):
        for rank in range(world):
            loader = make_loader(mix, tmp_path / "replay-work", world=world, rank=rank)
            done = tally_olmo.replay(loader, tmp_path / name, "r", steps=2 * per_epoch - first,
                                     hashes=mix["manifest"],
                                     state=states[rank] if first else None, fsync=False)
            assert (done.first_step, done.last_step) == (first, 2 * per_epoch - 1)
        want = live_t.filter(pa.compute.greater_equal(live_t["step"], first))
        assert spool_table(tmp_path / name).equals(want), name
        meta = pq.read_schema(next((tmp_path / name).rglob("seg-*.parquet"))).metadata
        assert meta[b"tally.replayed"] == b"1"


def checkpoint(mix: dict, root: Path, name: str, world: int, stop: int) -> list[dict]:
    """`world` ranks run `stop` steps of epoch 1 into spool `root/name`; their loader states."""
    states = []
    for rank in range(world):
        loader = tally_olmo.audited(make_loader(mix, root / "work", world=world, rank=rank),
                                    root / name, "r", fsync=False)
        loader.reshuffle(1)
        for k, _ in enumerate(loader):
            if k + 1 == stop:
                break
        states.append(loader.state_dict())
        loader.writer.finish()
    return states


def resume(mix: dict, root: Path, name: str, *, world: int = 2, stop: int = 5,
           load_state: bool = True, **again) -> None:
    """`world` ranks run `stop` steps of epoch 1 and save their loader state; a second attempt
    (a loader built with `again`: world, seed, gb) restores it or not and ends the epoch."""
    states = checkpoint(mix, root, name, world, stop)
    world2 = again.pop("world", world)
    for rank in range(world2):
        writer = LedgerWriter(root / name, "r", host=rank, host_count=world2, attempt=1,
                              resumed_from_step=stop, records_per_epoch=N, fsync=False)
        loader = tally_olmo.audited(make_loader(mix, root / "work", world=world2, rank=rank,
                                                **again), writer, start_step=stop)
        if load_state:
            loader.load_state_dict(states[0])  # tokens_processed is global: any rank's
        loader.reshuffle(1)
        for _ in loader:
            pass
        writer.finish()


@pytest.mark.parametrize("case", ["world", "seed"])
def test_resume_at_another_world_size_or_seed_is_a_clean_trap(tmp_path, mix, case):
    """OLMo-core keeps the order over a resume at 1 rank of a 2-rank state (the same global
    batch: the state counts global tokens) and with another configured seed (the state's
    wins): reconcile PASS, every instance once."""
    again = {"world": 1} if case == "world" else {"seed": 99}
    resume(mix, tmp_path, case, **again)
    rep = reconcile(tmp_path / case, mix, tmp_path / "report")
    assert rep["verdict"] == "PASS", rep["findings"]
    assert rep["coverage"]["never_seen"] == 0 and rep["coverage"]["epoch_duplicates"] == 0
    assert rep["coverage"]["exposures"] == N


def test_resume_without_state_or_at_another_batch_named(tmp_path, mix):
    """2 ranks x 4 stop after 5 steps (40 instances consumed). Not restoring the loader state
    starts epoch 1 again: those 40 are read twice, the resume at step 5 named. Resuming at a global
    batch of 12 instances restores batches_processed = 40 // 12 = 3 batches of 12 (36): the 4
    instances 36..39 of the epoch's order are read twice, and the epoch's 160 instances cut to
    13 batches of 12 leave 4 unseen."""
    stop, consumed = 5, 5 * GB
    resume(mix, tmp_path, "forgot", stop=stop, load_state=False)
    bad = reconcile(tmp_path / "forgot", mix, tmp_path / "rf")
    codes = {f["code"]: f for f in bad["findings"]}
    assert bad["verdict"] == "FAIL" and "resume_band" in codes, bad["findings"]
    assert {k: codes["resume_band"]["numbers"][k] for k in ("step", "repeated", "skipped")} \
        == {"step": stop, "repeated": consumed, "skipped": 0}
    assert bad["coverage"]["epoch_duplicates"] == consumed
    assert bad["coverage"]["epoch_duplicate_records"] == consumed
    assert bad["coverage"]["exposures"] == N + consumed and bad["coverage"]["never_seen"] == 0

    resume(mix, tmp_path, "batch", stop=stop, gb=12)
    bad = reconcile(tmp_path / "batch", mix, tmp_path / "rb")
    codes = {f["code"]: f for f in bad["findings"]}
    assert bad["verdict"] == "FAIL" and "batch_changed" in codes, bad["findings"]
    assert codes["batch_changed"]["numbers"] == {"step": stop, "before": GB, "after": 12,
                                                 "repeated": consumed % 12, "skipped": N % 12}
    assert bad["coverage"]["epoch_duplicates"] == consumed % 12 == 4
    assert bad["coverage"]["never_seen"] == N % 12 == 4
    assert bad["coverage"]["exposures"] == consumed + (N // 12 - consumed // 12) * 12 == N


def test_refused_in_one_line(tmp_path, mix, monkeypatch):
    """Not an OLMo-core loader, a loop that skips reshuffle(), and OLMo-core missing: one
    line each, the last naming the extra."""
    import importlib
    import sys

    from torch.utils.data import DataLoader

    with pytest.raises(AttachError, match="NumpyFSLDataLoader"):
        tally_olmo.audited(DataLoader(list(range(8)), batch_size=2), tmp_path, "r")
    loader = tally_olmo.audited(make_loader(mix, tmp_path / "work"), tmp_path / "s", "r",
                                fsync=False)
    with pytest.raises(AttachError, match=r"call data_loader.reshuffle\(epoch\)"):
        next(iter(loader))
    loader.writer.close()
    for name in [k for k in sys.modules if k == "olmo_core" or k.startswith("olmo_core.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "tally.pipeline.loaders.olmo_core")
    with pytest.raises(ModuleNotFoundError, match=r"^tally.pipeline.loaders.olmo_core needs the "
                       r"olmo extra \(olmo_core is not installed\): "
                       r"pip install 'tally-audit\[olmo\]'$"):
        importlib.import_module("tally.pipeline.loaders.olmo_core")


# ---- the factory-based commands: `tally replay` and `tally preflight --loader` ---------------

ROOT = Path(__file__).resolve().parent.parent
FACTORY = "tests.test_olmo_core_loader:make_factory"


def make_factory(host: int, hosts: int) -> NumpyFSLDataLoader:
    """The job's factory as `--loader` calls it: dp rank `host` of `hosts` of the mix at
    TALLY_TEST_OLMO (its index.json), TALLY_TEST_GB instances a global batch (default GB)."""
    index = Path(os.environ["TALLY_TEST_OLMO"])
    paths = {"paths": [str(f.path) for f in load_index(index).files]}
    return make_loader(paths, index.parent / "factory-work", world=hosts, rank=host,
                       gb=int(os.environ.get("TALLY_TEST_GB", GB)))


@pytest.fixture
def cli(cli, mix):
    """tests/conftest.py's `cli`, with TALLY_TEST_OLMO naming the mix the factory reads."""
    return lambda *args, **env: cli(*args, **{"TALLY_TEST_OLMO": str(mix["index"]), **env})


def test_cli_replay_of_a_factory_equals_the_live_spool(cli, tmp_path, mix, two_ranks, trained):
    """`tally replay --loader` over an OLMo-core factory: the two ranks from the start and
    from their states saved at step 7 (`train/rank<r>.pt`), and the Trainer's own checkpoint
    directory (save/step13: train/rank0.pt, its global_step), each equal to the live spool
    row for row, marked replayed."""
    base = ["replay", "--loader", FACTORY, "--run", "r", "--manifest", str(mix["manifest"])]
    live_t, steps = spool_table(two_ranks["root"] / "live"), 2 * (N // GB)
    stop = two_ranks["stop"]
    for name, first, extra in (("all", 0, []),
                               ("mid", stop, ["--states", str(two_ranks["root"] / "states")])):
        code, out, err = cli(*base, "--hosts", "2", "--steps", str(steps - first), "--spool",
                             str(tmp_path / name), "--json", *extra)
        assert code == 0, err
        assert json.loads(out)["first_step"] == first
        want = live_t.filter(pa.compute.greater_equal(live_t["step"], first))
        assert spool_table(tmp_path / name).equals(want), name
    meta = pq.read_schema(next((tmp_path / "mid").rglob("seg-*.parquet"))).metadata
    assert meta[b"tally.replayed"] == b"1"
    code, out, err = cli(*base, "--hosts", "1", "--steps", "14", "--spool",
                         str(tmp_path / "trainer"), "--states",
                         str(trained["root"] / "save/step13"))
    assert code == 0, err
    t = spool_table(trained["root"] / "spool")
    assert spool_table(tmp_path / "trainer").equals(
        t.filter(pa.compute.greater_equal(t["step"], 13)))


STOP = 5  # the pre-flight run: 2 ranks x GB / 2 instances, checkpointed after 5 steps


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, mix) -> dict:
    """2 ranks run 5 steps (40 instances) and save their loader states as a Trainer keeps
    them (`train/rank<r>.pt`); the spool ingested into a ledger."""
    root = tmp_path_factory.mktemp("ckpt")
    states = checkpoint(mix, root, "spool", 2, STOP)
    (root / "states/train").mkdir(parents=True)
    for rank, state in enumerate(states):
        torch.save(state, root / f"states/train/rank{rank}.pt")
    with supervised_child():
        assert main(["ingest", str(root / "spool"), "--ledger", str(root / "ledger.duckdb"),
                     "-q"]) == 0
    before = [i for rank in range(2) for i in spool_table(root / "spool")
              .filter(pa.compute.equal(spool_table(root / "spool")["host"], rank))
              ["record_key"].to_pylist()]
    assert len(before) == len(set(before)) == STOP * GB
    return {"root": root, "states": root / "states", "before": set(before)}


def preflight(cli, mix, run: dict, hosts: int, *extra: str, **env: str) -> tuple[int, dict]:
    code, out, err = cli("preflight", "--run", "r", "--ledger",
                         str(run["root"] / "ledger.duckdb"), "--manifest", str(mix["manifest"]),
                         "--loader", FACTORY, "--hosts", str(hosts), "--json", "-q", *extra,
                         **env)
    assert code in (0, 1), err
    v = json.loads(out)
    assert v["numbers"]["loader_kind"] == "olmo"
    return code, v


def relaunched(mix: dict, run: dict, hosts: int, gb: int, restore: bool) -> list[int]:
    """What the relaunch really reads to the epoch's end: the real loaders of `hosts` ranks,
    restored as OLMo-core's Checkpointer restores them (rank r: train/rank<r>.pt, else
    train/rank0.pt) or not at all."""
    got = []
    for rank in range(hosts):
        loader = make_loader(mix, run["root"] / "work", world=hosts, rank=rank, gb=gb)
        if restore:
            path = run["states"] / f"train/rank{rank}.pt"
            path = path if path.is_file() else run["states"] / "train/rank0.pt"
            loader.load_state_dict(torch.load(path, weights_only=False))
        loader.reshuffle(1)
        got += [i for b in loader for i in b["index"].tolist()]
    return got


def test_preflight_world_size_change_restored_passes(cli, mix, checkpointed):
    """2 -> 4 ranks (ranks 2 and 3 load rank0.pt, as OLMo-core's Checkpointer does) and
    2 -> 1, the states restored: OLMo-core continues at the global tokens consumed: SAFE,
    no repeat and nothing skipped; the real restored loaders read exactly the rest."""
    assert sorted(relaunched(mix, checkpointed, 4, GB, True)) == sorted(
        set(range(N)) - checkpointed["before"])
    for hosts in (4, 1):
        code, v = preflight(cli, mix, checkpointed, hosts, "--states",
                            str(checkpointed["states"]))
        assert code == 0 and v["status"] == "safe", v["findings"]
        n = v["numbers"]
        assert (n["checkpoint_step"], n["old_hosts"], n["new_hosts"]) == (STOP, 2, hosts)
        assert n["old_global_batch"] == n["new_global_batch"] == GB
        assert (n["repeats"], n["skipped"], n["reached_multiple"]) == (0, 0, True)


def test_preflight_refuses_the_real_faults_with_their_counts(cli, mix, checkpointed):
    """The loader state not restored (fresh loaders at step 5) starts the epoch again: the 40
    instances consumed are planned again and 40 are left unseen at the epoch's end. A global
    batch of 12 restores batches_processed = 40 // 12 = 3: instances 36..39 of the order are
    read again (and 160 mod 12 = 4 dropped by design: within the allowance). The counts are
    the real relaunched loaders'."""
    before = checkpointed["before"]
    fresh = relaunched(mix, checkpointed, 2, GB, False)[:N - STOP * GB]
    code, v = preflight(cli, mix, checkpointed, 2, "--at-step", str(STOP))
    codes = {f["code"]: f for f in v["findings"]}
    assert code == 1 and {"repeats", "skips"} <= set(codes), v["findings"]
    assert v["numbers"]["repeats"] == len(before & set(fresh)) == STOP * GB
    assert v["numbers"]["skipped"] == N - len(before | set(fresh)) == STOP * GB
    assert v["numbers"]["first_bad_step"] == STOP

    wider = relaunched(mix, checkpointed, 2, 12, True)
    code, v = preflight(cli, mix, checkpointed, 2, "--states", str(checkpointed["states"]),
                        TALLY_TEST_GB="12")
    codes = {f["code"]: f for f in v["findings"]}
    assert code == 1 and {"global_batch_changed", "repeats"} <= set(codes), v["findings"]
    assert codes["global_batch_changed"]["numbers"] == {"before": GB, "after": 12}
    assert v["numbers"]["repeats"] == len(before & set(wider)) == STOP * GB % 12 == 4
    assert codes["skips_within_allowance"]["numbers"]["records"] == N % 12


def test_factory_commands_refuse_bad_input_in_one_line(cli, mix, tmp_path, checkpointed):
    """States that are not an OLMo-core checkpoint, and hashes from the source: one line."""
    (tmp_path / "train").mkdir()
    (tmp_path / "train/rank0.pt").write_text("not a state")
    replay = ["replay", "--loader", FACTORY, "--hosts", "2", "--steps", "3", "--run", "r",
              "--manifest", str(mix["manifest"]), "--spool", str(tmp_path / "s")]
    pre = ["preflight", "--run", "r", "--ledger", str(checkpointed["root"] / "ledger.duckdb"),
           "--manifest", str(mix["manifest"]), "--loader", FACTORY, "--hosts", "2"]
    for args, said in ((replay + ["--states", str(tmp_path)], "rank0.pt: not an OLMo-core"),
                       (replay + ["--states", str(mix["root"])], "no OLMo-core trainer state"),
                       (replay + ["--hashes", "source"], "hashes from the manifest"),
                       (pre + ["--states", str(tmp_path)], "rank0.pt: not an OLMo-core"),
                       (pre + ["--states", str(mix["root"])], "no OLMo-core trainer state")):
        code, out, err = cli(*args)
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, (args, err)
        assert not (tmp_path / "s").exists()
