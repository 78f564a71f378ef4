"""TALLY_MAX_STATE_GB bounds the per-record state of the whole process, every run together,
and so its snapshots on disk: three runs of 4 rows, each with one large key the bound allowed
on its own, left three times the bound of state and snapshots (the bound was per run)."""

from __future__ import annotations

from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.ledger.state import COMPACT
from tests.support.cli import tally
from tests.test_bad_input import _put, _segs

BOUND_GB = 0.02  # 20 MiB
BOUND = int(BOUND_GB * 2**30)
KEY = 2_000_000  # 15.3 MiB of rows: one run of it fits the bound, two do not
NO_UNIVERSE = {"records_per_epoch": ""}  # keys up to 2^40 are inside the contract
WHY = ("record_key 2,000,000 would need 15.3 MiB of live state, and the process's other runs "
       "hold 15.3 MiB: more than the 20.5 MiB this process allows in all (TALLY_MAX_STATE_GB)")


def _big(spool, run: str) -> None:
    _put(spool, run, _segs(record_key=[0, 1, 2, KEY]), meta=NO_UNIVERSE)


def _ingest(spool, path) -> dict[str, str]:
    """`tally ingest` in a process of its own: the files it quarantined, with why."""
    out = tally("ingest", spool, "--ledger", path, "-q", timeout=120,
                env={"TALLY_MAX_STATE_GB": str(BOUND_GB)})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    return {ln.split(": ", 1)[0].removeprefix("quarantined ").split("/")[0]:
            ln.split(": ", 1)[1] for ln in out.stderr.splitlines()
            if ln.startswith("quarantined ")}


def _runs(path) -> set[str]:
    with Ledger(path) as ledger:
        return {r["run_id"] for r in ledger.query(
            "SELECT DISTINCT run_id FROM consumption JOIN runs USING (run)")}


def _on_disk(path) -> int:
    state = path.parent / (path.name + ".state")
    return sum(f.stat().st_size for f in state.iterdir()) if state.exists() else 0


def test_the_bound_holds_for_the_process_and_its_snapshots_across_runs(tmp_path):
    spool, path = tmp_path / "spool", tmp_path / "ledger.duckdb"
    for run in ("a", "b", "c"):
        _big(spool, run)
    refused = _ingest(spool, path)
    kept = _runs(path)
    assert len(kept) == 1 and set(refused) == {"a", "b", "c"} - kept, refused
    for why in refused.values():
        assert why == WHY
    assert (KEY + 1) * COMPACT.itemsize <= _on_disk(path) <= BOUND  # one run's snapshot
    # A new process restores the state from its snapshot, and the bound still counts it: a
    # run with a large key is refused, one with small keys goes in.
    _big(spool, "d")
    _put(spool, "e", _segs(), meta=NO_UNIVERSE)
    assert set(_ingest(spool, path)) == {"d"}
    assert _runs(path) == kept | {"e"}
    assert _on_disk(path) <= BOUND


def test_two_ledgers_of_one_process_share_the_bound(tmp_path, monkeypatch):
    """The bound is the process's: a second ledger open in it counts the first one's state,
    until the first is closed."""
    monkeypatch.setenv("TALLY_MAX_STATE_GB", str(BOUND_GB))
    one, two = tmp_path / "one", tmp_path / "two"
    _big(one, "a")
    _big(two, "b")
    with Ledger(tmp_path / "one.duckdb") as first:
        assert ingest(one, first).quarantined == []
        with Ledger(tmp_path / "two.duckdb") as second:
            res = ingest(two, second)
            assert [why for _, why in res.quarantined] == [WHY]
            held = sum(st.data.nbytes for led in (first, second)
                       for st in led._aggregates.runs.values())
            assert held <= BOUND
    with Ledger(tmp_path / "two.duckdb") as second:  # the first ledger is closed: room again
        _big(two, "b")  # written again: a changed file is tried again
        assert ingest(two, second).files == 1
