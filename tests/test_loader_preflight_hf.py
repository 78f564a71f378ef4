"""`tally preflight --loader` over a Hugging Face map-style factory: a torch StatefulDataLoader
over `hf_datasets.split_dataset_by_node(full, rank, world_size)` (the node marked with its keys,
the rows' indices in `full`), planned by torch's planner through those marks.

A run on 4 ranks reads one epoch and checkpoints each rank's loader state after step 5. On 2
ranks the nodes are other rows (rank 0 of 2 holds what ranks 0 and 1 of 4 held), so the state
old rank h saved (the sampler's generator and the batches its own node had yielded) restored on
new rank h starts the new node's permutation 5 batches in: rows read before come again and rows
no rank read are passed over. Ground truth comes from the real restored loaders' batches (the
records read back from their tokens); pre-flight refuses the relaunch with those counts. The
same states on 4 ranks, and a fresh epoch on 2 ranks once the epoch is done, are SAFE.

An IterableDataset (`hf_datasets.planned_keys`): the factory's StatefulDataLoaders with workers
over a stream in 3 shards, restored from the saved states on 2 ranks (repeats) and 4 (skips),
refused with the counts the real restored loaders read to their epoch's end; the same world
size and a fresh epoch pass though the epoch's last batches are short; a state datasets cannot
load on the new world size is refused in one line.
"""

from __future__ import annotations

import json
import os

import pytest

# Pre-flight and replay over real Hugging Face datasets loaders.
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")
pytest.importorskip("torchdata")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from tally.pipeline.loaders import hf_datasets  # noqa: E402
from tests.support.checkpointed import read_epoch_checkpointed  # noqa: E402
from tests.test_hf_loader import by_tokens_of, token_dataset, truth  # noqa: E402
from tests.test_loader_preflight_torch import cli  # noqa: E402,F401  (the in-process CLI fixture)

N, GLOBAL, OLD, CUT = 256, 16, 4, 5  # 16 steps an epoch; checkpoint after step 5 (80 rows)
EPOCH = N // GLOBAL


def make_map_loader(host: int, hosts: int) -> StatefulDataLoader:
    """The job's factory: node `host` of the saved dataset (split and marked by
    hf_datasets.split_dataset_by_node), shuffled by a seeded generator, GLOBAL / hosts rows a
    rank."""
    full = datasets.load_from_disk(os.environ["TALLY_TEST_HF"]).with_format("torch")
    node = hf_datasets.split_dataset_by_node(full, host, hosts)
    return StatefulDataLoader(node, batch_size=GLOBAL // hosts, shuffle=True,
                              generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """One epoch on 4 ranks, audited; each rank's state after step CUT saved as
    dataloader_<h>-of-4.pt; the records read before it (truth from the tokens); the
    `tally manifest` of the saved dataset; ingested."""
    from tally.audit.cli import main

    d = tmp_path_factory.mktemp("hf_map")
    token_dataset(N).save_to_disk(str(d / "hf"), num_shards=2)
    os.environ["TALLY_TEST_HF"] = str(d / "hf")
    states = d / "states"
    states.mkdir()
    by_tokens, before = by_tokens_of(N), []
    try:
        assert main(["manifest", str(d / "hf"), "-o", str(d / "m.parquet"), "-q",
                     "--tokens-field", "input_ids"]) == 0
        for h in range(OLD):
            loader = hf_datasets.audited(make_map_loader(h, OLD), d / "spool", "hf", host=h,
                                         host_count=OLD, fsync=False)
            for k, batch in enumerate(loader):
                if k < CUT:
                    before += truth(batch, by_tokens)
                if k + 1 == CUT:
                    # The generator's state is a tensor: torch.save, as a job saves it.
                    torch.save(loader.state_dict(), states / f"dataloader_{h}-of-{OLD}.pt")
            assert k + 1 == EPOCH
            loader.writer.finish()
    finally:
        os.environ.pop("TALLY_TEST_HF")
    assert main(["ingest", str(d / "spool"), "--ledger", str(d / "ledger.duckdb"), "-q"]) == 0
    return {"dir": d, "manifest": d / "m.parquet", "states": states, "before": before,
            "data": d / "hf"}


def preflight(cli, run: dict, hosts: int, *extra: str) -> tuple[int, dict]:  # noqa: F811
    code, out, err = cli("preflight", "--run", "hf", "--ledger",
                         str(run["dir"] / "ledger.duckdb"), "--manifest", str(run["manifest"]),
                         "--loader", "tests.test_loader_preflight_hf:make_map_loader",
                         "--hosts", str(hosts), "--json", "-q", *extra,
                         TALLY_TEST_HF=str(run["data"]))
    assert code in (0, 1), err
    v = json.loads(out)
    assert code == {"safe": 0, "unsafe": 1}[v["status"]]
    return code, v


def test_states_restored_on_2_ranks_refused_with_the_real_counts(cli, hf_run):  # noqa: F811
    # What really happens: the real 2-rank loaders, each restored from old rank h's state,
    # over the plan's horizon (the steps that take the run to one read of each row: 11).
    horizon = (N - CUT * GLOBAL) // GLOBAL
    os.environ["TALLY_TEST_HF"] = str(hf_run["data"])
    try:
        by_tokens, after, steps = by_tokens_of(N), [], []
        for h in range(2):
            loader = make_map_loader(h, 2)
            loader.load_state_dict(torch.load(hf_run["states"] / f"dataloader_{h}-of-{OLD}.pt"))
            batches = [truth(batch, by_tokens) for batch in loader]
            steps.append(len(batches))
            after += [key for batch in batches[:horizon] for key in batch]
    finally:
        os.environ.pop("TALLY_TEST_HF")
    # The sampler resumes 20 rows into its 128-row node (the old node's count), so each new
    # rank would read 108 rows in 14 steps, the last one short: the epoch is not even.
    assert steps == [14, 14]
    before = hf_run["before"]
    assert len(before) == CUT * GLOBAL == len(set(before))
    assert len(after) == horizon * GLOBAL
    repeated = len(set(after) & set(before))
    unseen = N - len(set(after) | set(before))
    assert repeated > 0 and unseen > 0

    code, v = preflight(cli, hf_run, 2, "--states", str(hf_run["states"]))
    assert code == 1, v["findings"]
    said = {f["code"]: f["numbers"] for f in v["findings"] if f["severity"] == "FAIL"}
    assert said == {"repeats": {"exposures": repeated, "records": repeated},
                    "skips": {"exposures": unseen, "records": unseen}}, v["findings"]
    numbers = ("loader_kind", "checkpoint_step", "old_hosts", "old_global_batch",
               "new_global_batch", "horizon_steps", "repeats", "skipped", "first_bad_step")
    assert {k: v["numbers"][k] for k in numbers} == {
        "loader_kind": "torch", "checkpoint_step": CUT, "old_hosts": OLD,
        "old_global_batch": GLOBAL, "new_global_batch": GLOBAL, "horizon_steps": horizon,
        "repeats": repeated, "skipped": unseen, "first_bad_step": CUT}


def test_same_world_restore_and_a_fresh_epoch_on_2_ranks_pass(cli, hf_run):  # noqa: F811
    code, v = preflight(cli, hf_run, OLD, "--states", str(hf_run["states"]))
    assert code == 0, v["findings"]
    assert v["numbers"]["repeats"] == 0 and v["numbers"]["skipped"] == 0
    assert v["numbers"]["reached_multiple"]
    # The epoch done on 4 ranks, the next one fresh on 2: each node's rows once.
    code, v = preflight(cli, hf_run, 2, "--at-step", str(EPOCH))
    assert code == 0, v["findings"]
    n = v["numbers"]
    assert (n["repeats"], n["skipped"], n["horizon_steps"]) == (0, 0, EPOCH)



def make_unmarked_loader(host: int, hosts: int) -> StatefulDataLoader:
    """The same job with datasets' own split_dataset_by_node: the node keeps no keys."""
    from datasets.distributed import split_dataset_by_node

    full = datasets.load_from_disk(os.environ["TALLY_TEST_HF"]).with_format("torch")
    return StatefulDataLoader(split_dataset_by_node(full, host, hosts),
                              batch_size=GLOBAL // hosts)


def test_a_node_without_its_keys_is_refused_in_one_line(cli, hf_run):  # noqa: F811
    """Its indices 0..127 on both ranks would read as records 0..127 twice: a false alarm on a
    correct fresh epoch. Refused instead, saying how to give the keys."""
    code, out, err = cli("preflight", "--run", "hf", "--ledger",
                         str(hf_run["dir"] / "ledger.duckdb"), "--manifest",
                         str(hf_run["manifest"]), "--loader",
                         "tests.test_loader_preflight_hf:make_unmarked_loader", "--hosts", "2",
                         "--at-step", str(EPOCH), TALLY_TEST_HF=str(hf_run["data"]))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("datasets.Dataset has 128 rows, the manifest 256 records, and no keys of its rows"
            in err and "hf_datasets.split_dataset_by_node" in err), err
    # tally replay of the same factory: refused alike, before anything is written.
    code, out, err = cli("replay", "--loader",
                         "tests.test_loader_preflight_hf:make_unmarked_loader", "--hosts", "2",
                         "--steps", "3", "--spool", str(hf_run["dir"] / "x"), "--run", "hf",
                         "--manifest", str(hf_run["manifest"]),
                         TALLY_TEST_HF=str(hf_run["data"]))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "no keys of its rows" in err and not (hf_run["dir"] / "x").exists(), err


# ---- an IterableDataset: the real loaders shadow-run over the key column ---------------------
#
# 96 keyed rows made iterable in 3 shards: 3 divides neither 2 nor 4 ranks, so datasets has
# every rank step through the one stream (every world-size-th example) and its state is a
# place in that stream, which it loads on another world size. Two workers a rank, 5 rows a
# batch: a worker's last batch of an epoch is short (4 ranks: 16 + 8 rows a rank in 4 + 2
# batches), so an epoch is not a whole number of full global batches.

ITER_N, ITER_SHARDS, ITER_GLOBAL, ITER_WORKERS, ITER_CUT = 96, 3, 20, 2, 2


def make_iterable_loader(host: int, hosts: int) -> StatefulDataLoader:
    """The job's factory: rank `host` of the saved keyed dataset made iterable in
    TALLY_TEST_SHARDS (default 3) shards, split by datasets' split_dataset_by_node, in a
    StatefulDataLoader with workers."""
    from datasets.distributed import split_dataset_by_node

    full = datasets.load_from_disk(os.environ["TALLY_TEST_HF"])
    shards = int(os.environ.get("TALLY_TEST_SHARDS", str(ITER_SHARDS)))
    stream = full.to_iterable_dataset(num_shards=shards).with_format("torch")
    return StatefulDataLoader(split_dataset_by_node(stream, rank=host, world_size=hosts),
                              batch_size=ITER_GLOBAL // hosts,
                              num_workers=ITER_WORKERS)


def live_iterable(d, run_id: str, hosts: int, by_tokens: dict) -> tuple[list[int], dict]:
    """`hosts` ranks audited live for a whole epoch into d/spool, each rank's state after
    ITER_CUT batches saved as d/<run_id>/dataloader_<h>-of-<hosts>.json; the records read before
    the cut (truth from the tokens) and each rank's steps an epoch."""
    states = d / run_id
    states.mkdir()
    before, steps = [], {}
    for h in range(hosts):
        loader = hf_datasets.audited(make_iterable_loader(h, hosts), d / "spool", run_id,
                                     fsync=False, records_per_epoch=ITER_N)
        read, steps[h] = read_epoch_checkpointed(
            loader, ITER_CUT, states / f"dataloader_{h}-of-{hosts}.json",
            lambda batch: truth(batch, by_tokens))
        before += read
    return before, steps


@pytest.fixture(scope="module")
def iter_run(tmp_path_factory):
    """Two runs over the same keyed dataset, each a whole epoch audited live with its states
    saved after ITER_CUT steps: "r4" on 4 ranks, "r2" on 2; one ledger."""
    from tally.audit.cli import main

    d = tmp_path_factory.mktemp("hf_iter")
    token_dataset(ITER_N, keyed=True).save_to_disk(str(d / "hf"))
    os.environ["TALLY_TEST_HF"] = str(d / "hf")
    try:
        assert main(["manifest", str(d / "hf"), "-o", str(d / "m.parquet"), "-q",
                     "--tokens-field", "input_ids"]) == 0
        by_tokens = by_tokens_of(ITER_N)
        runs = {name: live_iterable(d, name, hosts, by_tokens)
                for name, hosts in (("r4", 4), ("r2", 2))}
    finally:
        os.environ.pop("TALLY_TEST_HF")
    assert main(["ingest", str(d / "spool"), "--ledger", str(d / "ledger.duckdb"), "-q"]) == 0
    return {"dir": d, "manifest": d / "m.parquet", "data": d / "hf", "runs": runs}


def restored_reads(run: dict, name: str, old: int, hosts: int) -> list[list[list[int]]]:
    """What really happens: the real loaders on `hosts` ranks, each restored from old rank
    h % old's state of run `name`, read to the end of their epoch: each rank's batches (the
    records they hold, from the tokens)."""
    os.environ["TALLY_TEST_HF"] = str(run["data"])
    try:
        by_tokens, out = by_tokens_of(ITER_N), []
        for h in range(hosts):
            loader = make_iterable_loader(h, hosts)
            loader.load_state_dict(json.loads(
                (run["dir"] / name / f"dataloader_{h % old}-of-{old}.json").read_text()))
            out.append([truth(batch, by_tokens) for batch in loader])
    finally:
        os.environ.pop("TALLY_TEST_HF")
    return out


def iter_preflight(cli, run: dict, name: str, hosts: int, *extra: str,  # noqa: F811
                   **env: str) -> tuple[int, dict]:
    code, out, err = cli("preflight", "--run", name, "--ledger",
                         str(run["dir"] / "ledger.duckdb"), "--manifest", str(run["manifest"]),
                         "--loader", "tests.test_loader_preflight_hf:make_iterable_loader",
                         "--hosts", str(hosts), "--json", "-q", *extra,
                         TALLY_TEST_HF=str(run["data"]), **env)
    assert code in (0, 1), err
    v = json.loads(out)
    assert code == {"safe": 0, "unsafe": 1}[v["status"]]
    return code, v


def said_counts(v: dict) -> dict:
    return {f["code"]: f["numbers"] for f in v["findings"] if f["severity"] == "FAIL"}


def test_iterable_states_on_another_world_size_refused_with_the_real_counts(cli, iter_run):  # noqa: F811
    """4 -> 2 ranks: datasets loads old rank h's place in the stream into new rank h, which
    now takes every 2nd example from there: 20 records the run read come again (and none is
    skipped). 2 -> 4: every 4th from the old ranks' place: the 32 records between are never
    read. The epoch's last batches are short (a worker's), so the multiple of N falls inside
    a step; the plan is judged where the restored epoch ends. The counts are what the real
    restored loaders read to the end of their epoch (with their tokens)."""
    for name, old, new in (("r4", 4, 2), ("r2", 2, 4)):
        before = iter_run["runs"][name][0]
        assert len(before) == old * ITER_CUT * (ITER_GLOBAL // old) == len(set(before))
        reads = restored_reads(iter_run, name, old, new)
        after = [k for rank in reads for batch in rank for k in batch]
        assert len(after) == len(set(after))
        repeated = len(set(after) & set(before))
        unseen = ITER_N - len(set(after) | set(before))
        assert (repeated, unseen) == ((20, 0) if new < old else (0, 32))
        code, v = iter_preflight(cli, iter_run, name, new, "--states",
                                 str(iter_run["dir"] / name))
        assert code == 1, v["findings"]
        want = {}
        if repeated:
            want["repeats"] = {"exposures": repeated, "records": repeated}
        if unseen:
            want["skips"] = {"exposures": unseen, "records": unseen}
        assert said_counts(v) == want, v["findings"]
        n = v["numbers"]
        assert (n["loader_kind"], n["checkpoint_step"], n["old_hosts"], n["repeats"],
                n["skipped"]) == ("hf_iterable", ITER_CUT, old, repeated, unseen)
        # Judged where every new rank's epoch ends: the restored loaders' own last step.
        assert n["epoch_end_step"] == ITER_CUT + max(len(rank) for rank in reads) - 1
        assert n["first_bad_step"] == ITER_CUT


def test_iterable_same_world_and_a_fresh_epoch_pass(cli, iter_run):  # noqa: F811
    """Clean traps. The states restored on their own world size read the rest of the epoch
    in more steps than whole global batches would (the short batches, one a worker): SAFE,
    judged at the epoch's end, where the default horizon of whole batches (3 steps) stopped
    before (nothing checked). A fresh epoch on 2 ranks once the epoch is done plans past its
    end into the next (the ranks' epochs end at once, the plan goes on until all have):
    SAFE, what the next epoch plans not counted against this one."""
    for name, old in (("r4", 4), ("r2", 2)):
        reads = restored_reads(iter_run, name, old, old)
        whole = -(-(ITER_N - ITER_CUT * ITER_GLOBAL) // ITER_GLOBAL)
        assert max(len(rank) for rank in reads) > whole  # short batches: 4 steps, not 3
        code, v = iter_preflight(cli, iter_run, name, old, "--states",
                                 str(iter_run["dir"] / name))
        assert code == 0, v["findings"]
        n = v["numbers"]
        assert (n["repeats"], n["skipped"], n["epoch_end_step"]) == (
            0, 0, ITER_CUT + max(len(rank) for rank in reads) - 1)
        assert "horizon_short" not in {f["code"] for f in v["findings"]}
    epoch = iter_run["runs"]["r4"][1][0]
    code, v = iter_preflight(cli, iter_run, "r4", 2, "--at-step", str(epoch))
    assert code == 0, v["findings"]
    n = v["numbers"]
    assert (n["repeats"], n["skipped"], n["old_global_batch"]) == (0, 0, ITER_GLOBAL)
    assert n["planned"] > ITER_N and n["epoch_end_step"] >= epoch + ITER_N // ITER_GLOBAL


def test_iterable_state_datasets_cannot_load_is_refused_in_one_line(cli, iter_run):  # noqa: F811
    """6 shards: on 4 ranks datasets steps through the one stream, on 2 it gives each rank
    whole shards; the states differ in shape and datasets fails to load one into the other
    (checked with the real loaders). Pre-flight refuses it in one line, naming why."""
    from tally.pipeline.loaders import hf_datasets as hf

    d = iter_run["dir"]
    os.environ["TALLY_TEST_HF"] = str(iter_run["data"])
    os.environ["TALLY_TEST_SHARDS"] = "6"
    try:
        states = d / "six"
        states.mkdir(exist_ok=True)
        for h in range(4):
            loader = hf.audited(make_iterable_loader(h, 4), d / "six-spool", "six",
                                fsync=False, records_per_epoch=ITER_N)
            it = iter(loader)
            for _ in range(ITER_CUT):
                next(it)
            (states / f"dataloader_{h}-of-4.json").write_text(json.dumps(loader.state_dict()))
            loader.writer.close()
        relaunched = make_iterable_loader(0, 2)
        relaunched.load_state_dict(json.loads((states / "dataloader_0-of-4.json").read_text()))
        with pytest.raises(KeyError):  # datasets' own, raised again from the worker
            next(iter(relaunched))
    finally:
        os.environ.pop("TALLY_TEST_HF")
        os.environ.pop("TALLY_TEST_SHARDS")
    code, out, err = cli("preflight", "--run", "r4", "--ledger", str(d / "ledger.duckdb"),
                         "--manifest", str(iter_run["manifest"]), "--loader",
                         "tests.test_loader_preflight_hf:make_iterable_loader", "--hosts", "2",
                         "--states", str(states), TALLY_TEST_HF=str(iter_run["data"]),
                         TALLY_TEST_SHARDS="6")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("states saved on 4 ranks, the loader's dataset is split over 2: of its 6 shards "
            "datasets gives each of 2 ranks whole shards but has each of 4 ranks step "
            "through the one stream" in err), err
