"""The bad-input matrix: more than forty kinds of bad spool entry, side by side with a healthy
run, through the real `tally ingest` and the live service. Each is quarantined with its reason
(one line, no traceback), nothing of the healthy run is lost or counted twice, the ledger opens
afterwards, and an unchanged bad entry is not reported again."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tally.audit.hook import spool as sp
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tests.support.batches import unpacked_batch
from tests.support.cli import tally
from tests.support.processes import limited

N = 1000  # records_per_epoch of the healthy run
GOOD_ROWS = 2 * 10 * 4


def _good(spool):
    for h in range(2):
        with LedgerWriter(spool, "good", host=h, host_count=2, records_per_epoch=N,
                          flush_every=5, fsync=False) as w:
            for s in range(10):
                w.write_batch(s, unpacked_batch(s, host=h, hosts=2, n_records=N))
            w.log_metric(9, "train_loss", 1.0)


def _put(spool, run, table, *, meta=None, host=0, attempt=0, first=None, seq=0, kind="seg",
         name=None):
    """Write `table` as a spool file of run `run` with the good file's metadata, changed."""
    d = sp.host_dir(spool, run, attempt, host) if name is None or "/" not in name else spool
    d.mkdir(parents=True, exist_ok=True)
    steps = table["step"].to_numpy() if "step" in table.column_names and len(table) else [0]
    md = {"format_version": sp.FORMAT_VERSION, "run_id": run, "attempt": str(attempt),
          "host": str(host), "host_count": "2", "resumed_from_step": "",
          "writer_version": "test", "manifest_fingerprint": "", "kind": kind,
          "rows": str(len(table)), "first_step": str(int(min(steps))),
          "last_step": str(int(max(steps))), "records_per_epoch": str(N)}
    md.update(meta or {})
    first = int(md["first_step"]) if first is None else first
    path = d / (name or sp.file_name(kind, first, seq))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.replace_schema_metadata(
        {sp.META_PREFIX + k: v for k, v in md.items()}), path)
    return path


def _segs(rows=4, step=0, host=0, **cols):
    base = {"step": np.full(rows, step, np.int64), "host": np.full(rows, host, np.int32),
            "row": np.arange(rows, dtype=np.int32), "record_key": np.arange(rows, dtype=np.int64),
            "offset": np.zeros(rows, np.int32), "n_tokens": np.full(rows, 5, np.int32),
            "content_hash": np.arange(rows, dtype=np.uint64), "epoch": np.zeros(rows, np.int32)}
    base.update({k: np.asarray(v, base[k].dtype) if k in base else v for k, v in cols.items()})
    return pa.table(base, schema=sp.SEGMENT_SCHEMA)


def _matrix(spool, tmp_path) -> dict[str, str]:
    """Every bad entry: its path relative to the spool -> a part of the reason it must get."""
    want: dict[str, str] = {}
    good = sorted(sp.host_dir(spool, "good", 0, 0).glob("seg-*"))

    def bad(run, reason, table=None, **kw):
        p = _put(spool, run, _segs() if table is None else table, **kw)
        want[p.relative_to(spool).as_posix()] = reason

    def raw(rel, reason, data=b"hello"):
        p = spool / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if data is not None:
            p.write_bytes(data)
        want[rel] = reason
        return p

    # ---- not files at all, or not where files go --------------------------------------
    d = "weird/attempt=0/host=0"
    raw(f"{d}/seg-000000000000-000000.parquet", "not a regular file: a FIFO", None)
    os.mkfifo(spool / d / "seg-000000000000-000000.parquet")
    raw(f"{d}/seg-000000000001-000000.parquet", "not a regular file: a socket", None)
    with socket.socket(socket.AF_UNIX) as s:  # bound by its name relative to the directory
        cwd = os.getcwd()
        os.chdir(spool / d)
        try:
            s.bind("seg-000000000001-000000.parquet")
        finally:
            os.chdir(cwd)
    raw(f"{d}/seg-000000000002-000000.parquet", "a dangling symlink", None)
    os.symlink(tmp_path / "nowhere", spool / d / "seg-000000000002-000000.parquet")
    raw(f"{d}/seg-000000000003-000000.parquet", "a symlink loop", None)
    os.symlink("seg-000000000003-000000.parquet", spool / d / "seg-000000000003-000000.parquet")
    raw(f"{d}/seg-000000000004-000000.parquet", "a character device", None)
    os.symlink("/dev/null", spool / d / "seg-000000000004-000000.parquet")
    raw(f"{d}/seg-000000000005-000000.parquet", "a directory", None)
    os.symlink(tmp_path, spool / d / "seg-000000000005-000000.parquet")
    raw(f"{d}/notes.txt", "not a spool file name")
    raw("top-level.parquet", "not a spool file name or location")
    raw("weird/seg-000000000000-000000.parquet", "not a spool file name or location")
    raw("bad run!/attempt=0/host=0/seg-000000000000-000000.parquet", "directory names")
    raw("weird/attempt=x/host=0/seg-000000000000-000000.parquet", "directory names")
    raw("weird/attempt=0/host=0/deeper/seg-000000000000-000000.parquet", "location")
    # ---- not Parquet, or not ours ------------------------------------------------------
    raw("junk/attempt=0/host=0/seg-000000000000-000000.parquet", "unreadable Parquet footer")
    raw("empty/attempt=0/host=0/seg-000000000000-000000.parquet", "unreadable Parquet", b"")
    raw("trunc/attempt=0/host=0/seg-000000000000-000000.parquet", "unreadable Parquet",
        good[0].read_bytes()[:-100])
    flipped = bytearray(good[0].read_bytes())
    for i in range(200, 600):
        flipped[i] ^= 0xFF
    raw("flip/attempt=0/host=0/seg-000000000000-000000.parquet", "", bytes(flipped))
    bad("alien", "schema mismatch", pa.table({"step": [0], "a": [1]}))
    bad("extra", "schema mismatch", _segs().append_column("x", pa.array([1, 2, 3, 4])))
    bad("missing", "schema mismatch", _segs().drop_columns(["epoch"]))
    bad("types", "schema mismatch", _segs().set_column(0, "step", pa.array([0] * 4, pa.int32())))
    # ---- metadata that lies or is out of bounds -----------------------------------------
    p = _put(spool, "nometa", _segs())
    pq.write_table(pq.read_table(p).replace_schema_metadata({}), p)
    want[p.relative_to(spool).as_posix()] = "metadata key tally.format_version is missing"
    bad("version", "spool format version", meta={"format_version": "9"})
    bad("runid", "metadata run_id='other' but the path says 'runid'", meta={"run_id": "other"})
    bad("attempt", "metadata attempt=3 but the path says 0", meta={"attempt": "3"})
    bad("host", "metadata host=1 but the path says 0", meta={"host": "1"})
    bad("kind", "kind/first_step disagree", meta={"kind": "met"})
    bad("firststep", "kind/first_step disagree", first=7)
    bad("hc0", "host_count 0 is outside", meta={"host_count": "0"})
    bad("hcbig", "host_count 50000000 is outside 1..65,536", meta={"host_count": "50000000"})
    bad("hostout", "host 2 is outside 0..1", _segs(host=2), host=2)
    bad("fresh", "attempt 0 must not", meta={"resumed_from_step": "5"})
    bad("resumed", "attempt > 0 must say resumed_from_step", attempt=1)
    bad("notint", "metadata host_count='two' is not an integer", meta={"host_count": "two"})
    bad("rpe0", "records_per_epoch=0 is outside", meta={"records_per_epoch": "0"})
    bad("rpebig", "records_per_epoch=2199023255552 is outside",
        meta={"records_per_epoch": str(2**41)})
    bad("rows", "footer holds 4 rows, writer wrote 5", meta={"rows": "5"})
    bad("rowsbig", "rows=99999999999 is outside", meta={"rows": "99999999999"})
    bad("norows", "rows=0 is outside", _segs(rows=0), meta={"first_step": "0", "last_step": "0"})
    # ---- values -------------------------------------------------------------------------
    bad("nulls", "column record_key has nulls",
        _segs().set_column(3, "record_key", pa.array([1, None, 2, 3], pa.int64())))
    bad("steps", "steps 0..0 disagree with metadata 0..3", meta={"last_step": "3"})
    bad("negstep", "steps -1..-1 disagree with metadata 0..0", _segs(step=-1),
        meta={"first_step": "0", "last_step": "0"})
    bad("hugestep", "are outside 0..", _segs(step=2**62))
    bad("otherhost", "rows for a host other than 0", _segs(host=1))
    bad("negkey", "column record_key has values below 0", _segs(record_key=[-1, 0, 1, 2]))
    bad("keyout", "record_key 5,000 is outside the run's universe",
        _segs(record_key=[0, 1, 2, 5000]))
    bad("key2p40", "record_key 1,099,511,627,776 is beyond",
        _segs(record_key=[0, 1, 2, 2**40]), meta={"records_per_epoch": ""})
    bad("ntok0", "column n_tokens has values below 1", _segs(n_tokens=[5, 0, 5, 5]))
    bad("negoff", "column offset has values below 0", _segs(offset=[0, -3, 0, 0]))
    bad("negrow", "column row has values below 0", _segs(row=[0, -1, 2, 3]))
    bad("epochlow", "epochs -2..0 are outside", _segs(epoch=[0, -2, 0, 0]))
    bad("epochhigh", "are outside -1..", _segs(epoch=[0, 2**20, 0, 0]))
    long = pa.table({"step": pa.array([0], pa.int64()), "host": pa.array([0], pa.int32()),
                     "name": ["x" * 300], "value": [1.0]}, schema=sp.METRIC_SCHEMA)
    bad("metname", "a metric name of 300 characters", long, kind="met")
    # ---- the same consumption twice ----------------------------------------------------
    g = sp.host_dir(spool, "good", 0, 0)
    copy = g / sp.file_name("seg", 0, 7)
    shutil.copy(good[0], copy)
    want[copy.relative_to(spool).as_posix()] = "duplicate: row 0 of step 0 of host 0"
    link = g / sp.file_name("seg", 0, 8)
    shutil.copy(good[0], tmp_path / "elsewhere.parquet")
    os.symlink(tmp_path / "elsewhere.parquet", link)
    want[link.relative_to(spool).as_posix()] = "duplicate: row 0 of step 0 of host 0"
    met = sorted(g.glob("met-*"))[0]
    shutil.copy(met, g / sp.file_name("met", 9, 9))
    want[f"good/attempt=0/host=0/{sp.file_name('met', 9, 9)}"] = "duplicate: a metric at step 9"
    # ---- contradicting the ledger -------------------------------------------------------
    _put(spool, "conflict", _segs(), first=0)
    bad("conflict", "earlier files of it say", _segs(step=1), meta={"host_count": "8"}, seq=1)
    _put(spool, "fingerprint", _segs(), meta={"manifest_fingerprint": "aaa"})
    bad("fingerprint", "differs from the run's", _segs(step=1),
        meta={"manifest_fingerprint": "bbb"}, seq=1)
    # Another training's file in a host's attempt (its spool id differs): a run id reused.
    _put(spool, "reuse", _segs(), meta={"spool_id": "a" * 32})
    bad("reuse", "run id reuse reused: a file of another spool", _segs(step=1),
        meta={"spool_id": "b" * 32}, seq=1)
    return want


def test_more_than_forty_kinds_of_bad_entry_are_quarantined_each_with_its_reason(tmp_path):
    spool = tmp_path / "spool"
    _good(spool)
    want = _matrix(spool, tmp_path)
    assert len(want) >= 40
    ledger_path = tmp_path / "ledger.duckdb"
    out = tally("ingest", spool, "--ledger", ledger_path, "-q", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    lines = {ln.split(": ", 1)[0].removeprefix("quarantined "): ln.split(": ", 1)[1]
             for ln in out.stderr.splitlines() if ln.startswith("quarantined ")}
    # The flipped file may fail the footer, the schema or the data pages: any reason will do.
    flip = "flip/attempt=0/host=0/seg-000000000000-000000.parquet"
    missing = {rel: reason for rel, reason in want.items()
               if rel not in lines or reason not in lines[rel]}
    assert not missing, {rel: (reason, lines.get(rel)) for rel, reason in missing.items()}
    assert flip in lines
    with Ledger(ledger_path) as ledger:  # it opens, and holds the healthy run exactly once
        good = ledger.query("SELECT count(*) AS n FROM consumption JOIN runs USING (run) "
                            "WHERE run_id = 'good'")[0]["n"]
        assert good == GOOD_ROWS
        assert {r["path"] for r in ledger.overview()["quarantine"]} >= set(want)
        again = ingest(spool, ledger)
        assert again.quarantined == [] and again.files == 0
        # A bad file replaced by a good one is taken in.
        target = spool / "junk/attempt=0/host=0/seg-000000000000-000000.parquet"
        target.unlink()
        _put(spool, "junk", _segs())
        assert ingest(spool, ledger).files == 1


def test_a_huge_key_is_refused_before_anything_commits_and_the_ledger_still_opens(tmp_path,
                                                                                 monkeypatch):
    """What bricked ledgers before: a key 2**40 - 1 (legal by the contract, no universe said)
    would need terabytes of live state. It is quarantined by the state's memory bound, and the
    ledger opens and ingests as before."""
    spool = tmp_path / "spool"
    _good(spool)
    _put(spool, "big", _segs(record_key=[0, 1, 2, 2**40 - 1]), meta={"records_per_epoch": ""})
    monkeypatch.setenv("TALLY_MAX_STATE_GB", "1")
    with Ledger(tmp_path / "l.duckdb") as ledger:
        res = ingest(spool, ledger)
        assert [r for _, r in res.quarantined] == [
            "record_key 1,099,511,627,775 would need 8,192.0 GiB of live state, more than the "
            "1.0 GiB this process allows (TALLY_MAX_STATE_GB)"]
        assert res.rows == GOOD_ROWS + 2 * 1  # and the two metric rows
    with Ledger(tmp_path / "l.duckdb") as ledger:
        assert ledger.query("SELECT count(*) AS n FROM consumption")[0]["n"] == GOOD_ROWS
        _put(spool, "more", _segs())
        assert ingest(spool, ledger).files == 1


@pytest.mark.parametrize("n", [1, 3])
def test_a_step_split_across_files_is_not_a_duplicate(tmp_path, n):
    """A timer flush between the micro-batches of a step: the writer numbers the step's rows on,
    so the second file repeats no (step, row) and both count."""
    spool = tmp_path / "spool"
    with LedgerWriter(spool, "mb", records_per_epoch=N, flush_every=100, fsync=False) as w:
        for part in range(3):
            w.write_batch(0, unpacked_batch(part, n_records=N))
            if part < n:
                w.flush()  # what flush_seconds does between two micro-batches
    with Ledger(tmp_path / "l.duckdb") as ledger:
        res = ingest(spool, ledger)
        assert res.quarantined == [] and res.rows == 12
        rows = ledger.query('SELECT DISTINCT "row" FROM consumption ORDER BY 1')
        assert [r["row"] for r in rows] == list(range(12))


def _capped(gib: int) -> list[str]:
    """`python` with its address space capped at `gib` GiB: a structure sized by a host number
    (32 GiB at host 65,535) fails there instead of taking the machine."""
    return limited("AS", gib * 2**30)


def test_a_file_of_host_65535_goes_in_and_stops_no_other_run(tmp_path):
    """Host 65,535 of host_count 65,536 is inside the contract. A 4-row file of it made ingest
    size a 65,536 x 65,536 matrix (32 GiB): the batch failed, and nothing of any run went in
    after it. Per-host structures are sized by the hosts that exist: the file and every other
    run's files go in, in seconds and a few hundred MB."""
    spool, path = tmp_path / "spool", tmp_path / "ledger.duckdb"
    _good(spool)
    _put(spool, "wide", _segs(host=65535), host=65535, meta={"host_count": "65536"})
    # Two hosts of a sparse run share records: the host pairs span hosts 3 and 65,535.
    _put(spool, "pair", _segs(host=3), host=3, meta={"host_count": "65536"})
    _put(spool, "pair", _segs(host=65535, record_key=[2, 3, 4, 5]), host=65535,
         meta={"host_count": "65536"})
    out = tally("ingest", spool, "--ledger", path, "-q", timeout=120, python=_capped(4))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    with Ledger(path) as ledger:
        rows = {r["run_id"]: r["n"] for r in ledger.query(
            "SELECT run_id, count(*) AS n FROM consumption JOIN runs USING (run) GROUP BY 1")}
        assert rows == {"good": GOOD_ROWS, "wide": 4, "pair": 8}
        pairs = ledger.query("""SELECT a, b, records FROM agg_host_pairs JOIN runs USING (run)
            WHERE run_id = 'pair' AND records <> 0 ORDER BY a, b""")
        assert [(p["a"], p["b"], p["records"]) for p in pairs] == [
            (3, 3, 4), (3, 65535, 2), (65535, 3, 2), (65535, 65535, 4)]
        shared = ledger.query("""SELECT host, shared FROM agg_hosts JOIN runs USING (run)
            WHERE run_id = 'pair' AND shared <> 0 ORDER BY host""")
        assert [(s["host"], s["shared"]) for s in shared] == [(3, 2), (65535, 2)]
        # Files of any run arriving later go in as well.
        _put(spool, "more", _segs())
        assert ingest(spool, ledger).files == 1


@pytest.mark.slow
def test_a_run_whose_only_host_is_65535_is_answered_by_the_api_and_reconcile(tmp_path):
    """Per-host answers list the hosts that sent rows, whatever their numbers, and the overlap
    matrix follows them (row i is per_host[i]'s host): the live API (/hosts, one host's steps,
    /metrics), and reconcile from the spool and from the ledger, within 4 GiB each."""
    from tally.api.app import create_app
    from tests.support.api import Server
    from tests.support.manifest import uniform_manifest

    spool, path = tmp_path / "spool", tmp_path / "ledger.duckdb"
    for run, hosts in (("wide", (65535,)), ("pair", (3, 65535))):
        for h in hosts:  # the pair's two hosts read the same records
            with LedgerWriter(spool, run, host=h, host_count=65536, records_per_epoch=N,
                              fsync=False) as w:
                for s in range(2):
                    w.write_batch(s, unpacked_batch(s, n_records=N))
                w.finish()
    def tally_ok(*args: str) -> subprocess.CompletedProcess:
        out = tally(*args, timeout=300, python=_capped(4))
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
        return out

    tally_ok("ingest", str(spool), "--ledger", str(path), "-q")
    with Ledger(path) as ledger, Server(create_app(ledger)) as srv:
        for run, hosts in (("wide", [65535]), ("pair", [3, 65535])):
            got = srv.get(f"/v1/runs/{run}/hosts")
            assert got.status_code == 200, got.text
            h = got.json()
            assert h["count"] == 65536 and h["overlap_tracked_hosts"] == len(hosts)
            assert [p["host"] for p in h["per_host"]] == hosts
            for p in h["per_host"]:  # each host: 4 records at steps 0 and 1
                assert (p["segments"], p["exposures"], p["unique"], p["first_step"],
                        p["last_step"], p["overlap_with_others"]) == (
                    8, 8, 8, 0, 1, 8 if len(hosts) > 1 else 0)
            assert h["overlap_matrix"] == [[8] * len(hosts)] * len(hosts)
            assert h["overlap_pairs"] == (8 if len(hosts) > 1 else 0)
            steps = srv.get(f"/v1/runs/{run}/hosts/65535/steps?bucket=1").json()
            assert steps["step"] == [0, 1] and steps["exposures"] == [4, 4]
        metrics = srv.get("/metrics").text
        assert 'tally_host_unique_records{host="65535",run="wide"} 8.0' in metrics
        assert 'host="0"' not in metrics
    manifest = uniform_manifest(tmp_path / "m.parquet", N)
    for run, source, hosts in (("wide", ["--spool", str(spool)], [65535]),
                               ("pair", ["--ledger", str(path)], [3, 65535])):
        out = tmp_path / f"report-{run}"
        tally_ok("reconcile", *source, "--manifest", str(manifest), "--run", run, "-o", str(out),
                 "-q")
        r = json.loads((out / "report.json").read_text())["hosts"]
        assert r["count"] == 65536 and [p["host"] for p in r["per_host"]] == hosts
        assert [p["unique"] for p in r["per_host"]] == [8] * len(hosts)
        assert r["overlap_matrix"] == [[8] * len(hosts)] * len(hosts)
        assert pq.read_table(out / "hosts.parquet")["host"].to_pylist() == hosts
        html = (out / "report.html").read_text()
        assert 'data-hosts="65535,3"' in html if len(hosts) > 1 else "host 65535 itself" in html


@pytest.mark.slow
@pytest.mark.parametrize("declared,wrote", [(4, (0, 1, 2)), (65536, (65535,))])
def test_hosts_that_consumed_nothing_are_one_finding_per_attempt(tmp_path, declared, wrote):
    """An ended attempt whose declared hosts did not all write: one host_gap finding counting
    the silent hosts and naming the first ten. Before, each was a finding of its own: an attempt
    of 65,536 declared hosts of which one wrote, resumed once, gave 65,535 FAIL findings, a 100
    MB report.json and 1 GB of memory."""
    from tests.support.manifest import uniform_manifest

    spool = tmp_path / "spool"
    for h in wrote:  # attempt 0 dies after step 1; attempt 1 resumes on 2 hosts and finishes
        with LedgerWriter(spool, "r", host=h, host_count=declared, records_per_epoch=N,
                          fsync=False) as w:
            for s in range(2):
                w.write_batch(s, unpacked_batch(s, host=h, hosts=declared, n_records=N))
    for h in range(2):
        with LedgerWriter(spool, "r", host=h, host_count=2, attempt=1, resumed_from_step=2,
                          records_per_epoch=N, fsync=False) as w:
            for s in range(2, 4):
                w.write_batch(s, unpacked_batch(s, host=h, hosts=2, n_records=N))
            w.finish()
    manifest = uniform_manifest(tmp_path / "m.parquet", N)
    out = tally("reconcile", "--spool", spool, "--manifest", manifest, "--run", "r", "-o",
                tmp_path / "rep", "-q", timeout=300, python=_capped(4))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    report = tmp_path / "rep" / "report.json"
    assert report.stat().st_size < 1_000_000
    r = json.loads(report.read_text())
    silent = sorted(set(range(declared)) - set(wrote))
    (gap,) = [f for f in r["findings"] if f["code"] == "host_gap"]
    assert gap["numbers"] == {"hosts": len(silent), "examples": silent[:10], "first_step": 0,
                              "last_step": 1, "attempt": 0}
    assert f"{len(silent):,} host{'' if len(silent) == 1 else 's'} of attempt 0" in gap["message"]
    assert [h["host"] for h in gap["evidence"]["hosts"]] == silent[:len(gap["evidence"]["hosts"])]
    assert r["hosts"]["gaps"] == []
    assert r["hosts"]["silent_hosts"] == [{"attempt": 0, "hosts": len(silent),
                                           "examples": silent[:10], "first_step": 0,
                                           "last_step": 1, "steps": 2}]
    assert f"{len(silent):,} silent: " in (tmp_path / "rep" / "report.html").read_text()
