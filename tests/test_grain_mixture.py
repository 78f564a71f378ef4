"""MaxText's Grain mixture audited in one line: `grain.MapDataset.mix` over ArrayRecord files of
`tf.train.Example` (MaxText's `grain_train_files="web/*:0.5;code/*:0.5"`), shuffled, repeated,
sliced per host, batched. The keys come from Grain's own selection map and the sources' files
(MaxText lists them with glob, in directory order, where the manifest sorts them), the epochs
are each source's own passes, and the reconcile measures each domain by its own ideal. Real
Grain, real ArrayRecord files, the real manifest job; the document hashes the tests compare
against travel in a batch field the attach never reads."""

from __future__ import annotations

import glob
import json

import grain
import numpy as np
import pytest
from absl import flags
from array_record.python.array_record_module import ArrayRecordWriter

from tally.audit.core.hashing import bytes_hash
from tally.pipeline.formats.tf_example import example_class
from tally.pipeline.grain_attach import AttachError, audited, leaves, source_indices
from tests.test_grain_attach import spool_rows

LENGTH = 64


@pytest.fixture(autouse=True, scope="module")
def _absl():
    flags.FLAGS.mark_as_parsed()  # Grain's worker processes read absl flags


def _write(path, texts, domain=None):
    example = example_class()
    w = ArrayRecordWriter(str(path), "group_size:1")
    for t in texts:
        e = example()
        e.features.feature["text"].bytes_list.value.append(t.encode())
        if domain is not None:
            e.features.feature["domain"].bytes_list.value.append(domain.encode())
        w.write(e.SerializeToString())
    w.close()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """web: 60 documents in 2 files; code: 20 in 1; its manifest (keys: code first, sorted)."""
    from tally.pipeline.manifest import build_manifest

    root = tmp_path_factory.mktemp("mix")
    (root / "web").mkdir()
    (root / "code").mkdir()
    for part in range(2):
        _write(root / "web" / f"web-{part}.array_record",
               [f"web page {part}-{i} " * (1 + i % 4) for i in range(30)], "web")
    _write(root / "code" / "code-0.array_record",
           [f"def f{i}(): return {i}" for i in range(20)], "code")
    build_manifest(root, root / "manifest.parquet", chunk_records=25)
    return root


class Parse(grain.transforms.Map):
    """MaxText's ParseFeatures and PadOrTrim, in one 1:1 map: the text's bytes, padded; and
    the document's hash for the tests (the attach never reads it)."""

    def map(self, raw: bytes) -> dict:
        e = example_class()()
        e.ParseFromString(raw)
        text = e.features.feature["text"].bytes_list.value[0]
        out = np.zeros(LENGTH, np.int32)
        b = np.frombuffer(text, np.uint8)[:LENGTH]
        out[: len(b)] = b
        return {"inputs": out, "doc_hash": np.uint64(bytes_hash(text))}


class Shift(grain.transforms.Map):
    """MaxText's ShiftData after the batch (1:1 on batches)."""

    def map(self, batch: dict) -> dict:
        return {**batch, "targets": np.roll(batch["inputs"], -1, axis=1)}


def get_datasets(root, patterns, host, hosts, *, epochs=3, shard=True, batch=4):
    """MaxText's get_datasets for ArrayRecord: glob each pattern (directory order: here
    reversed from sorted, as glob may give it), mix by weight, shuffle, repeat, slice."""
    sources = [grain.MapDataset.source(grain.sources.ArrayRecordDataSource(
        sorted(glob.glob(str(root / p)), reverse=True))) for p, _ in patterns]
    ds = grain.MapDataset.mix(sources, [w for _, w in patterns]) if len(sources) > 1 else \
        sources[0]
    ds = ds.shuffle(seed=5).repeat(epochs)
    if shard:
        ds = ds[host::hosts]
    return ds.to_iter_dataset().map(Parse()).batch(batch, drop_remainder=False)


MIX = [("web/*.array_record", 0.5), ("code/*.array_record", 0.5)]


def run(corpus, spool, patterns=MIX, hosts=2, **kw):
    got = []
    for h in range(hosts):
        ds = audited(get_datasets(corpus, patterns, h, hosts, **kw), spool, run_id="r",
                     host=h, host_count=hosts, hashes=corpus / "manifest.parquet")
        got.append(list(ds))
        ds.writer.finish()
    return got


def test_mixture_keys_follow_grains_selection_map_and_each_sources_passes():
    class Ids(grain.sources.RandomAccessDataSource):
        def __init__(self, n, base):
            self.n, self.base = n, base

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return self.base + i

    small, large = grain.MapDataset.source(Ids(10, 0)), grain.MapDataset.source(Ids(40, 10))
    for mixed in (grain.MapDataset.mix([small, large.shuffle(seed=4)], [0.5, 0.5]),
                  grain.MapDataset.concatenate([small, large]),
                  grain.MapDataset.mix([grain.MapDataset.mix([small, large], [1, 3]),
                                        grain.MapDataset.source(Ids(7, 50))], [0.9, 0.1])):
        ds = mixed.shuffle(seed=1).repeat(4)[1::2]
        keys, epochs = source_indices(ds, np.arange(len(ds)))
        assert keys.tolist() == [ds[i] for i in range(len(ds))]  # Grain's own answer
        assert len(leaves(ds)) == 50 + 7 * (len(leaves(ds).sources) == 3)
        pairs = set(zip(keys.tolist(), epochs.tolist(), strict=True))
        assert len(pairs) == len(keys)  # no record twice within one pass of its source
    # The even mix reads the 10 small records in each of 4 mix epochs and the next 10 of the
    # large source: the small source's epochs 0..3, the large one's 0 only.
    ds = grain.MapDataset.mix([small, large], [0.5, 0.5]).shuffle(seed=1).repeat(4)
    keys, epochs = source_indices(ds, np.arange(len(ds)))
    assert sorted(set(epochs[keys < 10].tolist())) == [0, 1, 2, 3]
    assert set(epochs[keys >= 10].tolist()) == {0} and len(set(keys[keys >= 10].tolist())) == 40


def test_maxtexts_mixture_over_array_record_files_is_keyed_by_file(corpus, tmp_path):
    import pyarrow.parquet as pq

    got = run(corpus, tmp_path / "spool")
    rows = spool_rows(tmp_path / "spool")
    # Every row's hash (the manifest's, by the key the attach gave it) is the hash of the
    # document the loop got at that place.
    want = [int(h) for host in got for b in host for h in b["doc_hash"]]
    by_host = sorted(zip(rows["host"].tolist(), rows["step"].tolist(), rows["row"].tolist(),
                         rows["content_hash"].tolist(), strict=True))
    assert [h for *_, h in by_host] == want
    m = pq.read_table(corpus / "manifest.parquet").to_pydict()
    domain = dict(zip(m["record_key"], m["domain"], strict=True))
    keys = rows["record_key"].tolist()
    assert {domain[k] for k in keys} == {"web", "code"}
    # 3 mix epochs of 40 (20 code + 20 web): code's 20 records 3 times, web's first 60 once.
    code = [k for k in keys if domain[k] == "code"]
    web = [k for k in keys if domain[k] == "web"]
    assert sorted(np.bincount(code).tolist()[min(code):]) == [3] * 20
    assert len(web) == len(set(web)) == 60


def test_the_mixture_reconciles_by_each_domains_ideal_and_a_fault_in_it_fails(corpus,
                                                                             tmp_path):
    from tally.audit.reconcile import reconcile

    run(corpus, tmp_path / "ok")
    r = reconcile(run_id="r", manifest=corpus / "manifest.parquet", out=tmp_path / "rep",
                  spool=tmp_path / "ok")
    assert r["verdict"] == "PASS", r["findings"]
    assert [f["code"] for f in r["findings"]] == ["domain_weighted"]
    assert {d["domain"]: (d["passes"], d["epoch_duplicates"]) for d in r["domains"]} == {
        "code": (3.0, 0), "web": (1.0, 0)}

    # MaxText's sharding slice left out: each host reads the whole mixture.
    run(corpus, tmp_path / "bad", shard=False)
    r = reconcile(run_id="r", manifest=corpus / "manifest.parquet", out=tmp_path / "rep2",
                  spool=tmp_path / "bad")
    # Each domain is even by its own ideal (code 6 passes, web 2), which reads as weighted;
    # the repeats within every domain's own passes, on every host, are no sharding's.
    assert [f["code"] for f in r["findings"]] == ["no_sharding"], r["findings"]
    assert {d["domain"]: d["epoch_duplicates"] for d in r["domains"]} == {"code": 60, "web": 60}


@pytest.mark.parametrize("workers", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_maxtexts_whole_pipeline_with_mp_prefetch_workers_and_a_restore(corpus, tmp_path,
                                                                       workers):
    """MaxText's last steps: a 1:1 map on the batches, then `mp_prefetch` (worker w reads
    elements w, w + W, ... and the loader takes a batch from each in turn); a checkpoint
    state restored into a new pipeline goes on with the keys and steps."""
    def pipeline():
        ds = get_datasets(corpus, MIX, 1, 2).map(Shift())
        return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))

    spool = tmp_path / "spool"
    first = audited(pipeline(), spool, run_id="r", host=1, host_count=2,
                    hashes=corpus / "manifest.parquet")
    it = iter(first)
    got = [next(it) for _ in range(4)]
    state = it.get_state()
    again = audited(pipeline(), first.writer, hashes=corpus / "manifest.parquet")
    it = iter(again)
    it.set_state(state)
    got += list(it)
    first.writer.finish()
    rows = spool_rows(spool)
    assert len(got) == 15  # 60 elements for the host: 3 mix epochs of 40, every other one
    assert rows["step"].tolist() == [k for k, b in enumerate(got) for _ in b["doc_hash"]]
    assert rows["content_hash"].tolist() == [int(h) for b in got for h in b["doc_hash"]]
    assert len(set(zip(rows["record_key"].tolist(), rows["epoch"].tolist(), strict=True))) == 60


def test_a_file_the_manifest_does_not_list_is_refused(corpus, tmp_path):
    other = tmp_path / "other.array_record"
    _write(other, ["x"], "web")
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource([str(other)]))
    with pytest.raises(AttachError, match="other.array_record is not among the sources"):
        audited(ds.to_iter_dataset().map(Parse()).batch(2), tmp_path / "s", run_id="r",
                host=0, host_count=1, hashes=corpus / "manifest.parquet")
    # Without the manifest's hashes the records (serialized tf.Example) cannot be hashed:
    # said when the loader is attached, not by the writer after the first batch.
    with pytest.raises(AttachError, match="record 0 of the data source is bytes, not token "
                                          "ids .* give hashes= the corpus manifest"):
        audited(ds.to_iter_dataset().map(Parse()).batch(2), tmp_path / "s", run_id="r",
                host=0, host_count=1)


FACTORY = '''
import glob
import grain
from tests.test_grain_mixture import MIX, Shift, get_datasets
from pathlib import Path


def make(host, hosts):
    ds = get_datasets(Path({root!r}), MIX, host, hosts, epochs={epochs}, batch={batch})
    ds = ds.map(Shift())
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers={workers}))
'''


@pytest.mark.parametrize(("workers", "hosts", "epochs", "batch"), [
    (0, 2, 3, 4), pytest.param(3, 2, 3, 4, marks=pytest.mark.slow),
    # 80 elements on 3 hosts, 2 workers, batches of 13: host 0's workers read 14 and 13
    # elements, 2 batches and 1, so its last round is worker 0's alone.
    pytest.param(2, 3, 2, 13, marks=pytest.mark.slow)])
def test_replay_of_the_mixture_pipeline_writes_what_the_live_audit_wrote(
        corpus, tmp_path, monkeypatch, workers, hosts, epochs, batch):
    """`tally replay` of a MaxText dataset factory (nothing of it runs) writes the rows the
    live attach wrote for the same pipeline run with its worker processes."""
    from tally.pipeline.replay import ReplaySpec, replay

    name = f"maxtext_data_{workers}_{hosts}"
    (tmp_path / f"{name}.py").write_text(FACTORY.format(
        root=str(corpus), workers=workers, epochs=epochs, batch=batch))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for h in range(hosts):
        ds = get_datasets(corpus, MIX, h, hosts, epochs=epochs, batch=batch).map(Shift())
        if workers:
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
        live = audited(ds, tmp_path / "live", run_id="r", host=h, host_count=hosts,
                       hashes=corpus / "manifest.parquet")
        for _ in live:
            pass
        live.writer.finish()
    replay(ReplaySpec(loader=f"{name}:make", hosts=hosts, steps=100,
                      spool=tmp_path / "replayed", run_id="r",
                      manifest=corpus / "manifest.parquet", fsync=False))
    live, again = spool_rows(tmp_path / "live"), spool_rows(tmp_path / "replayed")
    cols = ("step", "host", "row", "record_key", "epoch", "content_hash", "n_tokens")

    def ordered(rows):
        return sorted(zip(*(rows[c].tolist() for c in cols), strict=True))

    assert len(live["step"]) == 40 * epochs
    assert ordered(again) == ordered(live)


def make_dataloader(root, host, hosts):
    """A grain.DataLoader over one pattern's ArrayRecord files in glob's (unsorted) order."""
    source = grain.sources.ArrayRecordDataSource(sorted(glob.glob(str(root / "web" / "*")),
                                                        reverse=True))
    return grain.DataLoader(
        data_source=source, sampler=grain.samplers.IndexSampler(len(source), shuffle=True,
                                                                seed=2, num_epochs=2),
        operations=[Parse(), grain.transforms.Batch(4)],
        shard_options=grain.sharding.ShardOptions(host, hosts), worker_count=0)


def test_a_dataloader_over_array_record_files_is_keyed_by_file_live_and_by_replay(
        corpus, tmp_path, monkeypatch):
    from tally.pipeline.replay import ReplaySpec, replay

    got = []
    for h in range(2):
        live = audited(make_dataloader(corpus, h, 2), tmp_path / "live", run_id="r",
                       hashes=corpus / "manifest.parquet")
        got += [(h, k, b) for k, b in enumerate(live)]
        live.writer.finish()
    rows = spool_rows(tmp_path / "live")
    by_place = sorted(zip(rows["host"].tolist(), rows["step"].tolist(), rows["row"].tolist(),
                          rows["content_hash"].tolist(), strict=True))
    assert [x[3] for x in by_place] == [int(d) for _, _, b in got for d in b["doc_hash"]]
    (tmp_path / "ar_loader.py").write_text(
        "from pathlib import Path\nfrom tests.test_grain_mixture import make_dataloader\n\n"
        f"def make(host, hosts):\n    return make_dataloader(Path({str(corpus)!r}), host, "
        "hosts)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    replay(ReplaySpec(loader="ar_loader:make", hosts=2, steps=100, spool=tmp_path / "again",
                      run_id="r", manifest=corpus / "manifest.parquet", fsync=False))
    again = spool_rows(tmp_path / "again")
    cols = ("step", "host", "row", "record_key", "epoch", "content_hash")
    assert sorted(zip(*(again[c].tolist() for c in cols), strict=True)) == \
        sorted(zip(*(rows[c].tolist() for c in cols), strict=True))
    assert len(rows["step"]) == 120


def test_a_corpus_without_domains_gets_the_mixtures_components_from_manifest_domain_globs(
        tmp_path, monkeypatch, capsys):
    """MaxText's corpora rarely carry a domain feature: a mixture of two patterns over one
    domain ("default") is measured against the whole split's ideal and fails on a correct
    run; `tally manifest --domain web='web/*' --domain code='code/*'` names the components."""
    from tests.support.cli import tally_here

    root = tmp_path / "corpus"
    for d, n in (("web", 60), ("code", 20)):
        (root / d).mkdir(parents=True)
        _write(root / d / f"{d}-0.array_record", [f"{d} document {i}" for i in range(n)])
    verdicts = {}
    for name, flags_ in (("plain", []), ("globs", ["--domain", "web=web/*",
                                                    "--domain", "code=*/code-*"])):
        code, _, err = tally_here(monkeypatch, capsys, "manifest", root, "-o",
                                  tmp_path / f"{name}.parquet", "-q", *flags_)
        assert code == 0, err
        for h in range(2):
            ds = audited(get_datasets(root, MIX, h, 2), tmp_path / f"spool-{name}",
                         run_id="r", host=h, host_count=2, hashes=tmp_path / f"{name}.parquet")
            for _ in ds:
                pass
            ds.writer.finish()
        code, out, err = tally_here(monkeypatch, capsys, "reconcile", "--run", "r",
                                    "--manifest", tmp_path / f"{name}.parquet",
                                    "--spool", tmp_path / f"spool-{name}",
                                    "--out", tmp_path / f"rep-{name}", "--json")
        r = json.loads(out)
        verdicts[name] = (r["verdict"], sorted({f["code"] for f in r["findings"]}))
    assert verdicts["plain"][0] == "FAIL"  # code's records 3 times, web's once: "uneven"
    assert verdicts["globs"] == ("PASS", ["domain_weighted"])
    code, _, err = tally_here(monkeypatch, capsys, "manifest", root, "-o", tmp_path / "x.parquet",
                              "--domain", "web=wbe/*")
    assert code != 0 and "--domain web=wbe/*: matches none of the corpus' files" in err
    assert len(err.strip().splitlines()) == 1


EVEN = [("web/*.array_record", 0.75), ("code/*.array_record", 0.25)]  # by the sources' sizes
PREFLIGHT_FACTORY = '''
import grain
from pathlib import Path
from tests.test_grain_mixture import EVEN, MIX, get_datasets


def make(host, hosts):
    ds = get_datasets(Path({root!r}), {mix}, host, hosts, batch=2)
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers={workers}))
'''


def checkpointed_run(corpus, tmp_path, monkeypatch, name, workers, *, hosts, before, after,
                     mix="EVEN"):
    """The factory module `name` (PREFLIGHT_FACTORY) run live on `hosts` hosts into
    tmp_path/spool: `before` steps, each iterator's state saved as Grain's checkpoint handler
    writes it (tmp_path/states/process_<h>-of-<hosts>.json), then `after` steps more."""
    (tmp_path / f"{name}.py").write_text(PREFLIGHT_FACTORY.format(root=str(corpus),
                                                                  workers=workers, mix=mix))
    monkeypatch.syspath_prepend(str(tmp_path))
    factory = __import__(name).make
    states = tmp_path / "states"
    states.mkdir()
    for h in range(hosts):
        ds = audited(factory(h, hosts), tmp_path / "spool", run_id="r", host=h,
                     host_count=hosts, hashes=corpus / "manifest.parquet")
        it = iter(ds)
        for _ in range(before):
            next(it)
        (states / f"process_{h}-of-{hosts}.json").write_text(json.dumps(it.get_state()))
        for _ in range(after):
            next(it)
        ds.writer.finish()
    return states


@pytest.mark.parametrize(("workers", "mix"), [
    (0, "EVEN"), (0, "MIX"), pytest.param(2, "EVEN", marks=pytest.mark.slow)])
def test_preflight_of_a_maxtext_pipeline_from_its_checkpointed_iterator_states(
        corpus, tmp_path, monkeypatch, capsys, workers, mix):
    """4 hosts run 7 steps (56 exposures of the 80 records) and checkpoint each iterator's
    state (the JSON of get_state(), as Grain's checkpoint handler writes it); the relaunch is
    checked with the user's own factory: the same 4 hosts restored: SAFE; the states
    restored on 2 hosts (positions in another slicing) or the pipelines started over at
    step 7: UNSAFE. The mixture by the sources' sizes reads every record once a mix epoch;
    the even one reads code 3 times as often as web, which is judged by each domain's own
    ideal (the split's would call the continuation's code reads repeats)."""
    from tests.support.cli import tally_here

    name = f"maxtext_preflight_{workers}_{mix}"
    states = checkpointed_run(corpus, tmp_path, monkeypatch, name, workers, hosts=4,
                              before=7, after=0, mix=mix)
    code, _, err = tally_here(monkeypatch, capsys, "ingest", tmp_path / "spool", "--ledger",
                              tmp_path / "ledger.duckdb", "-q")
    assert code == 0, err

    def preflight(hosts, *how):
        code, out, err = tally_here(
            monkeypatch, capsys, "preflight", "--run", "r", "--ledger", tmp_path / "ledger.duckdb",
            "--manifest", corpus / "manifest.parquet", "--loader", f"{name}:make", "--hosts",
            hosts, "--json", "-q", *how, cwd=tmp_path)
        assert code in (0, 1), err
        return json.loads(out)

    same = preflight(4, "--states", states)
    assert same["status"] == "safe", same["findings"]
    assert same["numbers"]["checkpoint_step"] == 7
    assert same["numbers"]["loader_kind"] == "grain_dataset"
    assert ("domain_weighted" in {f["code"] for f in same["findings"]}) == (mix == "MIX")
    moved = preflight(2, "--states", states)
    assert moved["status"] == "unsafe", moved["findings"]
    assert {"repeats", "skips"} & {f["code"] for f in moved["findings"]}
    # Started over: up to the next multiple of N (80 - 56 = 24 exposures, 3 steps) the plan
    # reads the first 24 records of the run's order again.
    again = preflight(4, "--at-step", "7")
    assert again["status"] == "unsafe", again["findings"]
    # The same for the weighted mixture: re-reading the run's first steps is not a weight
    # (judged by the split's ideal).
    assert again["numbers"]["repeats"] == 24
    assert "domain_weighted" not in {f["code"] for f in again["findings"]}



def test_preflight_takes_weights_only_from_a_run_that_already_had_them():
    """A relaunch that reads one domain over again where the run read every domain alike is
    the fault (a naive restore over domain-ordered records), not a weight: judged by the
    split's ideal. A run that already read its domains at different rates is judged by
    each domain's own."""
    from tally.audit.preflight.loader_check import _weighted

    codes = np.array([0] * 20 + [1] * 60, np.uint8)
    domains = (codes, ["code", "web"])
    even = np.ones(80, np.int64)  # one pass over both
    # The relaunch reads code twice more: code 3 each, web 1, against the split's ideal of
    # 1 or 2 (120 exposures of 80): 20 beyond it, none beyond each domain's own.
    code_again = even + 2 * (codes == 0)
    assert not _weighted(domains, even, code_again)
    upsampled = even + (codes == 0)  # the run read code twice as often already
    assert _weighted(domains, upsampled, upsampled + 2 * (codes == 0))


def test_replay_from_the_iterator_states_a_run_checkpointed(corpus, tmp_path, monkeypatch,
                                                            capsys):
    """`tally replay --states` of a dataset pipeline goes on from each host's saved iterator
    state: the rows the live run wrote after its checkpoint, step for step."""
    from tests.support.cli import tally_here

    states = checkpointed_run(corpus, tmp_path, monkeypatch, "maxtext_states", 0, hosts=2,
                              before=5, after=4)
    code, _, err = tally_here(monkeypatch, capsys, "replay", "--loader", "maxtext_states:make",
                              "--hosts", 2, "--steps", 4, "--states", states, "--spool",
                              tmp_path / "again", "--run", "r", "--manifest",
                              corpus / "manifest.parquet", cwd=tmp_path)
    assert code == 0, err
    live, again = spool_rows(tmp_path / "spool"), spool_rows(tmp_path / "again")
    cols = ("step", "host", "row", "record_key", "epoch", "content_hash")
    after = sorted(x for x in zip(*(live[c].tolist() for c in cols), strict=True) if x[0] >= 5)
    assert len(after) == 2 * 4 * 2
    assert sorted(zip(*(again[c].tolist() for c in cols), strict=True)) == after
    (states / "process_1-of-2.json").write_text('{"last_seen_indices": {}}')
    code, _, err = tally_here(monkeypatch, capsys, "replay", "--loader", "maxtext_states:make",
                              "--hosts", 2, "--steps", 4, "--states", states, "--spool",
                              tmp_path / "bad", "--run", "r", "--manifest",
                              corpus / "manifest.parquet", cwd=tmp_path)
    assert code != 0 and "process_1-of-2.json: not this pipeline's iterator state" in err
    assert len(err.strip().splitlines()) == 1
