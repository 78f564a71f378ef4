"""The reference incident, end to end, on MaxText's OLMo stack as users run it (real Grain, an
OLMo numpy token mix): a sampler that already takes each host's contiguous block of the epoch's
permutation, and a DataLoader also given ShardOptions for the host (sharded twice). Audited live
with one line and by `tally replay` from the loader's contract; reconcile names the cause with
the true never-seen and seen-2+ fractions; the same stack sharded once is PASS."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from absl import flags

from tally.audit import LedgerWriter
from tally.pipeline.grain_attach import audited
from tally.pipeline.olmo import write_mix
from tests.support import olmo_stack
from tests.support.cli import tally
from tests.support.spool import spool_table

# Grain loaders on 4-8 hosts, replayed through the CLI and reconciled.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SEQ = 16
N = 4096  # instances in the mix: 2,048 of each file


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    flags.FLAGS.mark_as_parsed()
    d = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(5)
    index = write_mix(d / "mix", [("web", rng.integers(0, 60_000, N // 2 * SEQ + 7)),
                                  ("code", rng.integers(0, 60_000, N // 2 * SEQ))],
                      SEQ, "uint32")
    r = tally("manifest", str(index), "-o", str(d / "manifest.parquet"), "-q")
    assert r.returncode == 0, r.stderr
    source = olmo_stack.MixSource(index)
    by_tokens = {source[i]["tokens"].astype(np.int32).tobytes(): i for i in range(N)}
    assert len(by_tokens) == N  # random instances: the tokens name the instance
    return {"index": index, "manifest": d / "manifest.parquet", "by_tokens": by_tokens,
            "dir": d}


def live(mix, spool, run, hosts, batch, steps, sharding):
    """Every host's loader wrapped in one line; the truth read from the batches' tokens."""
    truth = np.zeros(N, np.int64)
    for h in range(hosts):
        loader = olmo_stack.build(mix["index"], h, hosts, batch=batch, sharding=sharding)
        with LedgerWriter(spool, run, host=h, host_count=hosts, records_per_epoch=N,
                          flush_every=1000, fsync=False) as w:
            it = iter(audited(loader, w))
            for _ in range(steps):
                b = next(it)
                assert set(b) == {"inputs", "targets", "inputs_segmentation"}
                for row in b["inputs"]:
                    truth[mix["by_tokens"][row.astype(np.int32).tobytes()]] += 1
    return truth


def reconcile(mix, spool, run, out):
    r = tally("reconcile", "--spool", str(spool), "--manifest", str(mix["manifest"]), "--run",
              run, "-o", str(out), "-q", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads((out / "report.json").read_text())


def fractions(counts):
    return (counts == 0).mean(), (counts >= 2).mean()


@pytest.mark.parametrize("hosts,batch", [(8, 4), (32, 2)])
def test_sharded_twice_is_named_live_and_by_replay(mix, tmp_path, hosts, batch):
    steps = N // (hosts * batch)  # one epoch's worth of consumption
    truth = live(mix, tmp_path / "spool", "twice", hosts, batch, steps, "twice")
    never, twice = fractions(truth)
    assert 0.3 < never < 0.4 and 0.2 < twice < 0.32  # the incident's shape

    rep = reconcile(mix, tmp_path / "spool", "twice", tmp_path / "live")
    assert rep["verdict"] == "FAIL"
    codes = [f["code"] for f in rep["findings"]]
    assert "with_replacement" in codes, codes
    cov = rep["coverage"]
    assert abs(cov["never_seen_fraction"] - never) < 0.005
    seen2 = cov["histogram_fraction"]["2"] + cov["histogram_fraction"]["3+"]
    assert abs(seen2 - twice) < 0.005
    assert not rep.get("replayed")

    # The same spool without the run: the loader factory replayed from its contract.
    env = {"TALLY_TEST_MIX": str(mix["index"]), "TALLY_TEST_SHARDING": "twice",
           "TALLY_TEST_BATCH": str(batch)}
    r = tally("replay", "--loader", "tests.support.olmo_stack:make_loader", "--hosts", str(hosts),
              "--steps", str(steps), "--spool", str(tmp_path / "replay"), "--run", "twice",
              "--manifest", str(mix["manifest"]), "--json", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["rows"] == N and out["hosts"] == hosts and out["replayed"] is True
    a, b = spool_table(tmp_path / "spool", "twice"), spool_table(tmp_path / "replay", "twice")
    assert a.equals(b)  # row for row what the live audit recorded
    rep2 = reconcile(mix, tmp_path / "replay", "twice", tmp_path / "replayed")
    assert rep2["replayed"] is True
    assert [f["code"] for f in rep2["findings"]] == codes
    assert rep2["coverage"]["never_seen"] == cov["never_seen"]


def test_sharded_once_passes_live_and_by_replay(mix, tmp_path):
    hosts, batch = 8, 4
    steps = N // (hosts * batch)
    truth = live(mix, tmp_path / "spool", "once", hosts, batch, steps, "once")
    assert (truth == 1).all()
    rep = reconcile(mix, tmp_path / "spool", "once", tmp_path / "live")
    assert rep["verdict"] == "PASS", rep["findings"]
    assert rep["coverage"]["never_seen"] == 0
    env = {"TALLY_TEST_MIX": str(mix["index"]), "TALLY_TEST_SHARDING": "once",
           "TALLY_TEST_BATCH": str(batch)}
    r = tally("replay", "--loader", "tests.support.olmo_stack:make_loader", "--hosts", str(hosts),
              "--steps", str(steps), "--spool", str(tmp_path / "replay"), "--run", "once",
              "--manifest", str(mix["manifest"]), "--hashes", "source", env=env)
    assert r.returncode == 0, r.stderr
    assert "replayed run once: 4,096 record keys of 8 host(s)" in r.stdout
    assert spool_table(tmp_path / "spool", "once").equals(
        spool_table(tmp_path / "replay", "once"))
    assert reconcile(mix, tmp_path / "replay", "once", tmp_path / "rr")["verdict"] == "PASS"


def test_replay_from_checkpointed_loader_states(mix, tmp_path):
    """Grain's per-host checkpoint files: a replay from them continues where the run was."""
    hosts, batch = 4, 4
    env = {"TALLY_TEST_MIX": str(mix["index"]), "TALLY_TEST_SHARDING": "once",
           "TALLY_TEST_BATCH": str(batch), "TALLY_TEST_WORKERS": "0"}
    states = tmp_path / "ckpt"
    states.mkdir()
    for h in range(hosts):
        loader = olmo_stack.build(mix["index"], h, hosts, batch=batch, sharding="once")
        with LedgerWriter(tmp_path / "spool", "ck", host=h, host_count=hosts,
                          records_per_epoch=N, fsync=False) as w:
            it = iter(audited(loader, w))
            for _ in range(10):
                next(it)
            (states / f"process_{h}-of-{hosts}.json").write_bytes(it.get_state())
            for _ in range(7):
                next(it)
    r = tally("replay", "--loader", "tests.support.olmo_stack:make_loader", "--hosts", str(hosts),
              "--steps", "7", "--spool", str(tmp_path / "replay"), "--run", "ck",
              "--manifest", str(mix["manifest"]), "--states", str(states), env=env)
    assert r.returncode == 0, r.stderr
    live_rows = spool_table(tmp_path / "spool", "ck")
    after = live_rows.filter(pa.compute.greater_equal(live_rows["step"], 10))
    assert after.equals(spool_table(tmp_path / "replay", "ck"))


def test_replay_bad_input_is_one_line(mix, tmp_path, cli):
    # The CLI's own main, in this process (as its supervised child runs it): every case is
    # refused before any work, and six child processes importing Grain and JAX cost 40 s.
    env = {"TALLY_TEST_MIX": str(mix["index"]), "TALLY_TEST_BATCH": "4"}
    base = ["replay", "--hosts", "4", "--steps", "3", "--spool", str(tmp_path / "s"),
            "--run", "bad", "--manifest", str(mix["manifest"])]
    cases = {
        "no_such_module:f": "cannot import 'no_such_module'",
        "tests.support.olmo_stack:nope": "has no function 'nope'",
        "tests.support.olmo_stack": "expected MODULE:FUNCTION",
        "tests.support.olmo_stack:make_filtered_loader": "operation 0 (DropRepetitive) is not 1:1",
    }
    for spec, said in cases.items():
        code, _, err = cli(*base, "--loader", spec, **env)
        assert code == 2 and said in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # A state saved for another sampler (Grain's repr check).
    states = tmp_path / "st"
    states.mkdir()
    for h in range(4):
        (states / f"process_{h}-of-4.json").write_text(json.dumps(
            {"last_seen_indices": {"0": 3}, "last_worker_index": 0, "worker_count": 0,
             "sampler": "BlockSampler(total=1, seed=0, shard=0/1)",
             "data_source": "x"}))
    code, _, err = cli(*base, "--loader", "tests.support.olmo_stack:make_loader", "--states",
                       str(states), **env)
    assert code == 2 and "saved for sampler BlockSampler(total=1" in err
    # A state that is not Grain's at all: one line, not a KeyError's traceback.
    for h in range(4):
        (states / f"process_{h}-of-4.json").write_text(json.dumps(
            {"last_seen_indices": {"7": 3}, "last_worker_index": 0, "worker_count": 0}))
    code, _, err = cli(*base, "--loader", "tests.support.olmo_stack:make_loader", "--states",
                       str(states), **env)
    assert code == 2 and "not a Grain DataLoader state" in err, err
    assert len(err.strip().splitlines()) == 1
    assert not list((tmp_path / "s").rglob("*.parquet"))


@pytest.fixture(scope="module")
def eight_host_run(mix, tmp_path_factory):
    """40 steps of the stack sharded once on 8 hosts (4 rows each), ingested; each host's
    loader state saved at step 40 as Grain's checkpoint files."""
    d = tmp_path_factory.mktemp("run8")
    states = d / "states"
    states.mkdir()
    for h in range(8):
        loader = olmo_stack.build(mix["index"], h, 8, batch=4, sharding="once")
        with LedgerWriter(d / "spool", "olmo8", host=h, host_count=8, records_per_epoch=N,
                          fsync=False) as w:
            it = iter(audited(loader, w))
            for _ in range(40):
                next(it)
            (states / f"process_{h}-of-8.json").write_bytes(it.get_state())
    r = tally("ingest", str(d / "spool"), "--ledger", str(d / "ledger.duckdb"), "-q")
    assert r.returncode == 0, r.stderr
    return {"ledger": d / "ledger.duckdb", "states": states}


def preflight(mix, run8, hosts, env, *extra):  # run8: any ingested "olmo8" run
    r = tally("preflight", "--run", "olmo8", "--ledger", str(run8["ledger"]), "--manifest",
              str(mix["manifest"]), "--loader", "tests.support.olmo_stack:make_loader", "--hosts",
              str(hosts), "--json", "-q", *extra, env={"TALLY_TEST_MIX": str(mix["index"]),
                                                       **env})
    assert r.returncode in (0, 1, 2), r.stderr
    v = json.loads(r.stdout)
    assert r.returncode == {"safe": 0, "unsafe": 1, "unknown": 2}[v["status"]]
    return v


def test_preflight_of_the_users_loader_before_a_relaunch_on_4_hosts(mix, eight_host_run):
    start = 40 * 32  # the global position after 40 steps of 32 rows
    # Corrected relaunch: sharded once, the sampler started at the run's position.
    safe = preflight(mix, eight_host_run, 4, {"TALLY_TEST_SHARDING": "once",
                                              "TALLY_TEST_BATCH": "8",
                                              "TALLY_TEST_START": str(start)}, "--at-step", "40")
    assert safe["status"] == "safe", safe
    n = safe["numbers"]
    assert n["reached_multiple"] and n["skipped"] == 0 and n["repeats"] == 0
    assert n["old_global_batch"] == n["new_global_batch"] == 32 and n["old_hosts"] == 8
    # The incident's relaunch: sampler blocks per host and ShardOptions too.
    bad = preflight(mix, eight_host_run, 4, {"TALLY_TEST_SHARDING": "twice",
                                             "TALLY_TEST_BATCH": "8",
                                             "TALLY_TEST_START": str(40 * 8)}, "--at-step", "40")
    assert bad["status"] == "unsafe"
    codes = {f["code"] for f in bad["findings"]}
    assert {"repeats", "skips"} <= codes, codes
    assert bad["numbers"]["first_bad_step"] >= 40 and "UNSAFE" in bad["headline"]
    # A relaunch that forgets the start offset replays the first 40 steps.
    again = preflight(mix, eight_host_run, 4, {"TALLY_TEST_SHARDING": "once",
                                               "TALLY_TEST_BATCH": "8"}, "--at-step", "40")
    assert again["status"] == "unsafe"
    assert again["numbers"]["repeats"] == 40 * 32
    # A global batch changed on the relaunch.
    wider = preflight(mix, eight_host_run, 4, {"TALLY_TEST_SHARDING": "once",
                                               "TALLY_TEST_BATCH": "16",
                                               "TALLY_TEST_START": str(start)}, "--at-step", "40")
    assert "global_batch_changed" in {f["code"] for f in wider["findings"]}


def test_preflight_from_grains_checkpointed_states(mix, eight_host_run):
    env = {"TALLY_TEST_SHARDING": "once", "TALLY_TEST_BATCH": "4"}
    same = preflight(mix, eight_host_run, 8, env, "--states", str(eight_host_run["states"]))
    assert same["status"] == "safe", same
    assert same["numbers"]["checkpoint_step"] == 40
    # The same states restored on 4 hosts (new host h takes old host h's): positions mean
    # other records there.
    moved = preflight(mix, eight_host_run, 4, {**env, "TALLY_TEST_BATCH": "8"}, "--states",
                      str(eight_host_run["states"]))
    assert moved["status"] == "unsafe"
    # A ledger behind the relaunch cannot answer.
    behind = preflight(mix, eight_host_run, 8, env, "--at-step", "90")
    assert behind["status"] == "unknown"
    assert [f["code"] for f in behind["findings"]] == ["ledger_behind"]


@pytest.fixture(scope="module")
def odd_run(tmp_path_factory):
    """A corpus of 1,000 instances (not a multiple of the global batch 32): 10 steps of the
    stack sharded once on 8 hosts, ingested."""
    d = tmp_path_factory.mktemp("odd")
    rng = np.random.default_rng(9)
    index = write_mix(d / "mix", [("web", rng.integers(0, 60_000, 1000 * SEQ))], SEQ, "uint32")
    r = tally("manifest", str(index), "-o", str(d / "manifest.parquet"), "-q")
    assert r.returncode == 0, r.stderr
    for h in range(8):
        loader = olmo_stack.build(index, h, 8, batch=4, sharding="once")
        with LedgerWriter(d / "spool", "olmo8", host=h, host_count=8, records_per_epoch=1000,
                          fsync=False) as w:
            it = iter(audited(loader, w))
            for _ in range(10):
                next(it)
    r = tally("ingest", str(d / "spool"), "--ledger", str(d / "ledger.duckdb"), "-q")
    assert r.returncode == 0, r.stderr
    return {"index": index, "manifest": d / "manifest.parquet", "ledger": d / "ledger.duckdb"}


@pytest.mark.parametrize("workers", ["0", "2"])
def test_preflight_no_false_alarm_across_an_epoch_end_nor_with_workers(odd_run, workers):
    """A correct relaunch whose plan crosses the corpus' end (N = 1,000, global batch 32), on
    loaders with 0 or 2 worker streams, is SAFE; the sharded-twice relaunch is not."""
    mix = {"index": odd_run["index"], "manifest": odd_run["manifest"]}
    env = {"TALLY_TEST_BATCH": "8", "TALLY_TEST_WORKERS": workers}
    ok = preflight(mix, odd_run, 4, {**env, "TALLY_TEST_SHARDING": "once",
                                     "TALLY_TEST_START": str(10 * 32)}, "--at-step", "10")
    assert ok["status"] == "safe", ok["findings"]
    assert ok["numbers"]["reached_multiple"] and ok["numbers"]["planned"] > 1000 - 320
    bad = preflight(mix, odd_run, 4, {**env, "TALLY_TEST_SHARDING": "twice",
                                      "TALLY_TEST_START": str(10 * 8)}, "--at-step", "10")
    assert bad["status"] == "unsafe"
    assert {"repeats", "skips"} & {f["code"] for f in bad["findings"]}


def test_a_replay_that_fails_midway_leaves_no_run_and_can_run_again(mix, tmp_path):
    env = {"TALLY_TEST_MIX": str(mix["index"]), "TALLY_TEST_BATCH": "4"}
    args = ["replay", "--loader", "tests.support.olmo_stack:make_loader", "--hosts", "2", "--steps",
            "30", "--spool", str(tmp_path / "s"), "--run", "r", "--manifest",
            str(mix["manifest"]), "--workers", "1"]
    # Host 0 is written, then host 1's loader cannot be made.
    r = tally(*args, env={**env, "TALLY_TEST_FAIL_HOST": "1"})
    assert r.returncode == 2 and "calling it for host 1 of 2 failed" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not list((tmp_path / "s").rglob("*.parquet"))  # host 0's file is not left behind
    r = tally(*args, env=env)
    assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "s" / "r").rglob("seg-*.parquet"))) == 2
    assert [p.name for p in (tmp_path / "s").iterdir()] == ["r"]  # the work directory gone
