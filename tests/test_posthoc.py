"""Post-hoc audits: `tally diff` (the Beam job, on FnApiRunner and Dask) against the DuckDB SQL
reference (bench/reference/posthoc_sql.py) on random ledgers, on real Grain runs with exact and
inexact resumes, and on README's Grain and PyTorch examples over the same corpus; `tally
exposure` on a corpus with planted duplicates against SQL."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 (pa.compute)
import pyarrow.parquet as pq
import pytest

from bench.reference.posthoc_sql import exposure_reference, from_diff, reference
from tally.audit.core.hashing import content_hash
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.posthoc.diff import diff
from tally.audit.posthoc.sources import parse_run_source, run_source
from tally.pipeline.corpus import TokenSource
from tally.pipeline.loader import KeyedLoader, LoaderConfig
from tally.pipeline.manifest import build_manifest
from tally.pipeline.runners import RunnerSpec
from tests.support import ROOT
from tests.support.browser import chromium, needs_chromium
from tests.support.cli import tally_bare
from tests.test_reconcile import random_run, write_manifest


def _tables(out: Path) -> dict:
    return {name: pq.read_table(out / f"{name}.parquet") for name in ("steps", "windows")}


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return int(x) if isinstance(x, np.integer | bool) else x


def agrees(d: dict, out: Path, a: tuple[str, str], b: tuple[str, str], manifest: Path,
           at_step: int | None = None) -> dict:
    want = reference((str(a[0]), a[1]), (str(b[0]), b[1]), str(manifest), at_step,
                     d["windows"]["steps"])
    got = from_diff(d, _tables(out))
    for key in want:
        assert _plain(got[key]) == _plain(want[key]), key
    return want


# ---- random ledgers ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def random_ledger(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("random")
    rng = np.random.default_rng(11)
    man = write_manifest(tmp / "m.parquet", 400, 20, rng, row_group=50)
    random_run(tmp / "spool", man, 400, rng, run_id="r")
    random_run(tmp / "spool", man, 400, np.random.default_rng(12), run_id="s")
    with Ledger(tmp / "l.duckdb") as ledger:
        assert not ingest(tmp / "spool", ledger).quarantined
    return tmp


@pytest.mark.parametrize("at_step,window", [(None, None), (9, 3)])
def test_diff_agrees_with_sql_on_random_ledgers(random_ledger, tmp_path, at_step, window):
    tmp = random_ledger
    d = diff(a=run_source(tmp / "spool", "r"), b=run_source(tmp / "l.duckdb", "s"),
             manifest=tmp / "m.parquet", out=tmp_path / "d", at_step=at_step, window=window,
             bucket_records=97)
    want = agrees(d, tmp_path / "d", (tmp / "l.duckdb", "r"), (tmp / "l.duckdb", "s"),
                  tmp / "m.parquet", at_step)
    assert d["status"] == "different" and d["verdict"] == "FAIL"
    assert d["first_divergent_step"] == want["first_divergent_step"] is not None
    assert d["records_only_a"] == want["records"]["only_a"] > 0
    assert {f["code"] for f in d["findings"]} >= {"diverged", "unknown_keys"}
    # Records: one part per key bucket, every manifest record once.
    records = pq.read_table(tmp_path / "d" / "records")
    assert records["record_key"].to_pylist() == list(range(420))
    assert sum(records["difference"].to_pylist()) == sum(
        int(k) * v for k, v in d["exposure_difference_histogram"].items())
    html = (tmp_path / "d" / "diff.html").read_text()
    assert html.count("<svg") >= 4 and "http" not in html.replace("http-equiv", "")


def test_diff_agrees_with_sql_at_int64_steps(tmp_path):
    # Both runs from just below 2^33, B a few steps later: the steps cross 2^33, and any int32
    # or uint32 on the way wraps.
    rng = np.random.default_rng(13)
    man = write_manifest(tmp_path / "m.parquet", 300, 20, rng)
    random_run(tmp_path / "spool", man, 300, rng, run_id="r", first=2**33 - 9)
    random_run(tmp_path / "spool", man, 300, rng, run_id="s", first=2**33 - 4)
    with Ledger(tmp_path / "l.duckdb") as ledger:
        assert not ingest(tmp_path / "spool", ledger).quarantined
    d = diff(a=run_source(tmp_path / "spool", "r"), b=run_source(tmp_path / "l.duckdb", "s"),
             manifest=tmp_path / "m.parquet", out=tmp_path / "d", window=4, bucket_records=97)
    want = agrees(d, tmp_path / "d", (tmp_path / "l.duckdb", "r"), (tmp_path / "l.duckdb", "s"),
                  tmp_path / "m.parquet")
    assert d["first_divergent_step"] == want["first_divergent_step"] == 2**33 - 9
    assert d["a"]["first_step"] == 2**33 - 9 and d["b"]["first_step"] == 2**33 - 4
    first_seen = pq.read_table(tmp_path / "d" / "records")["first_step_b"].to_numpy()
    assert first_seen[first_seen >= 0].min() == 2**33 - 4


def test_a_run_against_itself_from_spool_and_ledger_is_identical(random_ledger, tmp_path):
    tmp = random_ledger
    d = diff(a=run_source(tmp / "spool", "s"), b=run_source(tmp / "l.duckdb", "s"),
             manifest=tmp / "m.parquet", out=tmp_path / "d", bucket_records=97)
    agrees(d, tmp_path / "d", (tmp / "l.duckdb", "s"), (tmp / "l.duckdb", "s"),
           tmp / "m.parquet")
    assert d["status"] == "identical" and d["first_divergent_step"] is None
    assert d["identical_steps"] == d["steps_compared"] > 0
    assert d["records_only_a"] == d["records_only_b"] == 0
    assert set(d["exposure_difference_histogram"]) == {"0"}
    assert [f["code"] for f in d["findings"]] == ["unknown_keys", "unknown_keys", "identical"]


@pytest.mark.slow
def test_diff_on_dask_agrees_with_sql(random_ledger, tmp_path):
    tmp = random_ledger
    d = diff(a=run_source(tmp / "l.duckdb", "s"), b=run_source(tmp / "spool", "r"),
             manifest=tmp / "m.parquet", out=tmp_path / "d", bucket_records=150,
             runner=RunnerSpec("dask", workers=2))
    agrees(d, tmp_path / "d", (tmp / "l.duckdb", "s"), (tmp / "l.duckdb", "r"),
           tmp / "m.parquet")


def test_source_arguments():
    from tally.audit.core.errors import TallyError

    assert parse_run_source(f"{ROOT}:exp1").kind == "spool"
    assert parse_run_source(f"{ROOT / 'README.md'}:x.1").kind == "ledger"
    for text, words in (("nocolon", "expected SOURCE:RUN"), (f"{ROOT}:", "expected SOURCE:RUN"),
                        ("/no/such:r", "neither a spool directory nor a ledger file"),
                        (f"{ROOT}:bad run", "is not a run id")):
        with pytest.raises(TallyError, match=words):
            parse_run_source(text)


# ---- real Grain runs: an exact resume, an inexact one --------------------------------------------

HOSTS, STEPS, CRASH, RESUME = 2, 16, 11, 8


def _loader_run(spool: Path, source, run: str, *, resume_state_at: int | None = None) -> None:
    """HOSTS hosts consume STEPS steps. With `resume_state_at`, attempt 0 crashes after step
    CRASH and attempt 1 resumes at step RESUME from the loader states saved after
    `resume_state_at` steps (exact when that is RESUME)."""
    cfg = LoaderConfig(seq_len=32, global_batch=8, packing="first_fit", read_threads=0,
                       read_buffer=0)
    for h in range(HOSTS):
        loader = KeyedLoader(source, cfg, h, HOSTS)
        saved = None
        last = STEPS if resume_state_at is None else CRASH + 1
        with LedgerWriter(spool, run, host=h, host_count=HOSTS, records_per_epoch=len(source),
                          flush_every=4, fsync=False) as w:
            for step in range(last):
                if step == resume_state_at:
                    saved = loader.get_state()
                w.write_batch(step, next(loader))
        loader.close()
        if resume_state_at is None:
            continue
        loader = KeyedLoader(source, cfg, h, HOSTS)
        loader.set_state(saved)
        with LedgerWriter(spool, run, host=h, host_count=HOSTS, attempt=1,
                          resumed_from_step=RESUME, records_per_epoch=len(source),
                          flush_every=4, fsync=False) as w:
            for step in range(RESUME, STEPS):
                w.write_batch(step, next(loader))
        loader.close()


@pytest.fixture(scope="module")
def grain_runs(tmp_path_factory):
    from tally.pipeline.synth import synth_corpus

    tmp = tmp_path_factory.mktemp("grain")
    synth_corpus(tmp / "c", records=300, seed=5, length_scale=0.02, min_len=4, max_len=40)
    build_manifest(tmp / "c", tmp / "m.parquet")
    source = TokenSource(tmp / "c")
    _loader_run(tmp / "spool", source, "straight")
    _loader_run(tmp / "spool", source, "resumed", resume_state_at=RESUME)
    _loader_run(tmp / "spool", source, "inexact", resume_state_at=4)
    with Ledger(tmp / "l.duckdb") as ledger:
        assert not ingest(tmp / "spool", ledger).quarantined
    return tmp


def test_an_exact_resume_is_identical_to_the_run_without_a_crash(grain_runs, tmp_path):
    tmp = grain_runs
    d = diff(a=run_source(tmp / "spool", "straight"), b=run_source(tmp / "spool", "resumed"),
             manifest=tmp / "m.parquet", out=tmp_path / "d")
    agrees(d, tmp_path / "d", (tmp / "l.duckdb", "straight"), (tmp / "l.duckdb", "resumed"),
           tmp / "m.parquet")
    assert d["status"] == "identical" and d["verdict"] == "PASS"
    assert d["identical_steps"] == d["steps_compared"] == STEPS
    assert d["b"]["attempts"] == 2 and d["b"]["segments"] == d["a"]["segments"]


def test_an_inexact_replay_diverges_at_the_resume_step(grain_runs, tmp_path):
    tmp = grain_runs
    d = diff(a=run_source(tmp / "l.duckdb", "straight"), b=run_source(tmp / "spool", "inexact"),
             manifest=tmp / "m.parquet", out=tmp_path / "d", window=4)
    want = agrees(d, tmp_path / "d", (tmp / "l.duckdb", "straight"),
                  (tmp / "l.duckdb", "inexact"), tmp / "m.parquet")
    assert d["first_divergent_step"] == RESUME and d["identical_steps"] == RESUME
    assert d["status"] == "different"
    # Steps 8..11 of B replay what A consumed at 4..7: records seen twice by B, once by A.
    assert d["records"]["more_often_b"] > 0 and d["records_only_a"] > 0
    assert want["records"]["more_often_b"] == d["records"]["more_often_b"]
    win = pq.read_table(tmp_path / "d" / "windows.parquet").to_pylist()
    assert [w["same_multiset"] for w in win] == [True, True, False, False]
    # As of step 7, before the resume, they are the same run.
    d7 = diff(a=run_source(tmp / "l.duckdb", "straight"), b=run_source(tmp / "spool", "inexact"),
              manifest=tmp / "m.parquet", out=tmp_path / "d7", at_step=RESUME - 1)
    assert d7["status"] == "identical" and d7["steps_compared"] == RESUME


# ---- the command line ---------------------------------------------------------------------------

@pytest.mark.slow
def test_diff_command_exit_codes_and_one_line_errors(grain_runs, tmp_path):
    tmp = grain_runs
    m = str(tmp / "m.parquet")
    r = tally_bare("diff", "--manifest", m, "-o", str(tmp_path / "same"), "--a",
                   f"{tmp / 'spool'}:straight", "--b", f"{tmp / 'l.duckdb'}:resumed", "--strict")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"diff A {tmp / 'spool'}:straight vs B") and "IDENTICAL" \
        in r.stdout and f"steps: {STEPS} of {STEPS} identical" in r.stdout
    assert not (tmp_path / "same" / ".work").exists()
    for args, words in (
            (["--a", "nope", "--b", f"{tmp / 'spool'}:x"], "--a 'nope': expected SOURCE:RUN"),
            (["--a", f"{tmp / 'spool'}:straight", "--b", f"{tmp / 'spool'}:missing"],
             "no segment files for run 'missing'"),
            (["--a", f"{tmp / 'l.duckdb'}:missing", "--b", f"{tmp / 'spool'}:straight"],
             "run 'missing' is not in ledger"),
            (["--a", f"{tmp / 'spool'}:straight", "--b", f"{tmp / 'spool'}:inexact",
              "--window", "0"], "--window must be >= 1")):
        r = tally_bare("diff", "--manifest", m, "-o", str(tmp_path / "x"), *args)
        assert r.returncode == 2 and r.stderr.startswith("tally: error: ") and words in \
            r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


# ---- tally exposure: a corpus with planted duplicates -------------------------------------------

def _tokens(rng, n) -> list[np.ndarray]:
    return [rng.integers(0, 50_000, int(rng.integers(5, 30)), dtype=np.int32) for _ in range(n)]


def _shard(path: Path, docs: list[np.ndarray], domain: str = "web") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"tokens": pa.array([d.tolist() for d in docs],
                                                pa.list_(pa.int32())),
                             "domain": [domain] * len(docs)}), path)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A 200-record train split where record 10 is also 150 and 199, record 20 also 60, and
    held-out record 200 repeats train record 30; two runs over it (one with a resume)."""
    tmp = tmp_path_factory.mktemp("planted")
    rng = np.random.default_rng(3)
    train, heldout = _tokens(rng, 200), _tokens(rng, 10)
    train[150] = train[199] = train[10]
    train[60] = train[20]
    heldout[0] = train[30]
    _shard(tmp / "corpus" / "train-0.parquet", train)
    _shard(tmp / "corpus" / "heldout-0.parquet", heldout, "eval")
    build_manifest(tmp / "corpus", tmp / "m.parquet")
    source = TokenSource(tmp / "corpus")
    cfg = LoaderConfig(seq_len=64, global_batch=8, read_threads=0, read_buffer=0)
    with KeyedLoader(source, cfg) as loader, LedgerWriter(
            tmp / "spool", "r1", host=0, host_count=1, records_per_epoch=200,
            fsync=False) as w:
        for step in range(40):  # 320 exposures of 200 records: some twice
            w.write_batch(step, next(loader))
    _loader_run(tmp / "spool", source, "r2", resume_state_at=4)  # steps 8..11 rolled back
    with Ledger(tmp / "l.duckdb") as ledger:
        assert not ingest(tmp / "spool", ledger).quarantined
    # The evaluation set: 10 (3 copies in the corpus), 20 (2), 30 (train and held out), a
    # document in no corpus, 5 twice, and a prefix of 7 (not an exact match).
    docs = [train[10], train[20], train[30], _tokens(rng, 1)[0], train[5], train[5],
            train[7][:3]]
    _shard(tmp / "evalset" / "eval-0.parquet", docs, "eval")
    return tmp, [content_hash(d) for d in docs]


def _rows(table: pa.Table) -> dict:
    return {(r["document"], r["record_key"], r["run_id"]): (
        r["exposures"], r["first_step"], r["last_step"], r["hosts"], r["epochs"])
        for r in table.to_pylist()}


def test_exposure_of_documents_with_planted_duplicates_agrees_with_sql(planted, tmp_path):
    from tally.audit.posthoc.exposure import exposure

    tmp, hashes = planted
    want = exposure_reference(str(tmp / "l.duckdb"), str(tmp / "m.parquet"), ["r1", "r2"],
                              hashes)
    results = []
    for kind, src in (("spool", tmp / "spool"), ("ledger", tmp / "l.duckdb")):
        out = tmp_path / kind
        res = exposure(manifest=tmp / "m.parquet", docs=tmp / "evalset", runs=["r1", "r2"],
                       out=out, **{kind: src})
        table = pq.read_table(out / "exposure.parquet")
        assert _rows(table) == want["rows"], kind
        for run_id in ("r1", "r2"):
            got = {k: res["runs"][run_id][k] for k in want["runs"][run_id]}
            assert got == want["runs"][run_id], (kind, run_id)
        results.append((res, table))
    (res, table), (res2, table2) = results
    assert table.equals(table2) and res["runs"] == res2["runs"]
    # Matches by exact content: every copy, across splits; a prefix matches nothing.
    keys = {}
    for r in table.filter(pa.compute.equal(table["run_id"], "r1")).to_pylist():
        keys.setdefault(r["document"], []).append(r["record_key"])
    assert keys == {0: [10, 150, 199], 1: [20, 60], 2: [30, 200], 3: [None], 4: [5], 5: [5],
                    6: [None]}
    assert (res["documents"], res["matched"], res["matched_records"]) == (7, 5, 8)
    r1 = res["runs"]["r1"]
    assert r1["matched"] == 5 and r1["consumed"] == 5 and r1["consumed_2plus"] >= 1
    # Record 10's three copies each seen at least once in 320 exposures of 200 records.
    assert sum(r["exposures"] for r in table.to_pylist()
               if r["document"] == 0 and r["run_id"] == "r1") >= 3
    assert res["consumed_by_runs"] == {"0": 2, "1": want_runs_consuming(want, 1),
                                       "2": want_runs_consuming(want, 2)}


def want_runs_consuming(want: dict, k: int) -> int:
    per_doc: dict[int, set] = {}
    for (doc, _, run_id), row in want["rows"].items():
        per_doc.setdefault(doc, set())
        if row[0]:
            per_doc[doc].add(run_id)
    return sum(1 for runs in per_doc.values() if len(runs) == k)


@pytest.mark.slow
def test_exposure_documents_as_hashes_or_record_keys(planted, tmp_path):
    from tally.audit.core.errors import TallyError
    from tally.audit.posthoc.exposure import exposure

    tmp, hashes = planted
    base = exposure(manifest=tmp / "m.parquet", docs=tmp / "evalset", runs=["r1"],
                    out=tmp_path / "base", ledger=tmp / "l.duckdb")
    for name, col in (("u64", pa.array(hashes, pa.uint64())),
                      ("hex", pa.array([f"{h:#x}" for h in hashes])),
                      ("i64", pa.array(np.array(hashes, np.uint64).view(np.int64)))):
        pq.write_table(pa.table({"content_hash": col}), tmp_path / f"{name}.parquet")
        res = exposure(manifest=tmp / "m.parquet", docs=tmp_path / f"{name}.parquet",
                       runs=["r1"], out=tmp_path / name, ledger=tmp / "l.duckdb")
        assert res["runs"] == base["runs"], name
    shard = exposure(manifest=tmp / "m.parquet", docs=tmp / "evalset" / "eval-0.parquet",
                     runs=["r1"], out=tmp_path / "shard", ledger=tmp / "l.duckdb")
    assert shard["runs"] == base["runs"] and shard["docs"]["by"] == "tokens"
    # Record keys name contents: key 150 matches 10 and 199 too; key 10**6 is no record.
    pq.write_table(pa.table({"record_key": [150, 10**6]}), tmp_path / "keys.parquet")
    res = exposure(manifest=tmp / "m.parquet", docs=tmp_path / "keys.parquet", runs=["r1"],
                   out=tmp_path / "keys", spool=tmp / "spool")
    assert (res["matched"], res["matched_records"], res["unknown_record_keys"]) == (1, 3, 1)
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    for docs, words in ((tmp_path / "bad.parquet", "no content_hash, record_key, tokens or text"),
                        (tmp_path / "none", "no such corpus directory, JSON lines or Parquet")):
        with pytest.raises(TallyError, match=words):
            exposure(manifest=tmp / "m.parquet", docs=docs, runs=["r1"], out=tmp_path / "x",
                     ledger=tmp / "l.duckdb")
    r = tally_bare("exposure", "--manifest", str(tmp / "m.parquet"), "--ledger",
                   str(tmp / "l.duckdb"), "--run", "r1", "--run", "nope", "--docs",
                   str(tmp / "evalset"), "-o", str(tmp_path / "cli"))
    assert r.returncode == 2 and r.stderr.startswith("tally: error: unknown run 'nope'")
    r = tally_bare("exposure", "--manifest", str(tmp / "m.parquet"), "--spool", str(tmp / "spool"),
                   "--run", "r1", "--run", "r2", "--docs", str(tmp / "evalset"), "-o",
                   str(tmp_path / "cli"))
    assert r.returncode == 0, r.stderr
    assert "7 documents, 5 in the corpus (8 records)" in r.stdout
    assert "run r1: of the 7 documents, 5 are in the corpus and 5 of them were consumed" \
        in r.stdout
    data = json.loads((tmp_path / "cli" / "exposure.json").read_text())
    assert set(data["runs"]) == {"r1", "r2"} and data["exposure_version"] == 1


# ---- the live API: two runs of one ledger, documents posted -------------------------------------

@pytest.mark.slow
def test_api_diff_gives_the_cli_diffs_answer(grain_runs, random_ledger, tmp_path):
    from tally.api.app import create_app
    from tests.support.api import Server

    for tmp, a, b in ((grain_runs, "straight", "resumed"), (grain_runs, "straight", "inexact"),
                      (random_ledger, "r", "s")):
        with Ledger(tmp / "l.duckdb") as ledger, Server(create_app(
                ledger, manifest=tmp / "m.parquet")) as srv:
            got = srv.get(f"/v1/diff?a={a}&b={b}").json()
            assert srv.get(f"/v1/diff?a={a}&b={b}").json() == got  # cached, same version
        # Every step is compared, as the CLI compares them.
        assert got["exact"] and got["compared_through_step"] == got["a"]["last_step"] or \
            got["compared_through_step"] == got["b"]["last_step"]
        # The CLI reads a copy: DuckDB refuses, in one process, a writable open of a file while
        # a read-only instance of it is still referenced (the next case's server opens the
        # original writable; a read-only instance kept by a pending garbage collection made
        # this test flaky).
        copy = tmp_path / f"{a}-{b}.duckdb"
        shutil.copyfile(tmp / "l.duckdb", copy)
        want = full = diff(a=run_source(copy, a), b=run_source(tmp / "spool", b),
                           manifest=tmp / "m.parquet", out=tmp_path / f"{a}-{b}")
        for key in ("steps_compared", "identical_steps", "first_divergent_step",
                    "steps_same_records_other_tokens"):
            assert got[key] == want[key], (a, b, key)
        assert got["jaccard"]["mean"] == pytest.approx(want["jaccard"]["mean"])
        for key in ("records", "records_only_a", "records_only_b",
                    "exposure_difference_histogram"):
            assert got[key] == full[key], (a, b, key)
        for r in ("a", "b"):
            assert got[r]["coverage"]["seen"] == full[r]["coverage"]["seen"]
            assert got[r]["unknown_keys"] == full[r]["unknown_keys"]
        codes = [f["code"] for f in got["findings"]]
        if b == "resumed":
            assert got["status"] == "identical" and got["exact"] and codes == ["identical"]
        elif b == "inexact":
            assert got["first_divergent_step"] == RESUME and "diverged" in codes
        else:  # records seen 4+ times: the CLI's findings, with no part left uncompared
            assert "compared_in_part" not in codes and codes == [
                f["code"] for f in want["findings"]], codes
        # Series to plot: the steps compared, both runs' coverage over every step.
        assert 0 < len(got["steps_series"]["step"]) <= max(
            len(got[r]["series"]["last_step"]) for r in ("a", "b"))


def test_api_diff_and_exposure_errors(planted, grain_runs):
    from tally.api.app import create_app
    from tests.support.api import Server

    tmp, _ = grain_runs, None
    with Ledger(tmp / "l.duckdb") as ledger, Server(create_app(ledger)) as srv:
        for path, code, words in (("/v1/diff?a=straight&b=nope", 404, "unknown run 'nope'"),
                                  ("/v1/diff?a=nope&b=straight", 404, "unknown run 'nope'"),
                                  ("/v1/diff?a=straight", 422, "Field required"),
                                  ("/v1/diff?a=bad%20id&b=straight", 422, "pattern")):
            r = srv.get(path)
            assert r.status_code == code and words in r.text, (path, r.text)
        r = httpx.post(srv.url + "/v1/runs/straight/exposure", json={"content_hashes": ["1"]})
        assert r.status_code == 409 and "--manifest" in r.json()["detail"]


def test_api_exposure_gives_the_cli_exposures_answer(planted, tmp_path):
    from tally.api.app import create_app
    from tally.audit.posthoc.answers import MAX_HASHES
    from tally.audit.posthoc.exposure import exposure
    from tests.support.api import Server

    tmp, hashes = planted
    cli = exposure(manifest=tmp / "m.parquet", docs=tmp / "evalset", runs=["r2"],
                   out=tmp_path / "e", ledger=tmp / "l.duckdb")
    table = pq.read_table(tmp_path / "e" / "exposure.parquet").to_pylist()
    posted = [f"{h:#x}" for h in hashes] + [str(2**64)]
    with Ledger(tmp / "l.duckdb") as ledger, Server(create_app(
            ledger, manifest=tmp / "m.parquet")) as srv:
        url = srv.url + "/v1/runs/r2/exposure"
        got = httpx.post(url, json={"content_hashes": posted}, timeout=30).json()
        run = cli["runs"]["r2"]
        assert (got["documents"], got["matched"], got["consumed"], got["consumed_2plus"]) == (
            run["documents"] + 1, run["matched"], run["consumed"], run["consumed_2plus"])
        assert [x["content_hash"] for x in got["results"]] == \
            [f"{h:#018x}" for h in hashes] + [str(2**64)]
        for i, res in enumerate(got["results"]):
            rows = [r for r in table if r["document"] == i and r["record_key"] is not None]
            assert [x["record_key"] for x in res["records"]] == [r["record_key"] for r in rows]
            assert [x["exposures"] for x in res["records"]] == [r["exposures"] for r in rows]
            assert [x["hosts"] for x in res["records"]] == [r["hosts"] for r in rows]
        for body, code in (({"content_hashes": ["0x" + "f" * 17]}, 422),
                           ({"content_hashes": []}, 422),
                           ({"content_hashes": ["1"] * (MAX_HASHES + 1)}, 422)):
            assert httpx.post(url, json=body, timeout=30).status_code == code
        r = httpx.post(srv.url + "/v1/runs/nope/exposure", json={"content_hashes": ["1"]})
        assert r.status_code == 404 and "unknown run" in r.text


@needs_chromium
def test_dashboard_shows_two_runs_side_by_side_in_headless_chromium(grain_runs):
    import re
    import tempfile

    from tally.api.app import create_app
    from tests.support.api import Server
    tmp = grain_runs
    with Ledger(tmp / "l.duckdb") as ledger, Server(create_app(
            ledger, manifest=tmp / "m.parquet")) as srv, tempfile.TemporaryDirectory() as prof:
        out = subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={prof}", "--virtual-time-budget=10000", "--dump-dom",
             srv.url + "/?run=straight&compare=inexact"], capture_output=True, text=True,
            timeout=120)
    dom = out.stdout
    assert "straight vs inexact: different" in dom, (dom[-2000:], out.stderr[-2000:])
    assert f"first divergent step {RESUME};" in dom
    for series in ("coverage A", "coverage B", "Jaccard"):
        m = re.search(rf'<polyline points="([^"]*)"[^>]*data-series="{series}"', dom)
        assert m and len(m.group(1).split()) == STEPS, series
    bars = re.findall(r'data-series="difference" data-bin="(-?\d+)" data-value="(\d+)"', dom)
    assert sum(int(v) for _, v in bars) == 300 and "0" in dict(bars)


@pytest.mark.parametrize("dense", [0, 1000])
def test_group_comparison_matches_a_count_per_group(dense, monkeypatch):
    from collections import Counter

    from tally.audit.posthoc import multiset

    monkeypatch.setattr(multiset, "DENSE", dense)  # both ways: sorted, counted in place
    rng = np.random.default_rng(dense)
    ga, ka = rng.integers(0, 7, 500), rng.integers(0, 40, 500)
    gb, kb = rng.integers(2, 9, 400), rng.integers(0, 40, 400)
    got = multiset.compare_groups(ga, ka, gb, kb, groups=10)
    for g in range(10):
        a = Counter(k for x, k in zip(ga, ka, strict=True) if x == g)
        b = Counter(k for x, k in zip(gb, kb, strict=True) if x == g)
        want = (a.total(), b.total(), len(a), len(b), len(a.keys() & b.keys()),
                sum(abs(a[k] - b[k]) for k in a.keys() | b.keys()))
        assert tuple(int(getattr(got, f)[g]) for f in (
            "size_a", "size_b", "distinct_a", "distinct_b", "common", "l1")) == want, g


def test_same_data_in_another_order_per_window_cli_and_api(tmp_path):
    """B consumes A's steps pairwise swapped (1, 0, 3, 2, ...), epochs unknown: every window
    of 2 steps holds the same records, no step is identical."""
    from tally.api.app import create_app
    from tally.audit.hook.segments import Segments
    from tests.support.api import Server
    from tests.support.manifest import content_hash_of

    rng = np.random.default_rng(4)
    write_manifest(tmp_path / "m.parquet", 400, 0, rng)
    batches = rng.permutation(400)[:320].reshape(40, 8)
    for run, order in (("a", range(40)), ("b", [s ^ 1 for s in range(40)])):
        with LedgerWriter(tmp_path / "spool", run, host=0, host_count=1, fsync=False) as w:
            for step, src in enumerate(order):
                keys = batches[src]
                w.write_segments(step, Segments.build(
                    row=np.arange(8), record_key=keys, n_tokens=np.full(8, 5),
                    content_hash=content_hash_of(keys)))
    d = diff(a=run_source(tmp_path / "spool", "a"), b=run_source(tmp_path / "spool", "b"),
             manifest=tmp_path / "m.parquet", out=tmp_path / "d", window=2)
    assert (d["status"], d["verdict"], d["identical_steps"], d["first_divergent_step"]) == (
        "same_data_other_order", "WARN", 0, 0)
    assert d["windows"] == {"steps": 2, "count": 20, "same_multiset": 20, "other_order": 20}
    assert not d["epochs_known"] and set(d["exposure_difference_histogram"]) == {"0"}
    with Ledger(tmp_path / "l.duckdb") as ledger:
        ingest(tmp_path / "spool", ledger)
        with Server(create_app(ledger, manifest=tmp_path / "m.parquet")) as srv:
            got = srv.get("/v1/diff?a=a&b=b").json()  # 40 steps: 20 windows of 2 steps
            again = srv.get("/v1/diff?a=a&b=b&window=4").json()
            assert srv.get("/v1/diff?a=a&b=b&window=0").status_code == 422
    assert got["windows"]["steps"] == 2 and got["status"] == "same_data_other_order"
    assert [f["code"] for f in got["findings"]] == ["same_data_other_order"]
    assert again["windows"] == {"steps": 4, "count": 10, "same_multiset": 10, "other_order": 10}
