"""Real Grain loaders with the fault switches, through the writer, reconciled: the report
catches each fault and names it; the correct loader passes."""

import dataclasses
import json

import duckdb
import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.reconcile import reconcile
from tally.pipeline.corpus import TokenSource
from tally.pipeline.loader import KeyedLoader, LoaderConfig
from tally.pipeline.manifest import build_manifest, manifest_info
from tally.pipeline.synth import synth_corpus

HOSTS = 64


def _cfg(**kw) -> LoaderConfig:
    # Many hosts in one process: read on demand, no read-ahead threads per loader.
    return LoaderConfig(seq_len=32, read_threads=0, read_buffer=0, **kw)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    # 19,584 train records = 64 hosts x 2 rows x 153 steps: one epoch exactly.
    synth_corpus(root / "c", records=20_000, seed=4, heldout_fraction=0.0208,
                 length_scale=0.02, min_len=1, max_len=32)
    build_manifest(root / "c", root / "m.parquet")
    return root, TokenSource(root / "c")


def _run(spool, source, cfg, hosts, steps, *, attempt=0, first=0, run="r", restore=None,
         finish=False, host_cfg=None, consume=None):
    """Each host consumes `steps` batches into the spool; returns the loaders' states.
    `host_cfg(h, cfg)` gives a host its own loader config; `consume(h, step, loader, last)`
    returns the batch host h hands over at a step (None: it consumes nothing then), `last`
    being the batch of its step before."""
    out = []
    for h in range(hosts):
        loader = KeyedLoader(source, cfg if host_cfg is None else host_cfg(h, cfg), h, hosts)
        if restore is not None:
            restore(loader, h)
        with LedgerWriter(spool, run, host=h, host_count=hosts, attempt=attempt,
                          resumed_from_step=first if attempt else None,
                          records_per_epoch=len(source), flush_every=64, fsync=False) as w:
            last = None
            for step in range(first, first + steps):
                batch = next(loader) if consume is None else consume(h, step, loader, last)
                if batch is not None:
                    w.write_batch(step, batch)
                    last = batch
            if finish:
                w.finish()
        out.append(loader.get_state())
    return out


def _reconcile(root, spool, name):
    return reconcile(run_id="r", manifest=root / "m.parquet", out=root / name, spool=spool)


@pytest.mark.slow
def test_seed_check_per_host_seeds_on_64_hosts_match_the_analytic_values(corpus, tmp_path):
    root, source = corpus
    assert len(source) == HOSTS * 2 * 153
    cfg = _cfg(global_batch=HOSTS * 2, fault="per_host_seed", seed=7)
    _run(tmp_path / "spool", source, cfg, HOSTS, 153)
    r = _reconcile(root, tmp_path / "spool", "seeds")
    p0 = (1 - 1 / HOSTS) ** HOSTS
    p1 = (1 - 1 / HOSTS) ** (HOSTS - 1)
    f = r["coverage"]["histogram_fraction"]
    assert abs(f["0"] - p0) < 0.01
    assert abs(f["2"] + f["3+"] - (1 - p0 - p1)) < 0.01
    assert r["verdict"] == "FAIL"
    (finding,) = [x for x in r["findings"] if x["code"] == "with_replacement"]
    assert "sampling with replacement" in finding["message"]
    assert "per-host shuffle seeds" in finding["message"]


@pytest.mark.slow
def test_correct_loader_on_64_hosts_sees_every_record_once(corpus, tmp_path):
    root, source = corpus
    cfg = _cfg(global_batch=HOSTS * 2, seed=7)
    _run(tmp_path / "spool", source, cfg, HOSTS, 153)
    r = _reconcile(root, tmp_path / "spool", "good")
    assert r["coverage"]["coverage"] == 1.0
    assert r["coverage"]["histogram"] == {"0": 0, "1": len(source), "2": 0, "3+": 0}
    assert r["verdict"] == "PASS" and r["findings"] == []
    assert r["first_bad_step"] is None
    # Disjoint hosts: the overlap matrix is diagonal.
    m = r["hosts"]["overlap_matrix"]
    assert all(m[i][j] == 0 for i in range(HOSTS) for j in range(HOSTS) if i != j)


def test_no_sharding_is_named(corpus, tmp_path):
    root, source = corpus
    cfg = _cfg(global_batch=8, fault="no_sharding", seed=1)
    _run(tmp_path / "spool", source, cfg, 4, 200)
    r = _reconcile(root, tmp_path / "spool", "nosh")
    codes = [x["code"] for x in r["findings"]]
    assert codes == ["no_sharding"]
    assert "each of 4 hosts saw the same records" in r["findings"][0]["message"]


@pytest.mark.parametrize("hosts, index, groups, said", [
    (6, lambda h: h % 2, [[0, 2, 4], [1, 3, 5]], "hosts 0, 2 and 4; hosts 1, 3 and 5"),
    (4, lambda h: 0 if h == 3 else h, [[0, 3]], "hosts 0 and 3"),
], ids=["local_rank", "one_index_reused"])
def test_hosts_that_share_a_shard_are_named_in_their_groups(corpus, tmp_path, hosts, index,
                                                            groups, said):
    """Each host's Grain slice taken with another index than its own: the rank within its
    node on 3 nodes of 2 hosts (`[local::6]`: hosts 0, 2, 4 read slice 0 and hosts 1, 3, 5
    slice 1, slices 2-5 never), or host 3 given host 0's index. The groups are named, with
    nothing else; each group of g hosts repeats (g - 1)/g of what it consumed."""
    root, source = corpus
    cfg = _cfg(global_batch=2 * hosts, seed=1)
    loaders = {}

    def sliced(h, step, loader, last):
        if h not in loaders:
            loaders[h] = KeyedLoader(source, cfg, index(h), hosts)
        return next(loaders[h])

    _run(tmp_path / "spool", source, cfg, hosts, 150, consume=sliced)
    r = _reconcile(root, tmp_path / "spool", "shared")
    assert [x["code"] for x in r["findings"]] == ["shared_shard"], r["findings"]
    (finding,) = r["findings"]
    assert finding["numbers"]["groups"] == groups
    assert finding["numbers"]["hosts"] == sum(map(len, groups))
    assert f"read the same records as another host ({said})" in finding["message"]
    assert r["coverage"]["epoch_duplicates"] == sum(300 * (len(g) - 1) for g in groups)


def test_shared_shards_without_epochs_are_named_only_where_the_groups_read_apart(corpus,
                                                                                 tmp_path):
    """Spools without epochs (-1): 4 hosts in pairs, each pair reading one shard of 800
    records of a permutation (hosts 0 and 2 the first, 1 and 3 the second): the pairs are
    named. The same pairs when the second pair's shard holds 600 of the first's: the groups do
    not read apart, so the repeats stay unexplained (`uneven_exposure`), not a shared shard."""
    root, source = corpus
    steps, rows = 100, 8
    order = np.random.default_rng(5).permutation(len(source))
    hashes = pq.read_table(root / "m.parquet", columns=["content_hash"])["content_hash"]
    hashes = hashes.to_numpy()
    for name, second in (("apart", order[800:1600]), ("mixed", order[200:1000])):
        shards = {0: order[:800], 1: second}
        for h in range(4):
            with LedgerWriter(tmp_path / name, "r", host=h, host_count=4, flush_every=64,
                              fsync=False) as w:
                for step in range(steps):
                    k = shards[h % 2][step * rows:(step + 1) * rows]
                    w.write_segments(step, Segments.build(
                        row=np.arange(rows), record_key=k, n_tokens=np.full(rows, 4),
                        content_hash=hashes[k]))
    r = _reconcile(root, tmp_path / "apart", "apart")
    assert not r["epochs"] and r["coverage"]["epoch_duplicates"] == 0  # epochs unknown
    assert [f["code"] for f in r["findings"]] == ["shared_shard"], r["findings"]
    assert r["findings"][0]["numbers"]["groups"] == [[0, 2], [1, 3]]
    r = _reconcile(root, tmp_path / "mixed", "mixed")
    assert [f["code"] for f in r["findings"]] == ["uneven_exposure"], r["findings"]


def _code_and_the_rest(root):
    """The manifest's train keys of every domain but `code`, of `code`, and every record's
    content hash and token count (indexed by key)."""
    m = pq.read_table(root / "m.parquet")
    train = pc.equal(m["split"], "train").to_numpy(zero_copy_only=False)
    code = np.array(m["domain"].to_pylist()) == "code"
    keys = m["record_key"].to_numpy()
    return (keys[train & ~code], keys[train & code], m["content_hash"].to_numpy(),
            m["n_tokens"].to_numpy())


def test_a_domain_never_read_is_named_once_an_epoch_has_passed(corpus, tmp_path):
    """4 hosts read every train record but the `code` domain's, shuffled, each epoch (a
    mixture or source list that left the domain out). Within the first epoch that may be a
    curriculum: PASS, its INFO saying the domain was not read at all. After two epochs:
    `domain_unread` names it, with its records (before, an unnamed uneven exposure)."""
    root, source = corpus
    rest, code_keys, hashes, tokens = _code_and_the_rest(root)
    read, code = rest, len(code_keys)
    whole = len(read) // 32 * 32  # every host the same steps of 8 records
    for name, epochs, stop in (("partial", 1, whole // 2 // 32 * 32), ("two", 2, whole)):
        for h in range(4):
            with LedgerWriter(tmp_path / name, "r", host=h, host_count=4,
                              records_per_epoch=len(read) + code, fsync=False) as w:
                step = 0
                for e in range(epochs):
                    mine = np.random.default_rng(e).permutation(read)[:stop][h::4]
                    for i in range(0, len(mine), 8):
                        k = mine[i:i + 8]
                        w.write_segments(step, Segments.build(
                            row=np.arange(8), record_key=k, n_tokens=tokens[k],
                            content_hash=hashes[k], epoch=np.full(8, e)))
                        step += 1
                w.finish()
    r = _reconcile(root, tmp_path / "partial", "partial")
    assert r["verdict"] == "PASS", r["findings"]
    (info,) = r["findings"]
    assert info["code"] == "final_epoch_short"
    assert info["message"].endswith("; domain code was not read at all")
    r = _reconcile(root, tmp_path / "two", "two")
    codes = [f["code"] for f in r["findings"] if f["severity"] == "FAIL"]
    assert codes == ["domain_unread"], r["findings"]
    (f,) = [f for f in r["findings"] if f["code"] == "domain_unread"]
    assert f["numbers"] == {"domains": ["code"], "records": code}
    assert f["message"].startswith(f"domain code was never read ({code:,} train records")


def _mixture(root, spool, code_passes, *, fault=None):
    """Two loaders in one batch, each reshuffling its own pool every pass: 3 of 4 rows from
    every domain but `code`, 1 of 4 from `code` (a quarter of the batch for a fifth of the
    records), for steps enough to take `code` into pass `code_passes` (0-based) and a bit.
    `fault="host_seed"`: host 3 draws its code rows from a stream of its own (a per-host
    seed), the other hosts from the shared one. Returns the reconcile's report."""
    rest, code_keys, hashes, tokens = _code_and_the_rest(root)

    def passes(pool, seed):
        for e in range(10):
            for k in np.random.default_rng(seed + e).permutation(pool):
                yield e, k

    rest_s, code_s, own = passes(rest, 0), passes(code_keys, 100), passes(code_keys, 7)
    steps = -(-code_passes * len(code_keys) // 8) + 2
    writers = [LedgerWriter(spool, "r", host=h, host_count=4, fsync=False) for h in range(4)]
    for step in range(steps):
        both = [next(rest_s) for _ in range(24)] + [next(code_s) for _ in range(8)]
        for h, w in enumerate(writers):
            mine = both[h::4]
            if fault == "host_seed" and h == 3:
                mine = mine[:6] + [next(own), next(own)]
            k = np.array([b[1] for b in mine])
            w.write_segments(step, Segments.build(
                row=np.arange(len(k)), record_key=k, n_tokens=tokens[k],
                content_hash=hashes[k], epoch=np.array([b[0] for b in mine])))
    for w in writers:
        w.finish()
    return _reconcile(root, spool, spool.name)


@pytest.mark.parametrize("code_passes", [1, 2])
def test_a_weighted_mixture_is_measured_against_each_domains_own_ideal(
        corpus, tmp_path, code_passes):
    """`code` read at 1.25x the rate of the other domains (`_mixture`), into its second pass
    while the rest are in their first, and into its third while they are in their second:
    against the whole split's ideal that was `uneven_exposure`; each record is within its own
    domain's passes, so PASS with `domain_weighted` saying the rates, no first bad step."""
    root, source = corpus
    r = _mixture(root, tmp_path / "mix", code_passes)
    assert r["verdict"] == "PASS", r["findings"]
    assert r["coverage"]["excess_exposures"] > 0  # the split's ideal is not met
    assert r["domain_ideal"] == {"weighted": True, "excess_exposures": 0,
                                 "missing_exposures": 0, "epoch_duplicates": 0,
                                 "epochs_even": True}
    assert r["first_bad_step"] is None
    f = next(f for f in r["findings"] if f["code"] == "domain_weighted")
    assert f["severity"] == "INFO"
    assert f["message"].startswith(f"the domains were read at different rates (passes: code "
                                   f"{code_passes}.0")
    assert f["numbers"]["split_excess"] == r["coverage"]["excess_exposures"]
    code = next(d for d in r["domains"] if d["domain"] == "code")
    assert code["passes"] > max(d["passes"] for d in r["domains"] if d["domain"] != "code")


def test_a_fault_within_a_weighted_mixture_is_still_caught(corpus, tmp_path):
    """The same mixture where one host draws its code rows with a seed of its own: code's
    records are no longer even within their own domain, so FAIL, and the domain ideal says
    how far off they are."""
    root, source = corpus
    r = _mixture(root, tmp_path / "mixfault", 2, fault="host_seed")
    assert r["verdict"] == "FAIL", r["findings"]
    assert r["domain_ideal"]["excess_exposures"] > 0
    assert not any(f["code"] == "domain_weighted" for f in r["findings"])


@pytest.mark.slow
def test_double_slicing_is_caught(corpus, tmp_path):
    root, source = corpus
    cfg = _cfg(global_batch=32, fault="double_slice", seed=1)
    _run(tmp_path / "spool", source, cfg, 4, len(source) // 32)
    r = _reconcile(root, tmp_path / "spool", "double")
    (finding,) = r["findings"]
    assert finding["code"] == "with_replacement"
    assert "applied twice" in finding["message"]


@pytest.mark.slow
def test_naive_reshard_8_to_4_is_named(corpus, tmp_path):
    root, source = corpus
    cfg = _cfg(global_batch=32, seed=2, fault="naive_reshard")
    states = _run(tmp_path / "spool", source, cfg, 8, 100)
    _run(tmp_path / "spool", source, cfg, 4, 200, attempt=1, first=100,
         restore=lambda loader, h: loader.set_state(states[h]))
    r = _reconcile(root, tmp_path / "spool", "reshard")
    (finding,) = r["findings"]
    assert finding["code"] == "reshard_band"
    assert finding["message"].startswith(
        "attempt 1 resumed at step 100 on 4 hosts (was 8): per-host loader states were "
        "restored on another topology; ")
    # The repeats it names are exactly the within-epoch repeats at steps >= 100 (SQL).
    repeated = duckdb.sql(f"""
        SELECT count(*) FROM (SELECT step, row_number() OVER (PARTITION BY record_key, epoch
            ORDER BY step) AS k FROM read_parquet('{tmp_path}/spool/r/*/*/seg-*.parquet')
            WHERE "offset" = 0) WHERE k > 1 AND step >= 100""").fetchall()[0][0]
    assert finding["numbers"]["repeated"] == repeated > 0
    assert finding["numbers"]["skipped"] is None  # epoch 0 is still going at step 300


def test_global_batch_changed_on_resume_is_named(corpus, tmp_path):
    root, source = corpus
    old = _cfg(global_batch=16, seed=3, elastic=True)
    new = _cfg(global_batch=32, seed=3, elastic=True)
    _run(tmp_path / "spool", source, old, 4, 100)
    # The resumed job recomputes its position as step x (new) global batch.
    _run(tmp_path / "spool", source, new, 4, 100, attempt=1, first=100,
         restore=lambda loader, h: loader._it.set_state({"global_next_index": 100 * 32}))
    r = _reconcile(root, tmp_path / "spool", "batch")
    (finding,) = r["findings"]
    assert finding["code"] == "batch_changed"
    assert "from 16 to 32 rows at step 100" in finding["message"]
    assert json.loads((root / "batch" / "report.json").read_text())["batch_changes"] == [
        {"step": 100, "before": 16, "after": 32}]


def _consume(spool, man, keys_per_host_step):
    """Write exact segments: keys_per_host_step[h][s] is the list of keys host h reads at s."""
    hosts = len(keys_per_host_step)
    for h, per_step in enumerate(keys_per_host_step):
        with LedgerWriter(spool, "r", host=h, host_count=hosts, fsync=False) as w:
            for step, keys in enumerate(per_step):
                keys = np.asarray(keys)
                w.write_segments(step, Segments.build(
                    row=np.arange(len(keys)), record_key=keys, epoch=np.zeros(len(keys)),
                    n_tokens=man["n_tokens"].to_numpy()[keys],
                    content_hash=man["content_hash"].to_numpy()[keys]))


def test_sampler_padding_is_named(corpus, tmp_path):
    root, _ = corpus
    man = pq.read_table(root / "m.parquet")
    n = int(manifest_info(root / "m.parquet")["train_records"])
    # 5 hosts, 8 rows a step; the epoch is padded to a multiple of 40 by repeating records.
    order = np.random.default_rng(0).permutation(n)
    pad = -n % 40
    padded = np.concatenate([order, order[:pad]])
    per_host = [[padded[s * 40 + h * 8: s * 40 + h * 8 + 8] for s in range(len(padded) // 40)]
                for h in range(5)]
    _consume(tmp_path / "spool", man, per_host)
    r = _reconcile(root, tmp_path / "spool", "padding")
    assert pad and r["coverage"]["histogram"]["2"] == pad
    assert r["coverage"]["epoch_duplicates"] == pad
    (finding,) = r["findings"]
    assert finding["code"] == "padding"
    assert f"{pad} records seen twice within an epoch" in finding["message"]
    # One epoch, padded: "over 1 epoch" (ceil(exposures / N) said "over 2 epoch(s)").
    assert f"({pad} extra exposures over 1 epoch)" in finding["message"], finding["message"]


def test_files_never_read_are_named(corpus, tmp_path):
    root, _ = corpus
    man = pq.read_table(root / "m.parquet")
    train = man.filter(pc.equal(man["split"], "train"))
    # File-level sharding over 4 files on 3 hosts, two epochs: host h reads file h twice;
    # file 3 is never read.
    sources = sorted(set(train["source"].to_pylist()))
    per_host = []
    for h in range(3):
        keys = train.filter(pc.equal(train["source"], sources[h]))["record_key"].to_numpy()
        keys = np.concatenate([keys, keys])
        per_host.append([keys[i:i + 8] for i in range(0, len(keys) - len(keys) % 8, 8)])
    _consume(tmp_path / "spool", man, per_host)
    r = _reconcile(root, tmp_path / "spool", "files")
    codes = [f["code"] for f in r["findings"]]
    assert "files_unread" in codes
    (finding,) = [f for f in r["findings"] if f["code"] == "files_unread"]
    assert sources[3] in finding["message"] and "1 corpus file was never read" in \
        finding["message"]


def test_a_host_that_hands_the_same_batch_again_is_named_with_its_steps(corpus, tmp_path):
    """Host 2's input pipeline stalls at steps 50-59: it hands the batch of step 49 again."""
    root, source = corpus
    cfg = _cfg(global_batch=32, seed=5)

    def stall(h, step, loader, last):
        return last if h == 2 and 50 <= step <= 59 else next(loader)

    _run(tmp_path / "spool", source, cfg, 4, 120, consume=stall)
    r = _reconcile(root, tmp_path / "spool", "stall")
    fails = [f for f in r["findings"] if f["severity"] == "FAIL"]
    assert [f["code"] for f in fails] == ["repeated_batches"], r["findings"]
    assert fails[0]["numbers"] == {"host": 2, "steps": 10, "ranges": [[50, 59]]}
    assert "host 2 handed the same batch again at 10 steps (steps 50-59)" in \
        fails[0]["message"]
    assert r["hosts"]["per_host"][2]["epoch_repeats"] == 10 * 8
    # Its evidence: the host, and its steps around the stall in the API's host series.
    assert fails[0]["evidence"] == {
        "steps": [{"step": 50, "last_step": 59,
                   "api": "/v1/runs/r/hosts/2/steps?start=49&end=60&bucket=1"}],
        "hosts": [{"host": 2, "api": "/v1/runs/r/hosts/2/steps"}]}


def test_a_host_that_consumes_nothing_for_a_while_is_named_with_its_steps(corpus, tmp_path):
    """Host 1 stalls at steps 30-39 and consumes nothing there while the others go on."""
    root, source = corpus
    cfg = _cfg(global_batch=32, seed=5)

    def pause(h, step, loader, last):
        return None if h == 1 and 30 <= step <= 39 else next(loader)

    _run(tmp_path / "spool", source, cfg, 4, 100, consume=pause, finish=True)
    r = _reconcile(root, tmp_path / "spool", "gap")
    (gap,) = [f for f in r["findings"] if f["code"] == "host_gap"]
    assert gap["numbers"] == {"host": 1, "first_step": 30, "last_step": 39, "attempt": 0}
    assert gap["evidence"]["hosts"] == [{"host": 1, "api": "/v1/runs/r/hosts/1/steps"}]
    assert gap["evidence"]["steps"] == [{"step": 30, "last_step": 39,
                                         "api": "/v1/runs/r/hosts/1/steps?start=29&end=40"
                                                "&bucket=1"}]
    assert r["run"] == {"finished": True, "finished_step": 99}


def test_one_misconfigured_host_is_named_by_the_repeats_it_takes_part_in(corpus, tmp_path):
    """Host 3 shuffles with its own seed: the records it reads are also read by the others.
    The spread alone could pass for sampling with replacement early in a run; the host's share
    of the repeated records names it instead."""
    root, source = corpus
    cfg = _cfg(global_batch=32, seed=7)
    _run(tmp_path / "spool", source, cfg, 4, 200,
         host_cfg=lambda h, c: dataclasses.replace(c, seed=8) if h == 3 else c)
    r = _reconcile(root, tmp_path / "spool", "onehost")
    codes = [f["code"] for f in r["findings"]]
    assert "with_replacement" not in codes, r["findings"]
    (f,) = [f for f in r["findings"] if f["code"] == "repeats_on_hosts"]
    assert f["numbers"]["hosts"] == [3] and f["numbers"]["shares"][0] > 0.95
    # Evidence: the host named, the steps and the records repeated most, each with its API.
    ev = f["evidence"]
    assert [h["host"] for h in ev["hosts"]] == [3]
    steps = pq.read_table(root / "onehost" / "steps.parquet").to_pydict()
    most = max(steps["epoch_repeats"])
    assert ev["steps"][0]["repeats"] == most and len(ev["steps"]) == 5
    assert all(x["record_key"] >= 0 and x["epoch_repeats"] >= 1 and
               any(s["host"] == 3 for s in x["seen"]) for x in ev["records"])


@pytest.mark.slow
def test_a_clean_elastic_reshard_is_settled_once_its_epoch_ends(corpus, tmp_path):
    """8 hosts, then 4 from the step-100 checkpoint with the elastic iterator and the same
    global batch, on to epoch 1: nothing repeated or skipped, so no warning is left."""
    root, source = corpus
    cfg = _cfg(global_batch=32, seed=2, elastic=True)
    states = _run(tmp_path / "spool", source, cfg, 8, 100)
    steps = len(source) // 32 + 10 - 100  # past the end of epoch 0
    _run(tmp_path / "spool", source, cfg, 4, steps, attempt=1, first=100,
         restore=lambda loader, h: loader.set_state(states[h]))
    r = _reconcile(root, tmp_path / "spool", "elastic")
    assert r["verdict"] == "PASS", r["findings"]
    (f,) = r["findings"]
    assert (f["severity"], f["code"]) == ("INFO", "resharded")
    assert "its epoch (0) ended with every record seen once" in f["message"]
    assert r["epochs"][0]["complete"] and r["epochs"][0]["skipped"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("hosts, packing", [(128, "first_fit"), (256, "none")])
def test_sampling_with_replacement_is_named_on_many_hosts_packed_or_not(tmp_path, hosts,
                                                                       packing):
    synth_corpus(tmp_path / "c", records=4200, seed=9, heldout_fraction=0.02,
                 length_scale=0.02, min_len=1, max_len=16)
    build_manifest(tmp_path / "c", tmp_path / "m.parquet")
    source = TokenSource(tmp_path / "c")
    rows = 1 if packing == "none" else 2
    cfg = LoaderConfig(seq_len=16, read_threads=0, read_buffer=0, global_batch=hosts * rows,
                       packing=packing, fault="per_host_seed", seed=3)
    _run(tmp_path / "spool", source, cfg, hosts, len(source) // (hosts * rows))
    r = reconcile(run_id="r", manifest=tmp_path / "m.parquet", out=tmp_path / "rep",
                  spool=tmp_path / "spool")
    codes = [f["code"] for f in r["findings"] if f["severity"] == "FAIL"]
    assert codes == ["with_replacement"], r["findings"]


@pytest.mark.slow
def test_a_sampler_that_drops_each_epochs_remainder_is_named(corpus, tmp_path):
    """PyTorch's DataLoader with drop_last=True: two epochs, each leaving N mod batch out."""
    from torch.utils.data import DataLoader

    root, source = corpus
    n = len(source)

    class Keyed:
        def __init__(self):
            self.epoch = 0

        def __len__(self):
            return n

        def __getitem__(self, k):
            return {"tokens": np.asarray(source[k][:32], np.int32), "key": self.epoch * n + k}

    data = Keyed()

    def pad(items):
        tokens = np.zeros((len(items), 32), np.int32)
        seg = np.zeros((len(items), 32), np.int32)
        for i, it in enumerate(items):
            tokens[i, :len(it["tokens"])] = it["tokens"]
            seg[i, :len(it["tokens"])] = 1
        return {"tokens": tokens, "tokens_segment_ids": seg,
                "key": np.array([it["key"] for it in items], np.int64)}

    import torch

    loader = DataLoader(data, batch_size=100, shuffle=True, drop_last=True, collate_fn=pad,
                        generator=torch.Generator().manual_seed(0))
    with LedgerWriter(tmp_path / "spool", "r", records_per_epoch=n, fsync=False) as w:
        step = 0
        for epoch in range(2):
            data.epoch = epoch
            for batch in loader:
                w.write_batch(step, batch)
                step += 1
        w.finish()
    r = _reconcile(root, tmp_path / "spool", "droplast")
    assert n % 100 == 84
    (f,) = [f for f in r["findings"] if f["code"] == "drop_remainder"]
    assert f["severity"] == "WARN" and f["numbers"] == {"epochs": 1, "records": 84,
                                                        "same_records": False}
    (last,) = [f for f in r["findings"] if f["code"] == "final_epoch_short"]
    assert last["numbers"] == {"epoch": 1, "records": 84}
    assert r["verdict"] == "WARN" and r["run"]["finished"]
    # As of a step before the end the run had not finished: no "the run finished in epoch 0"
    # (it said so before), and the report says the run was running then.
    early = reconcile(run_id="r", manifest=root / "m.parquet", out=root / "droplast-early",
                      spool=tmp_path / "spool", at_step=6)
    assert not early["run"]["finished"] and early["run"]["finished_step"] is None
    assert not [f for f in early["findings"] if f["code"] == "final_epoch_short"]
