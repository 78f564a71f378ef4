"""A damaged run of the record lookup index (`<ledger>.lookup/`) is never believed: bytes changed
inside a run whose header still agrees with the ledger (what a bad sector, a torn copy or a
stray write leaves) fail the run's checksum when it is mapped, and the run is rebuilt from the
ledger, so a consumed record answers through the real service as a scan of `consumption`
would, never 404 "never consumed"."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tally.api.app import create_app
from tally.audit.ledger import lookup
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.ledger.lookup import LookupIndex
from tests.support.api import Server, write_steps

N = 400


def _two_runs_on_disk(tmp_path):
    """A ledger whose index holds two runs a kind on disk (two processes' ingests: each
    writes its runs when the ledger closes), with every key of run `r` looked up by a scan."""
    spool, path = tmp_path / "spool", tmp_path / "l.duckdb"
    for part, steps in enumerate((range(0, 20), range(20, 40))):
        for h in (0, 1):
            write_steps(spool, "r", host=h, hosts=2, steps=steps, seed=10 * part + h, n=N,
                        per_step=16, flush_every=5)
        with Ledger(path) as ledger:
            ingest(spool, ledger)
    with Ledger(path) as ledger:
        found = ledger.query("SELECT DISTINCT record_key, content_hash FROM consumption "
                             "JOIN segments USING (file_id) WHERE segments.file_id <= "
                             "(SELECT min(file_id) + 3 FROM segments) ORDER BY 1")
    runs = sorted((path.parent / "l.duckdb.lookup").glob("key-*.run"))
    assert len(runs) == 2, runs
    return spool, path, runs, found


def _answer(srv: Server, key: int, content_hash: int) -> tuple:
    by_key = srv.get(f"/v1/runs/r/records/{key}")
    by_hash = srv.get("/v1/runs/r/records", params={"content_hash": f"{content_hash:#018x}"})
    return (by_key.status_code, by_key.json().get("segments_total"),
            by_hash.status_code, by_hash.json().get("segments_total"))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["one_code", "zeroed_block"])
def test_a_run_with_zeroed_bytes_is_rebuilt_and_consumed_records_answer(tmp_path, damage,
                                                                        caplog):
    spool, path, runs, found = _two_runs_on_disk(tmp_path)
    victim = runs[0]  # the older run: the one that covers the first files
    header = lookup._HEADER.itemsize
    codes = np.fromfile(victim, np.uint64, offset=header)
    # The codes zeroed: one consumed key's, or a 4 KiB block a third of the way in (header and
    # size unchanged either way). A code's key is its top 40 bits (tally.audit.ledger.lookup.top).
    if damage == "one_code":
        key = found[len(found) // 2]["record_key"]
        a = int(np.searchsorted(codes, np.uint64(lookup.top("key", key, _width(victim)))))
        b = a + 1
    else:
        a = len(codes) // 3
        b = min(a + 512, len(codes))
    hit = {int(k) for k in codes[a:b] >> np.uint64(24)}
    sample = [r for r in found if r["record_key"] in hit][:12] + found[:: len(found) // 6]
    # The answers before any damage, through the service.
    with Ledger(path) as ledger, Server(create_app(ledger)) as srv:
        want = {r["record_key"]: _answer(srv, r["record_key"], r["content_hash"])
                for r in sample}
    assert all(w[0] == 200 and w[2] == 200 for w in want.values()), want
    intact = victim.read_bytes()
    with open(victim, "r+b") as f:
        f.seek(header + 8 * a)
        f.write(b"\0" * (8 * (b - a)))
    assert victim.read_bytes() != intact and victim.stat().st_size == len(intact)

    caplog.set_level(logging.WARNING, logger="tally.lookup")
    with Ledger(path) as ledger, Server(create_app(ledger)) as srv:
        got = {r["record_key"]: _answer(srv, r["record_key"], r["content_hash"])
               for r in sample}
        assert got == want
        index = lookup.for_ledger(ledger)
        # Rebuilt, not dropped: the index still covers every file, with the same runs.
        top = ledger.query("SELECT max(file_id) AS m FROM segments")[0]["m"]
        assert index.coverage.upto == top
        assert [(r.lo, r.hi) for r in index.coverage.runs["key"]] == \
            [tuple(int(x) for x in p.stem.split("-")[1:]) for p in runs]
    said = [r.getMessage() for r in caplog.records if victim.name in r.getMessage()]
    assert said and "checksum" in said[0] and "rebuilt" in said[0], said
    assert victim.read_bytes() == intact  # rebuilt from the ledger: the same run as written
    with Ledger(path) as ledger:  # and it is believed again by the next process, silently
        caplog.clear()
        cur = ledger.cursor()
        LookupIndex.open(ledger.path, cur)
        cur.close()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _width(run_path) -> int:
    lo, hi = (int(x) for x in run_path.stem.split("-")[1:])
    return lookup._width(lo, hi)
