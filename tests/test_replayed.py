"""Every answer says when a run's consumption was replayed (`tally replay`: written from the
loader's contract, not recorded while the run trained). Three runs of the same keys in one
spool: `live` (the real writer), `rep` (files published as `tally replay` publishes them:
`tally.replayed = 1`, writer_version `tally-replay/1`) and `mix` (attempt 0 replayed, attempt 1
resumed live), ingested by `tally ingest`. Reconcile from the ledger says what reconcile from
the spool says; the live API's run list, run summary (per attempt), diff and exposure answers
and the dashboard say it; `tally diff` (either source) and `tally exposure` (either source)
say it per run. The rule has one home (tally.audit.hook.spool): these tests only use its constants
to write the files."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tally.audit.core.schema import SEGMENT_SCHEMA
from tally.audit.hook import spool as sp
from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter, publish
from tally.pipeline.replay import WRITER_VERSION
from tests.support import ROOT
from tests.support.cli import tally_bare
from tests.support.manifest import CODE_EVERY_THIRD, content_hash_of, keyed_manifest

N, HELDOUT, HOSTS, ROWS, STEPS = 240, 10, 2, 4, 20  # one epoch in 30 steps
RESUME = 12  # `mix`: attempt 1 resumes live from here
RUNS = ("live", "rep", "mix")


def _manifest(path: Path) -> Path:
    return keyed_manifest(path, N, HELDOUT, hashes=content_hash_of, tokens=32,
                          domains=CODE_EVERY_THIRD, fingerprint="feed")


def _keys(step: int, host: int) -> np.ndarray:
    """One shuffle of the epoch, sliced per host: every run consumes these."""
    order = np.random.default_rng(7).permutation(N)
    at = (step * HOSTS + host) * ROWS
    return order[at: at + ROWS]


def _live(spool: Path, run_id: str, steps: range, attempt: int = 0,
          resumed: int | None = None) -> None:
    for h in range(HOSTS):
        with LedgerWriter(spool, run_id, host=h, host_count=HOSTS, attempt=attempt,
                          resumed_from_step=resumed, records_per_epoch=N, fsync=False,
                          flush_every=5) as w:
            for step in steps:
                keys = _keys(step, h)
                w.write_segments(step, Segments.build(
                    row=np.arange(ROWS), record_key=keys, n_tokens=np.full(ROWS, 32),
                    content_hash=content_hash_of(keys), epoch=np.zeros(ROWS, np.int64)))


def _replayed(spool: Path, run_id: str, steps: range, per_file: int = 5) -> int:
    """Attempt 0 of every host published as `tally replay` publishes it (tally.pipeline.replay:
    its metadata, its writer version); returns the files written."""
    files = 0
    for h in range(HOSTS):
        directory = sp.host_dir(spool, run_id, 0, h)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"format_version": sp.FORMAT_VERSION, "run_id": run_id, "attempt": "0",
                "host": str(h), "host_count": str(HOSTS), "resumed_from_step": "",
                "writer_version": WRITER_VERSION, "manifest_fingerprint": "feed",
                "records_per_epoch": str(N), "checkpoint_dir": "", "replayed": "1"}
        for seq, lo in enumerate(range(steps.start, steps.stop, per_file)):
            chunk = range(lo, min(lo + per_file, steps.stop))
            keys = np.concatenate([_keys(s, h) for s in chunk])
            table = pa.Table.from_pydict({
                "step": np.repeat(np.array(chunk, np.int64), ROWS),
                "host": np.full(len(keys), h, np.int32),
                "row": np.tile(np.arange(ROWS, dtype=np.int32), len(chunk)),
                "record_key": keys.astype(np.int64), "offset": np.zeros(len(keys), np.int32),
                "n_tokens": np.full(len(keys), 32, np.int32),
                "content_hash": content_hash_of(keys), "epoch": np.zeros(len(keys), np.int32)},
                schema=SEGMENT_SCHEMA)
            publish(directory, "seg", table, {
                **meta, "kind": "seg", "rows": str(len(keys)), "first_step": str(chunk[0]),
                "last_step": str(chunk[-1])}, chunk[0], seq, fsync=False)
            files += 1
    return files


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replayed")
    spool = tmp / "spool"
    _live(spool, "live", range(STEPS))
    rep_files = _replayed(spool, "rep", range(STEPS))
    mix_files = _replayed(spool, "mix", range(STEPS))
    _live(spool, "mix", range(RESUME, STEPS + 4), attempt=1, resumed=RESUME)
    r = tally_bare("ingest", str(spool), "--ledger", str(tmp / "l.duckdb"), "-q", "--json")
    assert r.returncode == 0, r.stderr
    segs = {run: len(list((spool / run).rglob("seg-*.parquet"))) for run in RUNS}
    return {"tmp": tmp, "spool": spool, "ledger": tmp / "l.duckdb",
            "manifest": _manifest(tmp / "m.parquet"),
            # (replayed, replayed files, segment files) each run must be reported with
            "want": {"live": (False, 0, segs["live"]), "rep": (True, rep_files, segs["rep"]),
                     "mix": (False, mix_files, segs["mix"])}}


def test_the_rule_has_one_home():
    assert WRITER_VERSION == sp.REPLAY_WRITER_VERSION
    assert WRITER_VERSION.startswith(sp.REPLAY_WRITER)
    assert sp.is_replayed({"replayed": "1", "writer_version": "x"})
    assert sp.is_replayed({"tally.writer_version": WRITER_VERSION}, sp.META_PREFIX)
    assert not sp.is_replayed({"replayed": "", "writer_version": sp.WRITER_VERSION})
    assert sp.replayed_run(3, 3) and not sp.replayed_run(2, 3) and not sp.replayed_run(0, 0)


# ---- 1. reconcile: from the ledger as from the spool ----------------------------------------

@pytest.mark.slow
def test_reconcile_from_the_ledger_says_replayed_as_from_the_spool(runs, tmp_path):
    for run_id, (replayed, k, n) in runs["want"].items():
        reports = {}
        for kind in ("spool", "ledger"):
            out = tmp_path / f"{run_id}-{kind}"
            r = tally_bare("reconcile", f"--{kind}", str(runs[kind]), "--manifest",
                           str(runs["manifest"]), "--run", run_id, "-o", str(out), "-q")
            assert r.returncode in (0, 1), r.stderr
            rep = reports[kind] = json.loads((out / "report.json").read_text())
            assert (rep["replayed"], rep["replayed_files"],
                    rep["consumption"]["segment_files"]) == (replayed, k, n), (run_id, kind)
            head = r.stdout.splitlines()[0]
            page = (out / "report.html").read_text()
            if replayed:
                assert head.endswith("replayed from the loader's contract, not recorded live")
                assert 'data-replayed="true"' in page
            elif k:
                assert head.endswith(f"{k:,} of {n:,} spool files replayed"), head
                assert 'data-replayed="false"' in page and f"{k:,} of {n:,} spool files" in page
            else:
                assert "replayed" not in head and 'class="replayed"' not in page
        assert reports["ledger"]["coverage"] == reports["spool"]["coverage"]


# ---- 2. the live API and the dashboard ------------------------------------------------------

def _note(summary: dict) -> str:
    """The dashboard's replayed note for a summary, computed by the page's own function."""
    page = (ROOT / "api" / "dashboard.html").read_text()
    fn = re.search(r"^function replayedNote\(s\) \{.*?^\}", page, re.S | re.M).group(0)
    num = re.search(r"^const num = .*?;$", page, re.M).group(0)
    script = f"{num}\n{fn}\nprocess.stdout.write(replayedNote({json.dumps(summary)}));"
    r = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_live_api_and_dashboard_say_replayed(runs):
    from tally.api import models
    from tally.api.app import create_app
    from tally.audit.ledger.database import Ledger
    from tests.support.api import Server

    want = runs["want"]
    with Ledger(runs["ledger"]) as ledger, Server(create_app(
            ledger, manifest=runs["manifest"])) as srv:
        listed = srv.get("/v1/runs").json()
        assert {r["run_id"]: r["replayed"] for r in listed} == {
            run_id: w[0] for run_id, w in want.items()}
        for r in listed:
            models.RunListItem.model_validate(r)
        summaries = {}
        for run_id, (replayed, k, n) in want.items():
            s = summaries[run_id] = srv.get(f"/v1/runs/{run_id}").json()
            models.RunSummary.model_validate(s)
            assert (s["replayed"], s["replayed_files"], s["segment_files"]) == (replayed, k, n)
        assert [a["replayed"] for a in summaries["live"]["attempts"]] == [False]
        assert [a["replayed"] for a in summaries["rep"]["attempts"]] == [True]
        assert [a["replayed"] for a in summaries["mix"]["attempts"]] == [True, False]

        d = srv.get("/v1/diff?a=rep&b=live").json()
        models.Diff.model_validate(d)
        assert (d["a"]["replayed"], d["b"]["replayed"]) == (True, False)
        assert (d["a"]["replayed_files"], d["b"]["replayed_files"]) == (want["rep"][1], 0)
        assert d["status"] == "identical"  # the same keys: only the mark differs
        hashes = [f"{int(h):#x}" for h in content_hash_of(np.array([_keys(0, 0)[0]]))]
        for run_id, (replayed, _, _) in want.items():
            e = httpx.post(f"{srv.url}/v1/runs/{run_id}/exposure",
                           json={"content_hashes": hashes}, timeout=30).json()
            models.ExposureAnswer.model_validate(e)
            assert e["replayed"] is replayed and e["consumed"] == 1, run_id

        page = srv.get("/").text
        assert '<p id="replayed" class="replayed" hidden>' in page


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_dashboard_note_says_replayed(runs):
    """The run view's note, from the page's own function over the summaries served."""
    from tally.api.app import create_app
    from tally.audit.ledger.database import Ledger
    from tests.support.api import Server

    with Ledger(runs["ledger"]) as ledger, Server(create_app(ledger)) as srv:
        summaries = {run_id: srv.get(f"/v1/runs/{run_id}").json() for run_id in RUNS}
    assert _note(summaries["rep"]).startswith("Replayed: this consumption was written by "
                                              "tally replay from the loader's contract")
    k, n = runs["want"]["mix"][1:]
    assert _note(summaries["mix"]) == (f"{k} of {n} spool files were written by tally replay, "
                                       "the rest recorded live.")
    assert _note(summaries["live"]) == ""


def test_tally_ledger_names_replayed_attempts(runs):
    r = tally_bare("ledger", str(runs["ledger"]))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    at = {line.split()[1]: i for i, line in enumerate(lines) if line.startswith("run ")}
    block = {run_id: [x for x in lines[i + 1:] if x.startswith("  attempt")][:2]
             for run_id, i in at.items()}
    assert "replayed" not in " ".join(block["live"][:1])
    assert block["rep"][0].endswith("replayed (written by tally replay, not by the run)")
    assert "replayed" in block["mix"][0] and "replayed" not in block["mix"][1]


# ---- 3. tally diff, 4. tally exposure -------------------------------------------------------

@pytest.mark.parametrize("a_kind,b_kind", [("spool", "ledger"), ("ledger", "spool")])
def test_diff_says_which_run_was_replayed(runs, tmp_path, a_kind, b_kind):
    out = tmp_path / "diff"
    r = tally_bare("diff", "--manifest", str(runs["manifest"]), "-o", str(out), "-q",
                   "--a", f"{runs[a_kind]}:rep", "--b", f"{runs[b_kind]}:live")
    assert r.returncode == 0, r.stderr
    d = json.loads((out / "diff.json").read_text())
    assert d["status"] == "identical"
    rep, live = runs["want"]["rep"], runs["want"]["live"]
    assert (d["a"]["replayed"], d["a"]["replayed_files"], d["a"]["segment_files"]) == rep
    assert (d["b"]["replayed"], d["b"]["replayed_files"], d["b"]["segment_files"]) == live
    assert (d["a"]["kind"], d["b"]["kind"]) == (a_kind, b_kind)
    assert "A replayed from the loader's contract, not recorded live" in r.stdout.splitlines()[0]
    page = (out / "diff.html").read_text()
    assert '<p class="replayed" data-run="a" data-replayed="true">' in page
    assert 'data-run="b"' not in page
    assert re.search(r"<td>replayed</td><td>yes</td><td>no: recorded live</td>", page)


def test_exposure_says_which_runs_were_replayed(runs, tmp_path):
    keys = np.concatenate([_keys(s, 0) for s in range(3)])
    pq.write_table(pa.table({"content_hash": pa.array(content_hash_of(keys), pa.uint64())}),
                   tmp_path / "docs.parquet")
    results = {}
    for kind in ("spool", "ledger"):
        args = [a for run_id in RUNS for a in ("--run", run_id)]
        r = tally_bare("exposure", f"--{kind}", str(runs[kind]), "--manifest",
                       str(runs["manifest"]), "--docs", str(tmp_path / "docs.parquet"), "-o",
                       str(tmp_path / kind), *args)
        assert r.returncode == 0, r.stderr
        res = results[kind] = json.loads((tmp_path / kind / "exposure.json").read_text())
        assert {run_id: x["replayed"] for run_id, x in res["runs"].items()} == {
            run_id: w[0] for run_id, w in runs["want"].items()}, kind
        assert all(x["consumed"] == len(keys) for x in res["runs"].values())
        line = next(x for x in r.stdout.splitlines() if x.startswith("  run rep:"))
        assert line.endswith("replayed from the loader's contract, not recorded live")
        assert not any(x.startswith("  run live:") and "replayed" in x
                       for x in r.stdout.splitlines())
    assert results["spool"]["runs"] == results["ledger"]["runs"]
