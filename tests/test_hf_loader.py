"""Hugging Face `datasets` through a torch DataLoader, audited in one line
(tally.pipeline.loaders.hf_datasets): map-style nodes of `split_dataset_by_node` record each row's
index in the dataset that was split (truth read back from the tokens), reconcile over the
`tally manifest` of the saved dataset is PASS, and `tally replay` writes the same rows; an
IterableDataset records the key its examples carry, a StatefulDataLoader restore continues it
exactly, and ranks that forget `split_dataset_by_node` are named by reconcile with their numbers
next to the same setup split (PASS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# Hugging Face datasets through real torch loaders with workers, replayed and reconciled.
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")
pytest.importorskip("torchdata")

from datasets.distributed import split_dataset_by_node  # noqa: E402
from torch.utils.data import DataLoader, RandomSampler  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from tally.pipeline.loaders import AttachError, hf_datasets  # noqa: E402
from tests.test_loader_preflight_torch import cli  # noqa: E402,F401  (the in-process CLI fixture)

ROOT = Path(__file__).resolve().parent.parent
SEQ = 8


def record_tokens(i: int) -> list[int]:
    return np.random.default_rng(9_000 + i).integers(1, 50_000, SEQ).tolist()


def token_dataset(n: int, keyed: bool = False) -> datasets.Dataset:
    ds = datasets.Dataset.from_dict({"input_ids": [record_tokens(i) for i in range(n)]})
    if keyed:  # the user's one line for an IterableDataset: the row index, before any shuffle
        ds = ds.map(lambda _, i: {"tally_key": i}, with_indices=True)
    return ds


def saved(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "hf"
    if not path.exists():
        token_dataset(n).save_to_disk(str(path), num_shards=2)
    return path


def truth(batch: dict, by_tokens: dict) -> list[int]:
    return [by_tokens[tuple(row.tolist())] for row in batch["input_ids"]]


def by_tokens_of(n: int) -> dict:
    return {tuple(record_tokens(i)): i for i in range(n)}


def spool_table(spool: Path, run: str = "r") -> pa.Table:
    files = sorted(Path(spool, run).rglob("seg-*.parquet"))
    t = pa.concat_tables([pq.read_table(f, partitioning=None) for f in files])
    cols = ["step", "host", "row", "record_key", "content_hash", "n_tokens", "epoch"]
    return t.select(cols).sort_by([("step", "ascending"), ("host", "ascending"),
                                   ("row", "ascending")])


def tally(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tally.audit.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, env={**os.environ, **(env or {})})


def tally_manifest(dataset_dir: Path, out: Path) -> Path:
    r = tally("manifest", str(dataset_dir), "-o", str(out), "-q", "--tokens-field", "input_ids")
    assert r.returncode == 0, r.stderr
    return out


def reconcile(spool: Path, m: Path, out: Path) -> dict:
    r = tally("reconcile", "--spool", str(spool), "--manifest", str(m), "--run", "r", "-o",
              str(out), "-q", "--json")
    assert r.returncode in (0, 1), r.stderr
    return json.loads((out / "report.json").read_text())


def make_loader(host: int, hosts: int) -> DataLoader:
    """The factory `tally replay --loader tests.test_hf_loader:make_loader` calls: node `host`
    of the saved dataset, split and marked by hf_datasets.split_dataset_by_node."""
    full = datasets.load_from_disk(os.environ["TALLY_TEST_HF"]).with_format("torch")
    node = hf_datasets.split_dataset_by_node(full, host, hosts)
    return DataLoader(node, batch_size=4, sampler=RandomSampler(
        node, generator=torch.Generator().manual_seed(17 + host)))


def test_node_keys_are_datasets_shards():
    """NodeKeys gives each node's rows as Dataset.shard (split_dataset_by_node) takes them."""
    for n in (4, 7, 10, 101):  # datasets refuses an empty shard (n < world size)
        ds = datasets.Dataset.from_dict({"i": list(range(n))})
        for w in (1, 3, 4):
            for r in range(w):
                for contiguous in (True, False):
                    node = ds.shard(w, r, contiguous=contiguous)
                    keys = hf_datasets.NodeKeys(n, r, w, contiguous)
                    assert keys.length == len(node)
                    assert keys(np.arange(len(node))).tolist() == node["i"]


def test_map_style_nodes_true_keys_reconcile_pass_and_replay(tmp_path):
    n, hosts = 101, 3  # 34, 34, 33 rows a node
    path = saved(tmp_path, n)
    full = datasets.load_from_disk(str(path)).with_format("torch")
    by_tokens = by_tokens_of(n)
    got_all = {}
    for h in range(hosts):
        def loader_of(h=h):
            node = split_dataset_by_node(full, rank=h, world_size=hosts)
            return DataLoader(node, batch_size=4, sampler=RandomSampler(
                node, generator=torch.Generator().manual_seed(17 + h)))
        bare = list(loader_of())
        loader = hf_datasets.audited(loader_of(), tmp_path / "live", "r", full=full, rank=h,
                                     world_size=hosts, fsync=False)
        got = list(loader)
        loader.writer.finish()
        assert len(got) == len(bare) == 9
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(got, bare,
                                                                                   strict=True))
        got_all[h] = got
    t = spool_table(tmp_path / "live").to_pydict()
    step, host, key = (np.array(t[c]) for c in ("step", "host", "record_key"))
    for h, got in got_all.items():
        for s, batch in enumerate(got):
            assert key[(step == s) & (host == h)].tolist() == truth(batch, by_tokens)
    assert sorted(key.tolist()) == list(range(n))

    m = tally_manifest(path, tmp_path / "m.parquet")
    rep = reconcile(tmp_path / "live", m, tmp_path / "rep")
    assert rep["verdict"] == "PASS", rep["findings"]
    assert rep["coverage"]["never_seen"] == 0

    # Replay from the loader factory (the node marked by hf_datasets.split_dataset_by_node):
    # the live spool row for row, into a spool marked replayed.
    r = tally("replay", "--loader", "tests.test_hf_loader:make_loader", "--hosts", str(hosts),
              "--steps", "9", "--spool", str(tmp_path / "replay"), "--run", "r", "--manifest",
              str(m), "--json", env={"TALLY_TEST_HF": str(path)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rows"] == n
    assert spool_table(tmp_path / "replay").equals(spool_table(tmp_path / "live"))
    meta = pq.read_schema(next((tmp_path / "replay").rglob("seg-*.parquet"))).metadata
    assert meta[b"tally.replayed"] == b"1"
    assert meta[b"tally.records_per_epoch"] == str(n).encode()  # the whole dataset's


def test_refused_in_one_line(tmp_path):
    full = token_dataset(10).with_format("torch")
    node = split_dataset_by_node(full, rank=0, world_size=3)
    with pytest.raises(AttachError, match="has 4 rows; shard 0 of 2"):
        hf_datasets.audited(DataLoader(node, batch_size=2), tmp_path, "r", full=full, rank=0,
                            world_size=2)
    with pytest.raises(AttachError, match="together"):
        hf_datasets.audited(DataLoader(node, batch_size=2), tmp_path, "r", full=full)
    plain = token_dataset(10).to_iterable_dataset().with_format("torch")  # no key column
    loader = hf_datasets.audited(DataLoader(plain, batch_size=2), tmp_path, "r", host=0,
                                 host_count=1, fsync=False)
    with pytest.raises(AttachError, match="with_indices=True"):
        next(iter(loader))
    loader.writer.close()


def iterable_node(n: int, shards: int, rank: int, world: int, split: bool = True,
                  shuffle: bool = False):
    ds = token_dataset(n, keyed=True).to_iterable_dataset(num_shards=shards)
    if shuffle:
        ds = ds.shuffle(seed=5, buffer_size=16)
    ds = ds.with_format("torch")
    return split_dataset_by_node(ds, rank=rank, world_size=world) if split else ds


@pytest.mark.parametrize("shards,world,shuffle,workers", [(4, 2, False, 0), (3, 2, True, 0),
                                                          (4, 2, False, 2)])
def test_iterable_true_keys(tmp_path, shards, world, shuffle, workers):
    n = 50
    by_tokens = by_tokens_of(n)
    seen = []
    for h in range(world):
        bare = list(DataLoader(iterable_node(n, shards, h, world, shuffle=shuffle),
                               batch_size=4, num_workers=workers))
        loader = hf_datasets.audited(
            DataLoader(iterable_node(n, shards, h, world, shuffle=shuffle), batch_size=4,
                       num_workers=workers),
            tmp_path, "r", fsync=False, records_per_epoch=n)  # host from the split
        got = list(loader)
        loader.writer.finish()
        assert len(got) == len(bare)
        for a, b in zip(got, bare, strict=True):
            assert torch.equal(a["input_ids"], b["input_ids"])
        t = spool_table(tmp_path).to_pydict()
        step, host, key = (np.array(t[c]) for c in ("step", "host", "record_key"))
        for s, batch in enumerate(got):
            assert key[(step == s) & (host == h)].tolist() == truth(batch, by_tokens)
        seen += key[host == h].tolist()
    assert sorted(seen) == list(range(n))


def test_iterable_state_dict_restore_continues_keys(tmp_path):
    """A StatefulDataLoader over a split IterableDataset, saved after 5 batches and restored in
    a new loader: the two spools together are the uninterrupted run's, row for row."""
    n, h, world, cut = 60, 1, 2, 5

    def fresh():
        return hf_datasets.audited(StatefulDataLoader(iterable_node(n, 4, h, world),
                                                      batch_size=3),
                                   tmp_path / name, "r", fsync=False, records_per_epoch=n)

    name = "whole"
    whole = fresh()
    list(whole)
    whole.writer.close()
    name = "a"
    first = fresh()
    it = iter(first)
    for _ in range(cut):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
    assert state[hf_datasets.STEP_KEY] == cut
    first.writer.close()
    name = "b"
    second = fresh()
    second.load_state_dict(state)
    list(second)
    second.writer.close()
    both = pa.concat_tables([spool_table(tmp_path / "a"), spool_table(tmp_path / "b")])
    assert spool_table(tmp_path / "b")["step"].to_pylist()[0] == cut
    assert both.equals(spool_table(tmp_path / "whole"))


def test_forgotten_split_named_and_split_passes(tmp_path):
    """3 shards on 2 ranks (not a multiple: datasets' skip-every-other-example fallback). Split
    by node, the ranks read 50 records once between them: PASS. Without
    split_dataset_by_node (datasets' documented pitfall) each rank iterates all 50: reconcile
    names it (`no_sharding`: 50 of 50 records shared by the 2 hosts, each read twice)."""
    n, shards, world = 50, 3, 2
    token_dataset(n).save_to_disk(str(tmp_path / "hf"))
    m = tally_manifest(tmp_path / "hf", tmp_path / "m.parquet")
    for name, split in (("split", True), ("unsplit", False)):
        for h in range(world):
            loader = hf_datasets.audited(
                DataLoader(iterable_node(n, shards, h, world, split=split), batch_size=5),
                tmp_path / name, "r", host=h, host_count=world, fsync=False,
                records_per_epoch=n)
            list(loader)
            loader.writer.finish()
    ok = reconcile(tmp_path / "split", m, tmp_path / "rs")
    assert ok["verdict"] == "PASS", ok["findings"]
    assert ok["coverage"]["never_seen"] == 0
    bad = reconcile(tmp_path / "unsplit", m, tmp_path / "ru")
    assert bad["verdict"] == "FAIL", bad["findings"]
    codes = {f["code"]: f for f in bad["findings"]}
    assert "no_sharding" in codes, bad["findings"]
    assert codes["no_sharding"]["numbers"]["hosts"] == world
    assert "50 of 50 shared" in codes["no_sharding"]["message"]
    assert bad["coverage"]["epoch_duplicate_records"] == n
    assert bad["coverage"]["histogram"]["2"] == n and bad["coverage"]["never_seen"] == 0


def test_interleaved_sources_weighted_by_probabilities_are_a_mixture_not_a_fault(tmp_path):
    """`interleave_datasets` of a web and a code source (a fifth of the records), probabilities
    0.5/0.5, each source shuffled, over 3 epochs (`set_epoch`). Until every source is exhausted:
    code is restarted within each epoch, read about 4 times an epoch to web's once: PASS with
    `domain_weighted` giving the passes (against the whole split's ideal it was FAIL
    `epoch_duplicates`). Until the first is exhausted: each epoch stops when code runs out,
    half of web unread while web records read in another epoch come again: FAIL."""
    from datasets import interleave_datasets

    n = 400
    ds = token_dataset(n).add_column("domain", ["code" if i % 5 == 0 else "web"
                                                for i in range(n)])
    ds.save_to_disk(str(tmp_path / "hf"), num_shards=2)
    m = tally_manifest(tmp_path / "hf", tmp_path / "m.parquet")
    full = datasets.load_from_disk(str(tmp_path / "hf")).map(
        lambda _, i: {hf_datasets.KEY_FIELD: i}, with_indices=True)
    runs = {}
    for strategy in ("all_exhausted", "first_exhausted"):
        sources = [full.filter(lambda r, d=d: r["domain"] == d).to_iterable_dataset(
            num_shards=2).shuffle(seed=i, buffer_size=64) for i, d in enumerate(("web", "code"))]
        mix = interleave_datasets(sources, probabilities=[0.5, 0.5], seed=3,
                                  stopping_strategy=strategy)
        node = mix.remove_columns(["domain"]).with_format("torch")
        loader = hf_datasets.audited(DataLoader(node, batch_size=4), tmp_path / strategy, "r",
                                     host=0, host_count=1, fsync=False, records_per_epoch=n)
        for epoch in range(3 if strategy == "all_exhausted" else 2):
            node.set_epoch(epoch)
            list(loader)
        loader.writer.finish()
        runs[strategy] = reconcile(tmp_path / strategy, m, tmp_path / f"r-{strategy}")
    r = runs["all_exhausted"]
    assert r["verdict"] == "PASS", r["findings"]
    assert r["coverage"]["epoch_duplicates"] > 0 and r["domain_ideal"]["weighted"]
    (f,) = [f for f in r["findings"] if f["code"] == "domain_weighted"]
    passes = f["numbers"]["passes"]
    assert passes["code"] > 3 * passes["web"] and passes["web"] == 3.0
    r = runs["first_exhausted"]
    assert r["verdict"] == "FAIL", r["findings"]
    assert not r["domain_ideal"]["weighted"]
    assert next(d for d in r["domains"] if d["domain"] == "web")["excess_exposures"] > 0


# ---- replay of an IterableDataset: the factory's loader over the key column ------------------

SHARDS, WORKERS, ITER_BS = 4, 2, 6


def saved_stream(host: int, hosts: int, shuffle: bool) -> datasets.IterableDataset:
    """Node `host` of the saved keyed dataset (TALLY_TEST_HF) made iterable in SHARDS shards,
    shuffled or not."""
    full = datasets.load_from_disk(os.environ["TALLY_TEST_HF"])
    stream = full.to_iterable_dataset(num_shards=SHARDS)
    if shuffle:
        # Each shard through its own buffer (datasets 5 would interleave them into one): the
        # shards stay apart, for the split and the workers.
        stream = stream.shuffle(seed=5, buffer_size=8, max_buffer_input_shards=1)
    return split_dataset_by_node(stream.with_format("torch"), rank=host, world_size=hosts)


def make_iterable_loader(host: int, hosts: int) -> StatefulDataLoader:
    """The factory `tally replay` calls for an IterableDataset: `saved_stream`, shuffled unless
    TALLY_TEST_SHUFFLE=0, in a StatefulDataLoader with workers."""
    shuffle = os.environ.get("TALLY_TEST_SHUFFLE", "1") == "1"
    return StatefulDataLoader(saved_stream(host, hosts, shuffle), batch_size=ITER_BS,
                              num_workers=WORKERS)


def make_plain_iterable_loader(host: int, hosts: int) -> DataLoader:
    """A plain torch DataLoader, no workers, over `saved_stream` unshuffled."""
    return DataLoader(saved_stream(host, hosts, shuffle=False), batch_size=ITER_BS)


def live_iterable_run(d: Path, shuffle: bool, n: int = 60, hosts: int = 2, cut: int = 2
                      ) -> dict:
    """`hosts` ranks, each audited live into one spool: `cut` batches, its state saved (json,
    as a checkpoint keeps it), the loader closed; a new loader restored from it (attempt 1,
    resumed at step `cut`) reads the rest of the epoch (each rank's 2 shards of 15 rows, one a
    worker, 6 rows a batch: 6 steps). The records the batches held (truth from the tokens)."""
    from tally.audit.cli import main

    token_dataset(n, keyed=True).save_to_disk(str(d / "hf"))
    assert main(["manifest", str(d / "hf"), "-o", str(d / "m.parquet"), "-q",
                 "--tokens-field", "input_ids"]) == 0
    (d / "states").mkdir()
    os.environ["TALLY_TEST_HF"] = str(d / "hf")
    os.environ["TALLY_TEST_SHUFFLE"] = str(int(shuffle))
    by_tokens, read = by_tokens_of(n), []
    try:
        for h in range(hosts):
            loader = hf_datasets.audited(make_iterable_loader(h, hosts), d / "live", "r",
                                         fsync=False, records_per_epoch=n)
            for k, batch in enumerate(loader):
                read += truth(batch, by_tokens)
                if k + 1 == cut:
                    break
            (d / "states" / f"dataloader_{h}-of-{hosts}.json").write_text(
                json.dumps(loader.state_dict()))
            loader.writer.finish()
            resumed = hf_datasets.audited(make_iterable_loader(h, hosts), d / "live", "r",
                                          fsync=False, records_per_epoch=n, attempt=1,
                                          resumed_from_step=cut)
            resumed.load_state_dict(json.loads(
                (d / "states" / f"dataloader_{h}-of-{hosts}.json").read_text()))
            read += [key for batch in resumed for key in truth(batch, by_tokens)]
            resumed.writer.finish()
    finally:
        os.environ.pop("TALLY_TEST_HF")
        os.environ.pop("TALLY_TEST_SHUFFLE")
    return {"dir": d, "n": n, "hosts": hosts, "cut": cut, "manifest": d / "m.parquet",
            "read": read}


@pytest.fixture(scope="module")
def iterable_run(tmp_path_factory):
    """The shuffled run of `live_iterable_run`, ingested."""
    from tally.audit.cli import main

    run = live_iterable_run(tmp_path_factory.mktemp("hf_iter"), shuffle=True)
    d = run["dir"]
    assert main(["ingest", str(d / "live"), "--ledger", str(d / "ledger.duckdb"), "-q"]) == 0
    return run


def replay_args(run: dict, spool: Path, steps: int, *extra: str) -> list[str]:
    return ["replay", "--loader", "tests.test_hf_loader:make_iterable_loader", "--hosts",
            str(run["hosts"]), "--steps", str(steps), "--spool", str(spool), "--run", "r",
            "--manifest", str(run["manifest"]), "--json", *extra]


def test_iterable_replay_equals_the_live_spool_across_a_restore(cli, iterable_run):  # noqa: F811
    """`tally replay` of the factory from the beginning writes the live spool up to the
    checkpoint, and from the saved states the live spool after it, row for row (step, host,
    row, key, content hash, tokens, epoch), workers and shuffle buffers included."""
    run, d = iterable_run, iterable_run["dir"]
    env = {"TALLY_TEST_HF": str(d / "hf")}
    live = spool_table(d / "live")
    resumed = pa.compute.greater_equal(live["step"], run["cut"])
    before, after = live.filter(pa.compute.invert(resumed)), live.filter(resumed)
    assert before["step"].to_pylist()[-1] == run["cut"] - 1
    steps_after = after["step"].to_pylist()[-1] + 1 - run["cut"]  # buffers lost: < 4 steps
    code, out, err = cli(*replay_args(run, d / "r0", run["cut"]), **env)
    assert code == 0, err
    assert spool_table(d / "r0").equals(before)
    code, out, err = cli(*replay_args(run, d / "r1", steps_after, "--states",
                                      str(d / "states")), **env)
    assert code == 0, err
    assert json.loads(out)["first_step"] == run["cut"]
    assert spool_table(d / "r1").equals(after)
    meta = pq.read_schema(next((d / "r1").rglob("seg-*.parquet"))).metadata
    assert meta[b"tally.replayed"] == b"1"


def test_shuffle_buffer_lost_on_restore_named_and_unshuffled_passes(cli, iterable_run,  # noqa: F811
                                                                    tmp_path):
    """datasets' documented caveat: a restored IterableDataset refills its shuffle buffer from
    where its source stood, so the examples the buffer held at the checkpoint are never read.
    Reconcile of the live spool across the restore names them with the count the loaders'
    own batches show; the same run without the buffer is PASS."""
    run, d = iterable_run, iterable_run["dir"]
    lost = run["n"] - len(set(run["read"]))
    assert len(run["read"]) == len(set(run["read"])) and lost > 0
    code, _, err = cli("reconcile", "--spool", str(d / "live"), "--manifest",
                       str(run["manifest"]), "--run", "r", "-o", str(d / "rep"), "-q")
    assert code == 0, err
    bad = json.loads((d / "rep" / "report.json").read_text())
    assert bad["verdict"] == "FAIL" and bad["coverage"]["never_seen"] == lost, bad["findings"]
    # The resume is named, with the lost records: its loader ran out of data in the epoch (a
    # short last batch), so the records it never read are the restore's, not a batch change.
    (named,) = [f for f in bad["findings"] if f["severity"] == "FAIL"]
    assert named["code"] == "resume_band", bad["findings"]
    assert {k: named["numbers"][k] for k in ("step", "repeated", "skipped")} == {
        "step": run["cut"], "repeated": 0, "skipped": lost}
    assert "shuffle buffer not restored" in named["message"]
    assert bad["batch_changes"] == []
    plain = live_iterable_run(tmp_path, shuffle=False)
    assert sorted(plain["read"]) == list(range(plain["n"]))
    code, _, err = cli("reconcile", "--spool", str(tmp_path / "live"), "--manifest",
                       str(plain["manifest"]), "--run", "r", "-o", str(tmp_path / "rep"), "-q")
    assert code == 0, err
    ok = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert ok["verdict"] == "PASS" and ok["coverage"]["never_seen"] == 0, ok["findings"]


def test_iterable_replay_refusals_are_one_line(cli, iterable_run, tmp_path):  # noqa: F811
    """A dataset without the key column, states saved on 2 ranks replayed on 4 where each rank
    read whole shards of its own, a states file that is no datasets state, and hashes read from
    the source: each refused in one line, before anything is written (pre-flight plans the
    4-rank restore, and says what it does)."""
    run, d = iterable_run, iterable_run["dir"]
    keyless = tmp_path / "keyless"
    token_dataset(run["n"]).save_to_disk(str(keyless))
    bad = tmp_path / "bad"
    bad.mkdir()
    for h in range(2):
        (bad / f"dataloader_{h}-of-2.json").write_text(json.dumps({"_num_yielded": 3}))
    states = ["--states", str(d / "states")]
    cases = [({"TALLY_TEST_HF": str(keyless)}, [], "has no 'tally_key' column (columns: "
              "input_ids): add the row index"),
             ({}, [*states, "--hosts", "4"], "states saved on 2 ranks, the loader's dataset "
              "is split over 4: datasets gives each of 2 ranks whole shards of the 4"),
             ({}, ["--states", str(bad)], "dataloader_0-of-2.json: not a saved "
              "StatefulDataLoader state (ValueError: no datasets IterableDataset state"),
             ({}, ["--hashes", "source"], "replayed over its 'tally_key' column alone")]
    for env, extra, said in cases:
        code, _, err = cli(*replay_args(run, tmp_path / "x", 3, *extra),
                           **{"TALLY_TEST_HF": str(d / "hf"), **env})
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").rglob("*.parquet"))
    # Pre-flight plans what replay refuses here: datasets loads old rank h's place in its 2
    # whole shards into new rank h of 4 (one shard each), so ranks 2 and 3 start their own
    # shard where old ranks 0 and 1 stood in theirs, passing over its first rows: UNSAFE.
    code, out, err = cli("preflight", "--run", "r", "--ledger", str(d / "ledger.duckdb"),
                         "--manifest", str(run["manifest"]), "--loader",
                         "tests.test_hf_loader:make_iterable_loader", "--hosts", "4", "--states",
                         str(d / "states"), "--json", "-q", TALLY_TEST_HF=str(d / "hf"))
    assert code == 1, err
    v = json.loads(out)
    assert v["numbers"]["loader_kind"] == "hf_iterable" and v["numbers"]["skipped"] > 0, v
    # What the replay runs: the factory's loader, its batches the key column alone.
    os.environ["TALLY_TEST_HF"] = str(d / "hf")
    try:
        batch = next(iter(hf_datasets.key_only(make_iterable_loader(0, 2))))
    finally:
        os.environ.pop("TALLY_TEST_HF")
    assert set(batch) == {"tally_key"} and batch["tally_key"].shape == (ITER_BS,)


def test_iterable_replay_of_a_plain_loader_across_epochs(cli, tmp_path):  # noqa: F811
    """A plain DataLoader (no workers; its audited state is the dataset's) over a split
    IterableDataset for three epochs, the loop calling set_epoch (datasets reorders the shards
    by epoch), a state saved 2 steps into the third: replay from the beginning writes every
    epoch as the live run read it, and from the state the rest of the third (the state's epoch
    set on the dataset before it is restored, as the job sets it)."""
    from tally.audit.cli import main

    n, hosts = 60, 2
    token_dataset(n, keyed=True).save_to_disk(str(tmp_path / "hf"))
    assert main(["manifest", str(tmp_path / "hf"), "-o", str(tmp_path / "m.parquet"), "-q",
                 "--tokens-field", "input_ids"]) == 0
    (tmp_path / "states").mkdir()
    os.environ["TALLY_TEST_HF"] = str(tmp_path / "hf")
    try:
        for h in range(hosts):
            loader = hf_datasets.audited(make_plain_iterable_loader(h, hosts),
                                         tmp_path / "live", "r", fsync=False,
                                         records_per_epoch=n)
            for epoch in range(3):
                loader.dataset.set_epoch(epoch)
                for k, _ in enumerate(loader):
                    if (epoch, k) == (2, 1):
                        (tmp_path / "states" / f"dataloader_{h}-of-{hosts}.json").write_text(
                            json.dumps(loader.state_dict()))
            loader.writer.finish()
    finally:
        os.environ.pop("TALLY_TEST_HF")
    live = spool_table(tmp_path / "live")
    assert live["step"].to_pylist()[-1] == 14 and set(live["epoch"].to_pylist()) == {0, 1, 2}
    order = {e: live.filter(pa.compute.equal(live["epoch"], e))["record_key"].to_pylist()
             for e in (0, 2)}
    assert order[0] != order[2], order  # datasets' shard order of epoch 2 is not epoch 0's
    args = ["replay", "--loader", "tests.test_hf_loader:make_plain_iterable_loader", "--hosts",
            str(hosts), "--run", "r", "--manifest", str(tmp_path / "m.parquet"), "--json"]
    env = {"TALLY_TEST_HF": str(tmp_path / "hf")}
    code, _, err = cli(*args, "--steps", "15", "--spool", str(tmp_path / "r0"), **env)
    assert code == 0, err
    assert spool_table(tmp_path / "r0").equals(live)
    code, out, err = cli(*args, "--steps", "3", "--spool", str(tmp_path / "r1"), "--states",
                         str(tmp_path / "states"), **env)
    assert code == 0, err
    assert spool_table(tmp_path / "r1").equals(
        live.filter(pa.compute.greater_equal(live["step"], 12)))
