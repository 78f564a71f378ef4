"""The reconcile job against the DuckDB SQL reference on randomised ledgers, on FnApiRunner
and on Dask, plus the report files."""

import dataclasses
import functools
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.reference.reconcile_sql import from_report, reference
from tally.audit.buckets.partials import MaxSpans, Spans
from tally.audit.buckets.plan import MAX_RUN_STEPS, Inputs, PlanOptions, make_plan
from tally.audit.core.errors import TallyError
from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.reconcile import reconcile
from tally.pipeline.manifest import MANIFEST_SCHEMA
from tally.pipeline.manifest_file import write_manifest_table
from tally.pipeline.runners import RunnerSpec

DOMAINS = ["web", "code", "books"]


def write_manifest(path, n_train, n_heldout, rng, row_group=None):
    n = n_train + n_heldout
    t = pa.table({
        "record_key": np.arange(n, dtype=np.int64),
        "content_hash": rng.integers(0, 2**63, n).astype(np.uint64),
        "n_tokens": rng.integers(1, 60, n).astype(np.int32),
        "domain": [DOMAINS[i] for i in rng.integers(0, 3, n)],
        "split": ["train"] * n_train + ["heldout"] * n_heldout,
        "source": [f"train-{i % 4}.array_record" for i in range(n)],
        "source_index": np.arange(n, dtype=np.int64),
        "doc_id": pa.nulls(n, pa.string()),
    }, schema=MANIFEST_SCHEMA)
    write_manifest_table(t, path, row_group_size=row_group)
    return t


def random_step(rng, man, n_train, rows=4):
    """One host's segments for one step, with every kind of trouble now and then."""
    out = {k: [] for k in ("row", "record_key", "offset", "n_tokens", "epoch", "content_hash")}
    n_all = len(man["record_key"])
    for r in range(rows):
        for _ in range(rng.integers(1, 4)):
            u = rng.random()
            key = (int(rng.integers(n_all, n_all + 50)) if u < 0.01 else
                   int(rng.integers(n_train, n_all)) if u < 0.02 else
                   int(rng.integers(0, n_train)))
            if key < n_all:
                full = int(man["n_tokens"][key])
                h = int(man["content_hash"][key])
            else:
                full, h = 10, int(rng.integers(0, 2**63))
            offset, n = 0, full
            v = rng.random()
            if v < 0.1 and full > 1:  # a piece of a record cut across rows
                offset = int(rng.integers(1, full))
                n = full - offset
                h = int(rng.integers(0, 2**63))
            elif v < 0.15 and full > 1:  # truncated to a row
                n = int(rng.integers(1, full))
                h = int(rng.integers(0, 2**63))
            elif v < 0.17:  # the corpus changed under the manifest
                h = int(rng.integers(0, 2**63))
            out["row"].append(r)
            out["record_key"].append(key)
            out["offset"].append(offset)
            out["n_tokens"].append(n)
            out["epoch"].append(int(rng.integers(0, 3)))
            out["content_hash"].append(h)
    return Segments.build(**{k: np.array(v) for k, v in out.items()})


def random_run(spool, man, n_train, rng, run_id="r", first=0):
    """Attempts with restarts (some on other host counts), exact and inexact replays, from
    step `first`."""
    man = {k: man[k].to_numpy() for k in ("record_key", "n_tokens", "content_hash")}
    attempts = int(rng.integers(1, 4))
    start, history = first, {}
    for a in range(attempts):
        hosts = int(rng.integers(1, 5))
        steps = int(rng.integers(8, 20))
        writers = [LedgerWriter(spool, run_id, host=h, host_count=hosts, attempt=a,
                                resumed_from_step=start if a else None,
                                flush_every=int(rng.integers(1, 6)), fsync=False)
                   for h in range(hosts)]
        exact = rng.random() < 0.5
        for step in range(start, start + steps):
            for h, w in enumerate(writers):
                old = history.get((step, h))
                segs = old if (exact and old is not None) else random_step(rng, man, n_train)
                history[(step, h)] = segs
                w.write_segments(step, segs)
        for w in writers:
            w.close()
        start = max(first + 1, start + steps - int(rng.integers(1, 6)))


def weighted_run(spool, man, n_train, rng, run_id="r", first=0, epochs="own"):
    """A mixture that reads `code` at twice the rate of the other domains, each domain's pool
    reshuffled at every pass, on 2 hosts: whole records, the manifest's hashes. `epochs`:
    "own", each domain's passes (a loader per domain), or "global", the mixture's: one pass
    over the other domains, with `code`'s passes going on through it (so repeating within
    the epoch) and on into the next."""
    keys = np.arange(n_train)
    dom = np.array(man["domain"].to_pylist()[:n_train])
    tokens, hashes = man["n_tokens"].to_numpy(), man["content_hash"].to_numpy()
    code, rest = keys[dom == "code"], keys[dom != "code"]
    share = 2 * len(code) / (2 * len(code) + len(rest))  # code's part of a batch

    def passes(pool):
        for e in range(100):
            for k in rng.permutation(pool):
                yield e, int(k)

    def mixed():
        if epochs == "own":
            streams = (passes(code), passes(rest))
            while True:
                yield next(streams[0] if rng.random() < share else streams[1])
        code_s = passes(code)
        for e in range(100):
            left = list(rng.permutation(rest))
            while left:
                yield e, (next(code_s)[1] if rng.random() < share else int(left.pop()))

    rows = mixed()
    writers = [LedgerWriter(spool, run_id, host=h, host_count=2, fsync=False) for h in (0, 1)]
    for step in range(first, first + 3 * n_train // 16):
        batch = [next(rows) for _ in range(16)]
        for h, w in enumerate(writers):
            k = np.array([x[1] for x in batch[h::2]])
            w.write_segments(step, Segments.build(
                row=np.arange(len(k)), record_key=k, offset=np.zeros(len(k), np.int64),
                n_tokens=tokens[k], content_hash=hashes[k],
                epoch=np.array([x[0] for x in batch[h::2]])))
    for w in writers:
        w.close()


def _agree(tmp_path, seed, runner=None, at_step=None, first=0, run=random_run):
    rng = np.random.default_rng(seed)
    n_train, n_heldout = int(rng.integers(200, 600)), 20
    # Odd seeds: row groups of 50 records, so that buckets are cut on row-group boundaries
    # (50 records each instead of 97) and strings come from several Parquet dictionaries.
    man = write_manifest(tmp_path / "m.parquet", n_train, n_heldout, rng,
                         row_group=50 if seed % 2 else None)
    spool = tmp_path / "spool"
    run(spool, man, n_train, rng, first=first)
    with Ledger(tmp_path / "l.duckdb") as ledger:
        assert not ingest(spool, ledger).quarantined
    want = reference(str(tmp_path / "l.duckdb"), str(tmp_path / "m.parquet"), "r", at_step)
    for kind in ("spool", "ledger"):
        out = tmp_path / f"out-{kind}"
        report = reconcile(run_id="r", manifest=tmp_path / "m.parquet", out=out,
                           at_step=at_step, runner=runner, bucket_records=97,
                           **{kind: spool if kind == "spool" else tmp_path / "l.duckdb"})
        got = from_report(report, pq.read_table(out / "steps.parquet"))
        for key in want:
            assert _plain(got[key]) == _plain(want[key]), (kind, key)
    return report


def _plain(x):
    if isinstance(x, dict):
        return {int(k) if isinstance(k, np.integer) else k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return int(x) if isinstance(x, np.integer | bool) else x


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_beam_on_fnapi_agrees_with_sql_on_random_ledgers(tmp_path, seed):
    _agree(tmp_path, seed)


@pytest.mark.slow
def test_beam_on_fnapi_multi_processing_agrees_with_sql(tmp_path):
    _agree(tmp_path, 8, runner=RunnerSpec("direct", mode="multi_processing", workers=2))


@pytest.mark.parametrize("epochs", ["own", "global"])
def test_a_weighted_mixture_agrees_with_sql(tmp_path, epochs):
    """Each domain's own ideal, its within-epoch repeats beyond what its share forces, whether
    the run is measured by them, and no first bad step then: the job and the oracle agree on
    a mixture that weights `code` twice, with each domain's epochs or the mixture's."""
    report = _agree(tmp_path, 7, run=functools.partial(weighted_run, epochs=epochs))
    assert report["domain_ideal"]["weighted"] and report["first_bad_step"] is None
    assert report["verdict"] == "PASS", report["findings"]
    forced = report["coverage"]["epoch_duplicates"]
    assert (forced > 0) == (epochs == "global")  # code restarts within the mixture's epoch
    assert report["domain_ideal"]["epoch_duplicates"] == 0


def test_beam_agrees_with_sql_as_of_a_step(tmp_path):
    _agree(tmp_path, 5, at_step=9)


@pytest.mark.slow
def test_beam_agrees_with_sql_at_int64_steps(tmp_path):
    # From just below 2^33: the steps cross it, and any int32 or uint32 on the way wraps.
    first = 2**33 - 7
    report = _agree(tmp_path, 5, first=first)
    assert report["consumption"]["first_step"] == first
    assert report["first_bad_step"] >= first  # records repeat: the oracle agreed on where
    assert all(w["first_step"] >= first for w in report["loss"]["windows"])
    (tmp_path / "at").mkdir()
    _agree(tmp_path / "at", 6, at_step=first + 12, first=first)


@pytest.mark.slow
def test_beam_on_dask_agrees_with_sql(tmp_path):
    _agree(tmp_path, 6, runner=RunnerSpec("dask", workers=2))


@pytest.mark.slow
def test_report_files(tmp_path):
    report = _agree(tmp_path, 7)
    out = tmp_path / "out-spool"
    data = json.loads((out / "report.json").read_text())
    assert data["report_version"] == 1 and data["verdict"] in ("PASS", "WARN", "FAIL")
    for name in ("steps", "hosts", "domains"):
        assert pq.read_table(out / f"{name}.parquet").num_rows > 0
    (out / "records.parquet").write_bytes(b"what an earlier version wrote")
    again = reconcile(run_id="r", manifest=tmp_path / "m.parquet", out=out,
                      spool=tmp_path / "spool", bucket_records=97)
    assert again["coverage"] == report["coverage"] and not (out / "records.parquet").exists()
    records = pq.read_table(out / "records")  # a folder of parts, one per key bucket
    assert len(list((out / "records").glob("part-*.parquet"))) > 1
    assert records["record_key"].to_pylist() == list(range(records.num_rows))
    assert records["domain"].type == pa.string()
    assert records.num_rows == report["manifest"]["records"]
    assert sum(records["exposures"].to_pylist()) >= report["coverage"]["exposures"]
    html = (out / "report.html").read_text()
    assert "<svg" in html and "http" not in html.replace("http-equiv", "")
    codes = {f["code"] for f in report["findings"]}
    assert {"unknown_keys", "hash_mismatch", "heldout_leak"} <= codes
    # Each integrity finding's evidence: records from its examples, where they were seen, and
    # the steps and hosts they name most, each with the API path that shows it.
    for code, kind in (("unknown_keys", "unknown"), ("hash_mismatch", "hash_mismatch"),
                       ("heldout_leak", "heldout")):
        (f,) = [f for f in report["findings"] if f["code"] == code]
        rows = report["examples"][kind]
        ev = f["evidence"]
        assert [x["record_key"] for x in ev["records"]] == list(
            dict.fromkeys(x["record_key"] for x in rows))[:5]
        for x in ev["records"]:
            assert x["api"] == f"/v1/runs/r/records/{x['record_key']}"
            assert x["seen"] == [{"step": y["step"], "host": y["host"]} for y in rows
                                 if y["record_key"] == x["record_key"]]
        assert sum(s["examples"] for s in ev["steps"]) <= len(rows)
        assert ev["hosts"][0]["examples"] == max(
            sum(y["host"] == h for y in rows) for h in {y["host"] for y in rows})
    held = {x["record_key"] for x in report["examples"]["heldout"]}
    assert held and all(k >= report["coverage"]["train_records"] for k in held)


def test_a_group_delivered_twice_with_different_values_is_refused(tmp_path):
    # What FnApiRunner multi_processing (Beam 2.77) was seen to do: the stage after the join ran
    # twice for a bucket, once with a subset of its values. Both results are kept and refused.
    from tally.audit.buckets.partials import Partial
    from tally.audit.buckets.stages import SavePartials, load_partials
    from tally.audit.core.errors import TallyError

    save = SavePartials(str(tmp_path))
    same = ("bucket-3", Partial(hash_checked=10))
    for partial in (same, same, ("file-a", Partial(segments=10))):
        list(save.process(partial))
    assert sorted(p.segments + p.hash_checked for p in load_partials(tmp_path)) \
        == [10, 10]  # a retry with the same result is one result
    list(save.process(("bucket-3", Partial(hash_checked=7))))
    with pytest.raises(TallyError, match="bucket-3"):
        load_partials(tmp_path)


@pytest.mark.parametrize("base", [0, 2**33 + 5])  # steps are int64: series may start anywhere
def test_spans_merge_to_the_dense_sum_of_their_pieces(base):
    rng = np.random.default_rng(0)
    want, top, total, peak = np.zeros(5000, np.int64), np.zeros(5000, np.int64), None, None
    for _ in range(3 * Spans.MAX_PIECES):  # folds into one piece along the way
        lo, counts = int(rng.integers(3, 4000)), rng.integers(0, 9, int(rng.integers(1, 900)))
        want[lo:lo + len(counts)] += counts
        top[lo:lo + len(counts)] = np.maximum(top[lo:lo + len(counts)], counts)
        piece, high = Spans([(base + lo, counts)]), MaxSpans([(base + lo, counts)])
        total = piece if total is None else total + piece
        peak = high if peak is None else peak + high
    assert len(total.pieces) <= Spans.MAX_PIECES and len(peak.pieces) <= Spans.MAX_PIECES
    first, last = np.flatnonzero(want)[[0, -1]]
    assert total.first() == base + first
    assert np.array_equal(total.dense(), want[first:last + 1])
    assert np.array_equal(total.dense(base, base + 4999), want)  # zero outside the pieces
    assert np.array_equal(total.dense(base + 100, base + 200), want[100:201])
    assert np.array_equal(peak.dense(base, base + 4999), top)
    assert isinstance(peak, MaxSpans) and Spans().dense().size == 0
    assert np.array_equal(Spans().dense(base, base + 2), np.zeros(3))  # nothing counted


def test_buckets_follow_the_manifests_row_groups(tmp_path):
    rng = np.random.default_rng(0)
    # Whole row groups when a bucket holds at least one; else equal buckets (11 of 91).
    for row_group, bucket_records, size in ((50, 97, 50), (50, 260, 250), (None, 97, 91),
                                            (300, 97, 91)):
        write_manifest(tmp_path / "m.parquet", 990, 10, rng, row_group=row_group)
        plan = make_plan("r", tmp_path / "m.parquet", Inputs([], {}, None),
                         PlanOptions(bucket_records=bucket_records))
        assert (plan.bucket_size, plan.buckets) == (size, -(-1000 // size)), row_group


@pytest.mark.parametrize("hosts", [1, 3, 8, 11, 16, 20, 64, 128, 256, 1024])
def test_host_sets_match_a_record_by_record_count(hosts):
    from tally.audit.core.arrays import PAIRS_UP_TO
    from tally.audit.reconcile.bucket_stats import _host_sets

    rng = np.random.default_rng(hosts)
    n = 300
    j, host = rng.integers(0, n, 900), rng.integers(0, hosts, 900)
    # A few records on many hosts (the dense product's share), one on every host.
    wide = [(r, h) for r, k in ((0, hosts), (1, min(hosts, PAIRS_UP_TO + 1)), (2, 40))
            for h in rng.permutation(hosts)[:k]]
    j = np.r_[j, [r for r, _ in wide]]
    host = np.r_[host, [h for _, h in wide]]
    train = rng.random(n) < 0.9
    train[:3] = True
    seen = np.zeros((n, hosts), bool)  # the oracle: a dense record x host table
    seen[j, host] = True
    tr = seen[train].astype(np.int64)
    unique, others, overlap, n_hosts = _host_sets(j, host, n, hosts, train)
    assert unique.tolist() == tr.sum(axis=0).tolist()
    assert others.tolist() == tr[tr.sum(axis=1) > 1].sum(axis=0).tolist()
    assert np.array_equal(overlap, tr.T @ tr)
    assert n_hosts.tolist() == seen.sum(axis=1).tolist()
    assert hosts == 1 or overlap[:, 0].sum() > unique[0]  # records shared with host 0 are here


@pytest.mark.parametrize("hosts", [1, 5, 16, 17, 64])
def test_hosts_of_repeated_groups_match_a_group_by_group_count(hosts):
    """Per host, the (record, epoch) groups seen more than once that it took part in: the
    histogram of host sets (<= 16 hosts) and the distinct pairs (more) against Python sets."""
    from tally.audit.reconcile.bucket_stats import _hosts_of_repeated

    rng = np.random.default_rng(hosts)
    counts = rng.integers(1, 5, 400)
    host = rng.integers(0, hosts, int(counts.sum()))
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    want = np.zeros(hosts, np.int64)
    for a, k in zip(starts, counts, strict=True):
        if k > 1:
            for h in set(host[a:a + k].tolist()):
                want[h] += 1
    assert _hosts_of_repeated(starts, counts, host, hosts).tolist() == want.tolist()
    one = np.ones(3, np.int64)  # no group repeated: nobody took part in one
    assert _hosts_of_repeated(np.arange(3), one, np.zeros(3, np.int64), hosts).tolist() == \
        [0] * hosts


def test_a_bucket_gives_the_same_numbers_by_either_sort():
    """compute() orders a bucket's starts by (record, step) with the within-epoch sort when
    every epoch is known and no loss is logged, else with a sort of its own: both give the same
    partial and per-record rows (the loss split aside, which only the second computes)."""
    from tally.audit.reconcile.bucket_stats import compute

    rng = np.random.default_rng(3)
    n, rows, hosts = 500, 6000, np.arange(4)
    man = {"record_key": np.arange(1000, 1000 + n), "content_hash": rng.integers(0, 2**62, n),
           "n_tokens": rng.integers(1, 50, n).astype(np.int32), "split": np.zeros(n, np.int32),
           "split_names": ["train"], "domain": np.zeros(n, np.int32), "domain_names": ["web"],
           "source": np.zeros(n, np.int32), "source_names": ["s"]}
    step = np.sort(rng.integers(7, 400, rows))
    key = rng.integers(0, n, rows).astype(np.uint32)
    c = {"key": key, "step": step, "host": rng.integers(0, 4, rows).astype(np.uint16),
         "start": rng.random(rows) < 0.8, "n_tokens": man["n_tokens"][key],
         "content_hash": man["content_hash"][key], "epoch": (step // 100).astype(np.int32),
         "loss": np.full(rows, np.nan, np.float32)}
    plain, plain_records = compute(man, c, hosts, 10, 7)
    lossy, lossy_records = compute(man, {**c, "loss": rng.random(rows).astype(np.float32)},
                                   hosts, 10, 7)
    assert plain.loss_by_rank.size == 0 and lossy.loss_by_rank.size > 0
    for f in dataclasses.fields(plain):
        if f.name != "loss_by_rank":
            a, b = getattr(plain, f.name), getattr(lossy, f.name)
            a, b = (x.dense() if hasattr(x, "dense") else x for x in (a, b))
            np.testing.assert_equal(a, b, err_msg=f.name)
    assert plain_records.equals(lossy_records)
    assert plain.epoch_duplicates > 0 and plain.max_rank_by_step.dense().max() > 1


def test_a_run_spanning_more_than_max_run_steps_is_refused_in_one_line(tmp_path):
    rng = np.random.default_rng(0)
    man = write_manifest(tmp_path / "m.parquet", 100, 0, rng)
    keys = {k: man[k].to_numpy() for k in ("record_key", "n_tokens", "content_hash")}
    for host, step in ((0, 3), (1, 3 + MAX_RUN_STEPS)):  # 2^31 + 1 steps from first to last
        with LedgerWriter(tmp_path / "spool", "r", host=host, host_count=2, fsync=False) as w:
            w.write_segments(step, Segments.build(
                row=np.zeros(1), record_key=keys["record_key"][:1],
                n_tokens=keys["n_tokens"][:1], content_hash=keys["content_hash"][:1]))
    with pytest.raises(TallyError, match=r"spans steps 3\.\.2147483651, 2,147,483,649 steps"):
        reconcile(run_id="r", manifest=tmp_path / "m.parquet", out=tmp_path / "out",
                  spool=tmp_path / "spool")
    assert not (tmp_path / "out").exists()


def test_host_step_ranges_of_a_file_match_a_plain_set_of_steps():
    """host_steps.per_file's covered step ranges, per (attempt, host), against Python sets of
    the steps: rows in any order, several attempts and hosts, repeated steps, gaps; and a file
    with no rows."""
    from tally.audit.buckets import host_steps

    rng = np.random.default_rng(7)
    n = 3000
    cols = {"attempt": rng.integers(0, 3, n), "host": rng.integers(0, 4, n),
            "step": rng.integers(0, 400, n), "epoch": np.full(n, -1),
            "offset": np.ones(n, np.int64), "record_key": np.arange(n)}
    want: dict[tuple[int, int], set[int]] = {}
    for a, h, s in zip(cols["attempt"], cols["host"], cols["step"], strict=True):
        want.setdefault((int(a), int(h)), set()).add(int(s))
    got: dict[tuple[int, int], set[int]] = {}
    for a, h, lo, hi in host_steps.per_file(cols, 10)["host_step_ranges"]:
        steps = got.setdefault((a, h), set())
        assert not steps & set(range(lo, hi + 1))  # ranges are disjoint
        steps |= set(range(lo, hi + 1))
    assert got == want
    empty = {k: v[:0] for k, v in cols.items()}
    assert host_steps.per_file(empty, 10)["host_step_ranges"] == []


def test_fused_edges_and_ranges_give_what_the_files_own_give_in_any_merge_order():
    """A reconcile's per-file edges and covered ranges are fused as partials merge
    (host_steps.fused_edges, fused_ranges): the repeated batches and gaps found from them, in
    any merge order, are those found from every file's own, and what is kept shrinks to about
    one a host's stretch of meeting files."""
    import itertools
    from functools import reduce

    from tally.audit.buckets import host_steps
    from tally.audit.buckets.partials import Partial

    rng = np.random.default_rng(11)
    files = []  # (edges, ranges) of one file each
    for attempt, hosts in ((0, 6), (1, 4)):
        for h in range(hosts):
            step = 1000 * attempt + int(rng.integers(0, 3))
            last_sig = None
            for _ in range(40):
                n = int(rng.integers(1, 6))
                first_sig = last_sig if rng.random() < 0.15 and last_sig else \
                    (int(rng.integers(1 << 40)), int(rng.integers(0, 4)))
                last_sig = (int(rng.integers(1 << 40)), int(rng.integers(0, 4)))
                edge = host_steps.Edge(h, step, first_sig, step + n - 1, last_sig)
                files.append(([edge], [(attempt, h, step, step + n - 1)]))
                if n > 2 and rng.random() < 0.2:  # covered twice (ranges of a ledger export)
                    files.append(([], [(attempt, h, step, step + n - 2)]))
                step += n + (int(rng.integers(1, 4)) if rng.random() < 0.1 else 0)
    want_edges = [e for es, _ in files for e in es]
    want_ranges = [r for _, rs in files for r in rs]
    want = (host_steps.repeated_batches([], want_edges, 3),
            host_steps.gaps(want_ranges, {0: 7, 1: 4}, {0: True, 1: False}))
    assert want[0] and want[1][0] and want[1][1]  # repeats, gaps and a silent host to find
    for seed in range(6):  # 0 and 1 in file order (host by host, as a job's chunks)
        order = np.random.default_rng(seed).permutation(len(files)) if seed > 1 else \
            np.arange(len(files))
        parts = [Partial(host_step_edges=files[i][0], host_step_ranges=files[i][1])
                 for i in order]
        if seed % 2:  # a tree of merges, as workers and the driver make
            while len(parts) > 1:
                parts = [a.merge(b) for a, b in zip(parts[::2], parts[1::2], strict=False)] \
                    + ([parts[-1]] if len(parts) % 2 else [])
            merged = parts[0]
        else:
            merged = reduce(Partial.merge, parts)
        got = (host_steps.repeated_batches([], merged.host_step_edges, 3),
               host_steps.gaps(merged.host_step_ranges, {0: 7, 1: 4}, {0: True, 1: False}))
        assert got == want
        # Fused all the way: in order, no two neighbours meeting (what later merges rely on).
        e, r = merged.host_step_edges, merged.host_step_ranges
        assert e == sorted(e, key=lambda x: (x.host, x.first)) and r == sorted(r)
        assert not any(x.host == y.host and y.first == x.last + 1
                       for x, y in itertools.pairwise(e))
        assert not any(x[:2] == y[:2] and y[2] <= x[3] + 1 for x, y in itertools.pairwise(r))
        assert len(e) < len(files) / 4 and len(r) < len(files) / 4


def test_input_files_are_cut_into_tasks_of_whole_files_in_order():
    """The job reads its inputs a chunk of files at a time (tally.audit.buckets.plan.chunks):
    every file once, in order, whole, about CHUNK_ROWS rows a chunk, or fewer rows where a
    small job would otherwise be too few tasks for its workers."""
    from tally.audit.buckets.plan import CHUNK_ROWS, TASKS, InputFile, chunks

    rng = np.random.default_rng(7)
    for n, most in ((3, 10), (400, 200_000), (300, 40_000_000)):
        files = [InputFile(f"f{i}", rows=int(r)) for i, r in
                 enumerate(rng.integers(1, most, n))]
        got = chunks(files)
        assert [f for c in got for f in c] == files
        total = sum(f.rows for f in files)
        target = min(CHUNK_ROWS, max(1, total // TASKS))
        # A chunk stops before the file that would take it past the target (a file alone may).
        assert all(sum(f.rows for f in c) <= target or len(c) == 1 for c in got)
        assert all(sum(f.rows for f in c) + nxt[0].rows > target
                   for c, nxt in zip(got[:-1], got[1:], strict=True))
        assert len(got) >= min(n, TASKS // 2)


def test_bucket_files_give_back_every_row_with_int64_steps_and_losses_where_logged(tmp_path):
    """Rows cut into bucket files and read back, bucket by bucket, from two files: one with
    losses (some NaN) at steps beyond 2^40, one without (its loss column left out of the file,
    read back as NaN beside the other's); keys beyond the last bucket in the overflow bucket."""
    from tally.audit.buckets import exchange
    from tally.audit.core.exposure import starts

    rng = np.random.default_rng(3)
    size, n_buckets = 100, 4
    files = []
    for i, (base, losses) in enumerate(((2**40 + 7, True), (5, False))):
        n = 5_000
        cols = {"record_key": rng.integers(0, size * n_buckets + 50, n),
                "step": base + rng.integers(0, 1_000, n), "host": rng.integers(0, 1024, n),
                "offset": rng.integers(0, 3, n) * 7, "n_tokens": rng.integers(1, 900, n),
                "content_hash": rng.integers(0, 2**63, n, dtype=np.uint64),
                "epoch": rng.integers(-1, 3, n),
                "loss": np.where(rng.random(n) < 0.3, np.nan, rng.random(n)) if losses
                else np.full(n, np.nan)}
        cols = {k: v.astype(np.dtype(exchange.COLUMNS.get(k, v.dtype))) if k not in
                ("record_key", "step", "offset") else v for k, v in cols.items()}
        refs = exchange.write(cols, size, n_buckets, tmp_path / f"{i}.bin")
        assert all(s.loss == losses and s.step_base == cols["step"].min() for _, s in refs)
        files.append((cols, refs))
    assert (tmp_path / "1.bin").stat().st_size < (tmp_path / "0.bin").stat().st_size
    for b in range(n_buckets + 1):
        got = exchange.read([s for _, refs in files for k, s in refs if k == b],
                            overflow=b == n_buckets)
        want: dict[str, list] = {}
        for cols, _ in sorted(files, key=lambda f: str(f[1][0][1].path)):
            mine = np.minimum(cols["record_key"] // size, n_buckets) == b
            key = cols["record_key"][mine]
            parts = {"key": key if b == n_buckets else key - b * size,
                     "start": starts(cols["offset"][mine]),
                     **{k: cols[k][mine] for k in ("step", "host", "n_tokens", "content_hash",
                                                    "epoch", "loss")}}
            for k, v in parts.items():
                want.setdefault(k, []).append(v)
        assert got["step"].dtype == np.int64
        for k, v in want.items():
            assert np.array_equal(got[k], np.concatenate(v), equal_nan=k == "loss"), (b, k)


def test_the_run_aware_sort_sorts_whatever_order_it_is_given():
    """`sort_in_place` picks timsort for values in sorted runs and introsort otherwise; either
    way the values come out as np.sort gives them (ties, negatives, the int64 extremes)."""
    from tally.audit.core.arrays import sort_in_place

    rng = np.random.default_rng(3)
    rand = rng.integers(-2**63, 2**63 - 1, 50_000, dtype=np.int64, endpoint=True)
    runs = np.concatenate([np.sort(p) for p in np.array_split(rand, 5)])
    cases = [rand, runs, runs[::-1].copy(), np.sort(rand), rng.integers(0, 3, 10_000),
             np.zeros(0, np.int64), np.array([7]), np.array([2, 1])]
    for a in cases:
        want = np.sort(a)
        assert (sort_in_place(a) == want).all() and (a == want).all()
    u = np.sort(rng.integers(0, 2**64 - 1, 1000, dtype=np.uint64, endpoint=True))
    both = np.concatenate([u[500:], u[:500]])
    assert (sort_in_place(both) == u).all()


def test_each_domains_own_ideal_and_when_a_run_is_measured_by_it():
    """By hand: code's 4 records seen 2, 2, 3, 3 times and web's 6 seen 1 or 2 times are each
    within their own domain's passes, while 2 of code's exposures are beyond the whole
    split's ideal (18 over 10 records: 1 or 2 each)."""
    from tally.audit.core.exposure import (
        domain_distance,
        domain_epoch_distance,
        domain_epoch_duplicates,
        excess,
        weighted_domains,
    )
    levels = {"code": np.array([0, 0, 2, 2]), "web": np.array([0, 4, 2])}
    assert domain_distance(levels) == {"code": (0, 0), "web": (0, 0)}
    split = excess(np.array([0, 4, 4, 2]), 18, 10)
    assert split == (2, 0)
    assert weighted_domains((*split, 0), (0, 0, 0), levels)
    assert not weighted_domains((0, 0, 0), (0, 0, 0), levels)  # nothing to explain
    assert not weighted_domains((*split, 0), (0, 0, 0), {"code": levels["code"]})  # one domain
    # A domain never read is left out, not weighted at zero.
    assert not weighted_domains((*split, 0), (0, 0, 0), {**levels, "books": np.array([3])})
    # Passes a twentieth apart (a sampler's padding landing in one domain): not weights.
    padded = {"code": np.array([0, 19, 1]), "web": np.array([0, 20])}
    assert domain_distance(padded) == {"code": (0, 0), "web": (0, 0)}
    assert not weighted_domains((0, 0, 1), (0, 0, 0), padded)
    assert weighted_domains((0, 0, 1), (0, 0, 0), {**padded, "code": np.array([0, 9, 1])})
    # Own ideals that leave more than a tenth of the distance: a fault, not weights.
    assert weighted_domains((20, 0, 0), (2, 0, 0), levels)
    assert not weighted_domains((20, 0, 0), (3, 0, 0), levels)
    # code (4 records) seen 3, 3, 2, 2 times in epoch 0 (10 exposures, 4 distinct: 6 repeats
    # forced, none beyond) and 2, 2, 2, 0 times in epoch 1 (6 exposures, 3 distinct: 2
    # forced, 1 beyond; the record not seen is 1 below that epoch's floor of 1.5 passes).
    by_epoch = {"code": np.array([[0, 0, 2, 2], [0, 0, 3, 0]])}
    assert domain_epoch_duplicates({"code": 4}, by_epoch) == 1
    assert domain_epoch_distance({"code": 4}, by_epoch) == (0, 1)
    assert domain_epoch_distance({"code": 4}, {"code": by_epoch["code"][:1]}) == (0, 0)


def test_domains_epochs_untold_beyond_the_cells_kept_count_every_repeat(tmp_path, monkeypatch):
    """A bucket whose (domain, epoch, times seen) cells exceed what is kept leaves each
    domain's epochs untold: the within-epoch repeats then count in full (none is said to be
    forced by a weight) and no epoch is said even; the rest of the report is unchanged."""
    from tally.audit.reconcile import bucket_stats

    rng = np.random.default_rng(7)
    n_train = int(rng.integers(200, 600))
    man = write_manifest(tmp_path / "m.parquet", n_train, 20, rng, row_group=50)
    weighted_run(tmp_path / "spool", man, n_train, rng, epochs="global")
    told = reconcile(run_id="r", manifest=tmp_path / "m.parquet", out=tmp_path / "told",
                     spool=tmp_path / "spool")
    monkeypatch.setattr(bucket_stats, "DOMAIN_EPOCH_CELLS", 4)
    untold = reconcile(run_id="r", manifest=tmp_path / "m.parquet", out=tmp_path / "untold",
                       spool=tmp_path / "spool")
    assert told["domain_ideal"]["epoch_duplicates"] == 0 and told["domain_ideal"]["weighted"]
    assert untold["domain_ideal"]["epoch_duplicates"] == untold["coverage"]["epoch_duplicates"] > 0
    assert not untold["domain_ideal"]["epochs_even"] and not untold["domain_ideal"]["weighted"]
    assert untold["coverage"] == told["coverage"]
    # Each domain's own within-epoch repeats are told where the cells are, and add up to the
    # run's; untold, none is said.
    assert sum(d.pop("epoch_duplicates") for d in told["domains"]) == \
        told["coverage"]["epoch_duplicates"]
    assert {d.pop("epoch_duplicates") for d in untold["domains"]} == {None}
    assert untold["domains"] == told["domains"]
