"""`tally preflight --loader` and `tally replay` for the PyTorch side, with the real packages:
torchdata's StatefulDistributedSampler + StatefulDataLoader, and MosaicML Streaming.

torch: a run on 4 ranks checkpoints each rank's StatefulDataLoader state mid-epoch. Restored on 2
ranks (the job's `load_state_dict` of old rank h's state on new rank h), the sampler's saved
offset counts the old rank's own samples, so the new ranks start half way back in the epoch's
permutation: they read again what the run read, and the epoch ends before the rest. Ground truth
is read from the real restored loaders' batches; pre-flight refuses the relaunch with those
counts. The same states on 4 ranks, and the 2-rank relaunch done right (the offset given as the
job's consumed samples over the new world size), are SAFE.

Streaming: 0.13 re-partitions a saved global sample offset on another world size
(num_canonical_nodes kept), so a 2 -> 4 rank relaunch loading the state is SAFE; the same
relaunch without the state (a fresh dataset at the step) repeats what the run read. `tally
replay` of a Streaming factory from its state equals the live spool row for row.

Every command runs through the CLI's own main in this process (as its supervised child runs
it); one real process checks that none of it needs Grain.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

# Pre-flight and replay over real torch and Streaming loaders with workers.
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler  # noqa: E402

from tally.pipeline.loaders import mosaic  # noqa: E402
from tally.pipeline.loaders import torch_loader as tally_torch  # noqa: E402
from tests.support.checkpointed import read_epoch_checkpointed  # noqa: E402
from tests.test_streaming_loader import N as N_MDS  # noqa: E402
from tests.test_streaming_loader import (  # noqa: E402,F401  (fixtures shared, module scope)
    as_rank,
    mds,
    one_process_group,
    spool_table,
    streaming_classes,
)
from tests.test_torch_loader import Records, by_tokens_of, manifest, truth_of  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
N, GLOBAL, OLD, CUT = 256, 16, 4, 5  # 16 steps an epoch; checkpoint after 5 (80 samples)
SEED, S_BS, S_CUT = 3, 4, 10  # Streaming: 2 ranks x 4 rows, a state after step 10


def make_torch(host: int, hosts: int) -> StatefulDataLoader:
    """The factory: per-rank batch GLOBAL / hosts. TALLY_TEST_OFFSET (samples the job consumed)
    starts the sampler at OFFSET / hosts of its own shard, as a relaunch done right sets it."""
    ds = Records(N)
    sampler = StatefulDistributedSampler(ds, num_replicas=hosts, rank=host, shuffle=True,
                                         seed=5)
    offset = os.environ.get("TALLY_TEST_OFFSET")
    if offset:
        sampler.load_state_dict({"yielded": int(offset) // hosts})
    return StatefulDataLoader(ds, batch_size=GLOBAL // hosts, sampler=sampler)


def make_streaming(host: int, hosts: int) -> object:
    """The factory of a Streaming job: the per-rank batch from TALLY_TEST_BS."""
    dataset_cls, loader_cls = streaming_classes()
    bs = int(os.environ.get("TALLY_TEST_BS", str(S_BS)))
    ds = dataset_cls(local=os.environ["TALLY_TEST_MDS"], batch_size=bs, shuffle=True,
                     shuffle_seed=SEED, num_canonical_nodes=2)
    return loader_cls(ds, batch_size=bs, num_workers=0)


@pytest.fixture
def cli(monkeypatch, capsys):
    """`tally ARGS` through tally.audit.cli.main in this process: (exit status, stdout, stderr)."""
    from tally.audit.cli import main

    def run(*args: str, **env: str) -> tuple[int, str, str]:
        monkeypatch.chdir(ROOT)
        for k, v in {**env, "TALLY_SUPERVISED": "1"}.items():
            monkeypatch.setenv(k, v)
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        for k in env:
            monkeypatch.delenv(k)
        return code, out, err

    return run


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    """One epoch on 4 ranks (StatefulDistributedSampler + StatefulDataLoader, audited), each
    rank's state saved after step 5 as dataloader_<h>-of-4.json; the records each rank read
    (truth from the batches' tokens) before the checkpoint; ingested."""
    from tally.audit.cli import main

    d = tmp_path_factory.mktemp("torch")
    m = manifest(d / "m.parquet", N)
    states = d / "states"
    states.mkdir()
    by_tokens, before = by_tokens_of(N), []
    for h in range(OLD):
        loader = tally_torch.audited(make_torch(h, OLD), d / "spool", "t", hashes=m,
                                     fsync=False)
        before += read_epoch_checkpointed(loader, CUT, states / f"dataloader_{h}-of-{OLD}.json",
                                          lambda batch: truth_of(batch, by_tokens))[0]
    assert main(["ingest", str(d / "spool"), "--ledger", str(d / "ledger.duckdb"), "-q"]) == 0
    return {"dir": d, "manifest": m, "states": states, "before": before}


def preflight(cli, run: dict, run_id: str, factory: str, hosts: int, *extra: str,
              **env: str) -> tuple[int, dict]:
    code, out, err = cli("preflight", "--run", run_id, "--ledger",
                         str(run["dir"] / "ledger.duckdb"), "--manifest", str(run["manifest"]),
                         "--loader", f"tests.test_loader_preflight_torch:{factory}", "--hosts",
                         str(hosts), "--json", "-q", *extra, **env)
    assert code in (0, 1), err
    v = json.loads(out)
    assert code == {"safe": 0, "unsafe": 1}[v["status"]]
    return code, v


def test_torch_states_restored_on_fewer_ranks_refused_with_the_real_counts(cli, torch_run):
    # What really happens: the real 2-rank loaders, each restored from old rank h's state.
    by_tokens, after = by_tokens_of(N), []
    horizon = (N - OLD * CUT * GLOBAL // OLD) // GLOBAL  # to the epoch's end: 11 steps
    for h in range(2):
        loader = make_torch(h, 2)
        loader.load_state_dict(json.loads(
            (torch_run["states"] / f"dataloader_{h}-of-{OLD}.json").read_text()))
        for k, batch in enumerate(loader):
            if k == horizon:
                break
            after += truth_of(batch, by_tokens)
    before = torch_run["before"]
    assert len(before) == CUT * GLOBAL and len(set(before)) == len(before)
    repeated = len(set(after) & set(before))
    unseen = N - len(set(after) | set(before))
    # The saved offset (20 of each old rank's 64) is 20 of the new rank's 128: the relaunch
    # starts at the permutation's 40th place, not its 80th.
    assert repeated == unseen == 40

    code, v = preflight(cli, torch_run, "t", "make_torch", 2, "--states",
                        str(torch_run["states"]))
    codes = {f["code"]: f for f in v["findings"]}
    assert code == 1 and {"repeats", "skips"} <= set(codes), v["findings"]
    n = v["numbers"]
    assert (n["loader_kind"], n["checkpoint_step"], n["old_hosts"]) == ("torch", CUT, OLD)
    assert n["old_global_batch"] == n["new_global_batch"] == GLOBAL
    assert n["horizon_steps"] == horizon
    assert n["repeats"] == repeated and codes["repeats"]["numbers"]["records"] == repeated
    assert n["skipped"] == unseen and codes["skips"]["numbers"]["records"] == unseen
    assert n["first_bad_step"] == CUT


def test_torch_same_world_and_a_relaunch_done_right_pass(cli, torch_run):
    code, v = preflight(cli, torch_run, "t", "make_torch", OLD, "--states",
                        str(torch_run["states"]))
    assert code == 0, v["findings"]
    assert v["numbers"]["repeats"] == 0 and v["numbers"]["skipped"] == 0
    assert v["numbers"]["reached_multiple"]
    # On 2 ranks, each sampler started at the job's consumed samples over the new world size.
    code, v = preflight(cli, torch_run, "t", "make_torch", 2, "--at-step", str(CUT),
                        TALLY_TEST_OFFSET=str(CUT * GLOBAL))
    assert code == 0, v["findings"]
    assert v["numbers"]["repeats"] == 0 and v["numbers"]["skipped"] == 0


def test_torch_bad_states_are_one_line(cli, torch_run, tmp_path):
    base = ["preflight", "--run", "t", "--ledger", str(torch_run["dir"] / "ledger.duckdb"),
            "--manifest", str(torch_run["manifest"]), "--loader",
            "tests.test_loader_preflight_torch:make_torch", "--hosts", "2", "--states"]
    (tmp_path / "dataloader_0-of-2.json").write_text("{}")
    (tmp_path / "dataloader_1-of-2.json").write_text("{}")
    for states, said in ((tmp_path, "dataloader_0-of-2.json: not a saved StatefulDataLoader "
                                    "state"),
                         (torch_run["dir"], "expected the saved StatefulDataLoader states")):
        code, out, err = cli(*base, str(states))
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err


def test_torch_preflight_and_replay_need_no_grain(torch_run, tmp_path):
    """A real process in which Grain cannot be imported: the torch loader's pre-flight says
    UNSAFE (exit 1) as above, and its replay from the states writes the rest of the epoch."""
    code = ("import sys; sys.modules['grain'] = None\n"
            "from tally.audit.cli import main\n"
            "a = sys.argv.index('--then')\n"
            "first = main(sys.argv[1:a])\n"
            "print('=====', flush=True)\n"
            "sys.exit(first * 10 + main(sys.argv[a + 1:]))\n")
    loader = ["--loader", "tests.test_loader_preflight_torch:make_torch", "--manifest",
              str(torch_run["manifest"]), "--states", str(torch_run["states"]), "--json"]
    r = subprocess.run(
        [sys.executable, "-c", code, "preflight", "--run", "t", "--ledger",
         str(torch_run["dir"] / "ledger.duckdb"), "--hosts", "2", "-q", *loader, "--then",
         "replay", "--hosts", str(OLD), "--steps", str(N // GLOBAL - CUT), "--spool",
         str(tmp_path / "r"), "--run", "t", *loader],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "TALLY_SUPERVISED": "1"})
    assert r.returncode == 10, r.stderr
    verdict, replayed = r.stdout.split("=====\n")
    assert json.loads(verdict)["numbers"]["repeats"] == 40
    replayed = json.loads(replayed)
    assert (replayed["first_step"], replayed["last_step"]) == (CUT, N // GLOBAL - 1)
    live = spool_table(torch_run["dir"] / "spool", "t")
    live = live.filter(pa.compute.greater_equal(live["step"], CUT))
    assert spool_table(tmp_path / "r", "t").equals(live)


@pytest.fixture(scope="module")
def streaming_run(mds, one_process_group, tmp_path_factory):  # noqa: F811
    """One epoch of the MDS set on 2 ranks (4 rows each), audited with the manifest's hashes;
    the state after step 10 saved as streaming.json; ingested."""
    from tally.audit.cli import main

    d = tmp_path_factory.mktemp("streaming")
    states = d / "states"
    states.mkdir()
    os.environ["TALLY_TEST_MDS"] = str(mds / "data")
    try:
        for rank in range(2):
            with as_rank(rank, 2):
                loader = mosaic.audited(make_streaming(rank, 2), d / "spool", "s",
                                        hashes=mds / "m.parquet", fsync=False)
                for k, _ in enumerate(loader):
                    if k + 1 == S_CUT and rank == 0:
                        (states / "streaming.json").write_text(json.dumps(loader.state_dict()))
                loader.writer.finish()
                del loader
    finally:
        os.environ.pop("TALLY_TEST_MDS")
    assert main(["ingest", str(d / "spool"), "--ledger", str(d / "ledger.duckdb"), "-q"]) == 0
    return {"dir": d, "manifest": mds / "m.parquet", "states": states, "mds": mds / "data"}


def test_streaming_elastic_resume_passes_and_a_fresh_dataset_repeats(cli, streaming_run):
    env = {"TALLY_TEST_MDS": str(streaming_run["mds"]), "TALLY_TEST_BS": "2"}
    # 2 -> 4 ranks, 2 rows each (the global batch kept), the state loaded: streaming
    # re-partitions the 80 samples consumed; the plan ends the epoch with every sample once.
    code, v = preflight(cli, streaming_run, "s", "make_streaming", 4, "--states",
                        str(streaming_run["states"]), **env)
    assert code == 0, v["findings"]
    n = v["numbers"]
    assert (n["loader_kind"], n["checkpoint_step"], n["old_hosts"]) == ("streaming", S_CUT, 2)
    assert n["old_global_batch"] == n["new_global_batch"] == 2 * S_BS
    assert n["repeats"] == 0 and n["skipped"] == 0 and n["reached_multiple"]
    # The same relaunch forgetting the state: a fresh dataset at step 10 starts the epoch over.
    code, v = preflight(cli, streaming_run, "s", "make_streaming", 4, "--at-step", str(S_CUT),
                        **env)
    assert code == 1 and "repeats" in {f["code"] for f in v["findings"]}, v["findings"]
    assert v["numbers"]["repeats"] == S_CUT * 2 * S_BS  # the 80 samples read before


def test_streaming_replay_from_state_equals_live(cli, streaming_run, tmp_path):
    code, out, err = cli("replay", "--loader", "tests.test_loader_preflight_torch:make_streaming",
                         "--hosts", "2", "--steps", str(N_MDS // (2 * S_BS) - S_CUT),
                         "--spool", str(tmp_path / "r"),
                         "--run", "s", "--manifest", str(streaming_run["manifest"]), "--states",
                         str(streaming_run["states"]), "--json",
                         TALLY_TEST_MDS=str(streaming_run["mds"]))
    assert code == 0, err
    live = spool_table(streaming_run["dir"] / "spool", "s")
    live = live.filter(pa.compute.greater_equal(live["step"], S_CUT))
    assert json.loads(out)["first_step"] == S_CUT and json.loads(out)["rows"] == len(live)
    assert spool_table(tmp_path / "r", "s").equals(live)
    # A topology streaming cannot lay out, and a state file that is not one: one line each.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "streaming.json").write_text("{}")
    for extra, said in ((["--ranks-per-node", "3"], "does not divide --hosts 2"),
                        (["--states", str(bad)], "not a Streaming loader state")):
        code, _, err = cli("replay", "--loader",
                           "tests.test_loader_preflight_torch:make_streaming", "--hosts", "2",
                           "--steps", "3", "--spool", str(tmp_path / "x"), "--run", "s",
                           "--manifest", str(streaming_run["manifest"]), *extra,
                           TALLY_TEST_MDS=str(streaming_run["mds"]))
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert not np.any([p.suffix == ".parquet" for p in (tmp_path / "x").rglob("*")])
