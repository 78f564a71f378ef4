"""A run id reused after its spool was removed: a new training under an ingested run's id writes
files under the same names (other contents), then later ones. The ledger tells a different file
at an ingested path or (run, attempt, host, step) from the same file seen again: the new
training's files are quarantined with a reason naming the reuse, whether `tally ingest` or the
live service meets them, and the first training stays in the ledger exactly as it was; a copy of
an ingested file (a restored spool) is skipped. `tally train` refuses a fresh start of a run the
ledger or the service already holds, even when its spool is gone."""

from __future__ import annotations

import contextlib
import io
import shutil
import time

import pytest

from tally.api.app import create_app
from tally.audit.core.errors import TallyError
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.trainer.config import TrainConfig
from tally.trainer.launch import refuse_reuse
from tests.support.api import Server, free_port, poll, write_steps
from tests.support.cli import tally

N = 400


def _train(spool, *, seed: int, steps: range, flush_every: int = 5) -> None:
    write_steps(spool, "exp", host=0, hosts=1, steps=steps, n=N, seed=seed,
                flush_every=flush_every)


def _consumed(ledger: Ledger) -> list[tuple]:
    return [tuple(r.values()) for r in ledger.query(
        'SELECT attempt, step, host, "row", record_key, content_hash, file_id FROM consumption '
        'ORDER BY ALL')]


def _quarantined(stderr: str) -> dict[str, str]:
    return {ln.split(": ", 1)[0].removeprefix("quarantined "): ln.split(": ", 1)[1]
            for ln in stderr.splitlines() if ln.startswith("quarantined ")}


@pytest.mark.parametrize("flush_every", [5, 3])
def test_a_new_training_under_an_ingested_run_id_is_quarantined_not_mixed_in(tmp_path,
                                                                             flush_every):
    """flush_every 5: the new training's first files have the names of the old ones; 3: other
    names, at steps already ingested. Either way its later files are beyond the old run."""
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    _train(spool, seed=0, steps=range(10))
    first = tally("ingest", str(spool), "--ledger", str(path), "-q")
    assert first.returncode == 0 and not _quarantined(first.stderr), first.stderr
    with Ledger(path) as ledger:
        before = _consumed(ledger)
    shutil.copytree(spool / "exp", tmp_path / "first")
    shutil.rmtree(spool / "exp")  # the spool cleaned up after ingest
    _train(spool, seed=1, steps=range(20), flush_every=flush_every)
    new = sorted(p.relative_to(spool).as_posix() for p in (spool / "exp").rglob("*.parquet"))

    out = tally("ingest", str(spool), "--ledger", str(path), "-q")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    got = _quarantined(out.stderr)
    assert sorted(got) == new, out.stderr  # every file of the new training, none ingested
    assert all(reason.startswith("run id exp reused: ") for reason in got.values()), got
    with Ledger(path) as ledger:
        assert _consumed(ledger) == before  # the first training, exactly as it was
        assert sorted(r["path"] for r in ledger.overview()["quarantine"]) == new
    again = tally("ingest", str(spool), "--ledger", str(path), "-q")  # reported once
    assert (again.returncode, _quarantined(again.stderr)) == (0, {}), again.stderr
    # Reconcile from the ledger names the reuse, not "could not be read".
    from tally.audit.reconcile import reconcile
    from tests.support.manifest import uniform_manifest

    r = reconcile(run_id="exp", manifest=uniform_manifest(tmp_path / "m.parquet", N),
                  out=tmp_path / "rep", ledger=path)
    codes = {f["code"]: f for f in r["findings"]}
    assert codes["run_id_reused"]["numbers"] == {"files": len(new)}
    assert "come from another training" in codes["run_id_reused"]["message"]
    assert "files_unreadable" not in codes and r["consumption"]["reused_files"] == len(new)
    if flush_every == 5:  # the first training's files put back: the same files, nothing held
        shutil.rmtree(spool / "exp")
        shutil.copytree(tmp_path / "first", spool / "exp", copy_function=shutil.copyfile)
        with Ledger(path) as ledger:
            res = ingest(spool, ledger)
            assert (res.files, res.quarantined) == (0, [])
            assert _consumed(ledger) == before
            first = {p.relative_to(spool).as_posix() for p in (spool / "exp").rglob("*")}
            held = {r["path"] for r in ledger.overview()["quarantine"]}
            assert held and not held & first  # what is left: the new training's other files


def test_the_same_files_seen_again_are_skipped(tmp_path):
    """A spool restored from a copy (new modification times, same bytes) is the same files:
    skipped as already ingested, nothing quarantined, nothing counted twice."""
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    _train(spool, seed=0, steps=range(10))
    with Ledger(path) as ledger:
        assert ingest(spool, ledger).files > 0
        before = _consumed(ledger)
    saved = tmp_path / "saved"
    shutil.copytree(spool, saved, copy_function=shutil.copyfile)  # times not kept
    shutil.rmtree(spool)
    shutil.copytree(saved, spool, copy_function=shutil.copyfile)
    with Ledger(path) as ledger:
        res = ingest(spool, ledger)
        assert (res.files, res.quarantined, res.already) == (0, [], len(list(
            spool.rglob("*.parquet"))))
        assert _consumed(ledger) == before


def test_the_live_service_quarantines_a_reused_run_id(tmp_path):
    """The service lists only paths it has not ingested: the new training's files at the old
    names are never read again, and its later files, beyond the old run's steps, are told from
    a continuation by the spool id every writer puts in its files."""
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    _train(spool, seed=0, steps=range(10))
    with Ledger(path) as ledger, Server(create_app(ledger, spool=spool, records=N,
                                                   interval=0.1)) as srv:
        assert poll(lambda: srv.get("/v1/runs/exp").status_code == 200 and
                    srv.get("/v1/runs/exp").json()["last_step"] == 9)
        summary = srv.get("/v1/runs/exp").json()
        shutil.rmtree(spool / "exp")
        _train(spool, seed=1, steps=range(20))
        later = [p for p in (spool / "exp").rglob("*.parquet")
                 if int(p.name.split("-")[1]) >= 10]
        assert later
        assert poll(lambda: srv.get("/v1/runs/exp").json()["quarantined_files"]["count"]
                    >= len(later), timeout=30)
        now = srv.get("/v1/runs/exp").json()
        assert (now["last_step"], now["rows_ingested"], now["exposures"]) == \
            (summary["last_step"], summary["rows_ingested"], summary["exposures"])
        reasons = [q["reason"] for q in now["quarantined_files"]["first"]]
        assert reasons and all(r.startswith("run id exp reused: ") for r in reasons), reasons


def test_the_live_service_quarantines_a_reused_run_id_at_the_old_names_only(tmp_path,
                                                                           monkeypatch):
    """A new training no longer than the old one writes only names the service ingested
    already: its periodic full listing stats them (FULL_LISTING_S, shortened here), sees other
    files there, and ingest quarantines them. Before, the service never looked at them again:
    nothing mixed in, but nothing said so either."""
    from tally.audit.hook import spool as sp

    monkeypatch.setattr(sp, "FULL_LISTING_S", 0.5)
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    _train(spool, seed=0, steps=range(10))
    names = sorted(p.relative_to(spool).as_posix() for p in spool.rglob("*.parquet"))
    with Ledger(path) as ledger, Server(create_app(ledger, spool=spool, records=N,
                                                   interval=0.1)) as srv:
        assert poll(lambda: srv.get("/v1/runs/exp").status_code == 200 and
                    srv.get("/v1/runs/exp").json()["last_step"] == 9)
        summary = srv.get("/v1/runs/exp").json()
        shutil.rmtree(spool / "exp")
        _train(spool, seed=1, steps=range(10))
        assert sorted(p.relative_to(spool).as_posix() for p in spool.rglob("*.parquet")) == names
        assert poll(lambda: srv.get("/v1/runs/exp").json()["quarantined_files"]["count"]
                    == len(names), timeout=30)
        now = srv.get("/v1/runs/exp").json()
        assert (now["last_step"], now["rows_ingested"], now["exposures"]) == \
            (summary["last_step"], summary["rows_ingested"], summary["exposures"])
        reasons = [q["reason"] for q in now["quarantined_files"]["first"]]
        assert all(r.startswith("run id exp reused: ") for r in reasons), reasons
        rounds = srv.get("/healthz").json()
        time.sleep(1.5)  # later full listings send nothing again: no new quarantine, no error
        assert srv.get("/v1/runs/exp").json()["quarantined_files"]["count"] == len(names)
        assert srv.get("/healthz").json()["status"] == rounds["status"] == "ok"


@pytest.mark.slow
def test_a_fresh_train_of_a_run_the_ledger_holds_is_refused_without_its_spool(tmp_path):
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    _train(spool, seed=0, steps=range(10))
    with Ledger(path) as ledger:
        ingest(spool, ledger)
    shutil.rmtree(spool / "exp")
    out = tally("train", f"spool={spool}", "run_id=exp", "steps=2", f"ledger={path}")
    assert out.returncode == 2
    assert out.stderr == (f"tally: error: run exp is already in the ledger {path} (its spool "
                          "may have been removed): resume it (--resume) or choose another run "
                          "id\n")
    assert not (spool / "exp").exists()
    # Another run id, or no ledger yet: nothing to refuse.
    refuse_reuse(TrainConfig(run_id="other", spool=str(spool), ledger=str(path)))
    refuse_reuse(TrainConfig(run_id="exp", spool=str(spool), ledger=str(tmp_path / "none")))
    # A service that cannot be reached (not up yet, down) does not stop a training: it says
    # so, and the service refuses the files of a reused run id when it ingests them.
    gone = f"http://127.0.0.1:{free_port()}"
    with contextlib.redirect_stderr(io.StringIO()) as said:
        refuse_reuse(TrainConfig(run_id="exp", spool=str(spool), api=gone))
    assert said.getvalue().startswith(f"tally: cannot ask {gone}/v1/runs/exp whether "
                                              "run exp is already in its ledger (")
    # The service that owns the ledger is asked instead (the file is locked while it runs).
    with Ledger(path) as ledger, Server(create_app(ledger)) as srv:
        with pytest.raises(TallyError, match=f"run exp is already in the ledger of {srv.url}"):
            refuse_reuse(TrainConfig(run_id="exp", spool=str(spool), api=srv.url))
        refuse_reuse(TrainConfig(run_id="other", spool=str(spool), api=srv.url))
        # Only the file given, and another process holds it: asked to name the service.
        out = tally("train", f"spool={spool}", "run_id=exp", "steps=2", f"ledger={path}")
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "cannot tell whether run exp is already in the ledger" in out.stderr
        assert "api=URL" in out.stderr


def test_a_ledger_made_before_file_identities_opens_and_ingests_on(tmp_path):
    """A ledger whose `segments` lacks the identity columns (made before them) reads as it
    did, gets them at its first writable opening, and its old rows (NULL there) are skipped
    as before while new files carry them."""
    import duckdb

    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    _train(spool, seed=0, steps=range(10))
    with Ledger(path) as ledger:
        ingest(spool, ledger)
        before = _consumed(ledger)
    con = duckdb.connect(str(path))
    for column in ("mtime_ns", "footer_hash", "spool_id"):
        con.execute(f"ALTER TABLE segments DROP COLUMN {column}")
    con.close()
    with Ledger(path, read_only=True) as ledger:
        assert _consumed(ledger) == before
    _train(spool, seed=0, steps=range(10, 20))
    with Ledger(path) as ledger:
        res = ingest(spool, ledger)
        old, new = (ledger.query(f"SELECT count(*) AS n FROM segments WHERE {where}")[0]["n"]
                    for where in ("spool_id IS NULL AND mtime_ns IS NULL",
                                  "spool_id IS NOT NULL AND mtime_ns IS NOT NULL"))
        assert (res.quarantined, res.already, res.files) == ([], old, new) and old and new
        assert _consumed(ledger)[:len(before)] == before
