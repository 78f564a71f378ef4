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
