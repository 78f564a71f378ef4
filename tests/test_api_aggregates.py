"""Every aggregate-backed endpoint against one SQL query over `effective_consumption`, on a
ledger with restarts (one resumed from step 20, another from 35), files of a rolled-back attempt
arriving late, three hosts, duplicates, continuation segments and keys outside the corpus."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tally.api.app import create_app
from tally.audit.core.arrays import PAIRS_UP_TO
from tally.audit.ledger.aggregates import Aggregates
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.ledger.state import (
    COMPACT,
    NO_STEP,
    PENDING,
    HostLayout,
    RunState,
    Starts,
    _host_word,
    _slots,
    grouped,
)
from tests.support.api import Server, write_steps

N = 150  # train records; keys 150.. are outside (held out or unknown)


def oracle(cur, run_id: str, at: int | None = None) -> dict:
    """The numbers, straight from the definitions, one scan each."""
    cur.execute(f"""
        CREATE OR REPLACE TEMP VIEW eff AS SELECT c.* FROM effective_consumption c
            JOIN runs USING (run) WHERE run_id = '{run_id}';
        CREATE OR REPLACE TEMP VIEW starts AS SELECT * FROM eff WHERE "offset" = 0;
        CREATE OR REPLACE TEMP VIEW upto AS SELECT * FROM starts
            WHERE record_key < {N} {'' if at is None else f'AND step <= {at}'};
        CREATE OR REPLACE TEMP VIEW per_record AS SELECT record_key, count(*) AS e FROM upto
            GROUP BY ALL;""")

    def one(sql):
        return cur.execute(sql).fetchall()[0]

    exposures, seen = map(int, one("SELECT count(*), count(DISTINCT record_key) FROM upto"))
    h1, h2, h3 = map(int, one("""SELECT count(*) FILTER (WHERE e = 1), count(*) FILTER
        (WHERE e = 2), count(*) FILTER (WHERE e >= 3) FROM per_record"""))
    lo, hi = exposures // N, -(-exposures // N)
    excess, missing = map(int, one(f"""SELECT coalesce(sum(greatest(0, e - {hi})), 0),
        coalesce(sum(greatest(0, {lo} - e)), 0) + {(N - seen) * lo} FROM per_record"""))
    out = {"exposures": exposures, "seen": seen, "histogram": [N - seen, h1, h2, h3],
           "excess": excess, "missing": missing}
    out["steps"] = cur.execute("""
        WITH firsts AS (SELECT record_key, min(step) AS step FROM starts GROUP BY ALL)
        SELECT step, count(*), sum(n_tokens), count(*) FILTER (WHERE "offset" = 0),
               (SELECT count(*) FROM firsts f WHERE f.step = e.step)
        FROM eff e GROUP BY step ORDER BY step""").fetchall()
    out["hosts"] = cur.execute("""
        WITH seen AS (SELECT DISTINCT record_key, host FROM starts),
             multi AS (SELECT record_key FROM seen GROUP BY ALL HAVING count(*) > 1)
        SELECT e.host, count(*), sum(n_tokens), count(*) FILTER (WHERE "offset" = 0),
               (SELECT count(*) FROM seen s WHERE s.host = e.host),
               (SELECT count(*) FROM seen s JOIN multi USING (record_key) WHERE s.host = e.host)
        FROM eff e GROUP BY e.host ORDER BY e.host""").fetchall()
    out["pairs"] = {(a, b): c for a, b, c in cur.execute("""
        WITH seen AS (SELECT DISTINCT record_key, host FROM starts)
        SELECT x.host, y.host, count(*) FROM seen x JOIN seen y USING (record_key)
        GROUP BY ALL""").fetchall()}
    out["epoch_duplicates"], out["epoch_duplicate_records"] = map(int, one("""
        SELECT coalesce(sum(c - 1), 0), count(DISTINCT record_key) FROM (SELECT record_key,
        epoch, count(*) AS c FROM starts WHERE epoch >= 0 GROUP BY ALL HAVING count(*) > 1)"""))
    out["multi_host_records"] = int(one("""SELECT count(*) FROM (SELECT record_key FROM starts
        GROUP BY ALL HAVING count(DISTINCT host) > 1)""")[0])
    return out


def check(srv: Server, ledger: Ledger, run_id: str, base: int = 0) -> None:
    """`base`: the run's first step (steps are int64: a run may start anywhere)."""
    cur = ledger.cursor()
    try:
        full = oracle(cur, run_id)
        last = full["steps"][-1][0]
        for at in (None, *(base + s for s in (3, 19, 20, 27, 36)), last):
            want = oracle(cur, run_id, at) if at is not None else full
            got = srv.get(f"/v1/runs/{run_id}/coverage" + ("" if at is None else f"?step={at}"))
            assert got.status_code == 200, got.text
            c = got.json()
            assert (c["exposures"], c["seen"]) == (want["exposures"], want["seen"]), at
            assert [c["histogram"][b] for b in ("0", "1", "2", "3+")] == want["histogram"], at
            assert c["coverage"] == pytest.approx(want["seen"] / N)
            assert c["ideal"]["coverage"] == pytest.approx(min(1, want["exposures"] / N))
            if at is None or at == last:
                assert (c["excess_exposures"], c["missing_exposures"]) == (
                    want["excess"], want["missing"])
        series = srv.get(f"/v1/runs/{run_id}/steps?bucket=1").json()
        got = list(zip(series["step"], series["segments"], series["tokens"],
                       series["exposures"], series["new_unique"], strict=True))
        assert got == [tuple(map(int, r)) for r in full["steps"]]
        assert series["cumulative_unique"][-1] == sum(r[4] for r in full["steps"])
        # Bucketed over a sub-range: sums of the per-step rows, coverage from the start.
        lo, hi = base + 5, base + 33
        b = srv.get(f"/v1/runs/{run_id}/steps?start={lo}&end={hi}&bucket=7").json()
        rows = [r for r in full["steps"] if lo <= r[0] <= hi]
        assert b["step"] == list(range(lo, min(hi, last) + 1, 7))
        for i, s0 in enumerate(b["step"]):
            part = [r for r in rows if s0 <= r[0] < s0 + 7]
            assert b["exposures"][i] == sum(r[3] for r in part)
            assert b["new_unique"][i] == sum(r[4] for r in part)
            assert b["repeats"][i] == b["exposures"][i] - b["new_unique"][i]
            assert b["cumulative_unique"][i] == sum(r[4] for r in full["steps"]
                                                    if r[0] < min(s0 + 7, hi + 1))
        h = srv.get(f"/v1/runs/{run_id}/hosts").json()
        got = [(p["host"], p["segments"], p["tokens"], p["exposures"], p["unique"],
                p["overlap_with_others"]) for p in h["per_host"] if p["segments"]]
        assert got == [tuple(map(int, r)) for r in full["hosts"]]
        m = h["overlap_matrix"]
        assert {(a, b): m[a][b] for a in range(len(m)) for b in range(len(m))
                if m[a][b]} == full["pairs"]
        one_host = srv.get(f"/v1/runs/{run_id}/hosts/1/steps?bucket=1").json()
        want = cur.execute(f"""SELECT step, count(*), sum(n_tokens), count(*) FILTER
            (WHERE "offset" = 0) FROM effective_consumption JOIN runs USING (run)
            WHERE run_id = '{run_id}' AND host = 1 GROUP BY step ORDER BY step""").fetchall()
        assert list(zip(one_host["step"], one_host["segments"], one_host["tokens"],
                        one_host["exposures"], strict=True)) == [tuple(map(int, r)) for r in want]
        s = srv.get(f"/v1/runs/{run_id}").json()
        for k in ("epoch_duplicates", "epoch_duplicate_records", "multi_host_records"):
            assert s[k] == full[k], k
        assert full["epoch_duplicates"] > 0 and full["multi_host_records"] > 0
        assert s["status"] == "alert"
    finally:
        cur.close()


# Steps are int64 end to end: the same run from step 0, and from just below 2^32 (its steps
# cross both 2^31 and 2^32, where an int32 or uint32 anywhere would wrap).
@pytest.mark.slow
@pytest.mark.parametrize("base", [0, 2**32 - 25])
def test_aggregate_endpoints_match_sql_over_effective_consumption(tmp_path, base):
    spool, path = tmp_path / "spool", tmp_path / "ledger.duckdb"
    common = {"n": N + 3, "flush_every": 4}  # keys N.. are outside the train universe

    def steps(a: int, b: int) -> range:
        return range(base + a, base + b)

    with Ledger(path) as ledger, Server(create_app(ledger, records=N)) as srv:
        for h in (0, 1):
            write_steps(spool, "r", host=h, hosts=3, steps=steps(0, 30), seed=h, **common)
        ingest(spool, ledger)
        check(srv, ledger, "r", base)
        # Attempt 1 resumes from step 20: attempt 0's rows at steps >= 20 leave the lineage.
        for h in (0, 1, 2):
            write_steps(spool, "r", host=h, hosts=3, steps=steps(20, 40), seed=10 + h,
                        attempt=1, resumed=base + 20, **common)
        ingest(spool, ledger)
        check(srv, ledger, "r", base)
        # Host 2's files of attempt 0 arrive late: only their steps < 20 count.
        write_steps(spool, "r", host=2, hosts=3, steps=steps(0, 30), seed=2, **common)
        ingest(spool, ledger)
        # Attempt 2 resumes from 35: attempt 1's steps >= 35 roll back, attempt 0 keeps < 20.
        for h in (0, 1, 2):
            write_steps(spool, "r", host=h, hosts=3, steps=steps(35, 45), seed=20 + h,
                        attempt=2, resumed=base + 35, **common)
        ingest(spool, ledger)
        check(srv, ledger, "r", base)
        assert ledger.query("SELECT min(step) AS s FROM consumption")[0]["s"] == base
        rolled = ledger.query("SELECT count(*) AS n FROM rolled_back_consumption")[0]["n"]
        assert rolled > 0
        state = ledger._aggregates.runs[1]
        tables = {t: ledger.query(f"SELECT * FROM {t} WHERE records <> 0 ORDER BY ALL")
                  for t in ("agg_ranks", "agg_levels", "agg_host_pairs")}
    # A new process rebuilds the same per-record state (without its snapshot: that one is
    # tests/test_snapshot.py's); wiped tables are rebuilt the same.
    with Ledger(path) as ledger:
        ledger.con.execute("DELETE FROM agg_ranks; DELETE FROM agg_levels; "
                           "DELETE FROM agg_host_pairs; DELETE FROM agg_runs")
        again = Aggregates.load(ledger, use_snapshots=False).runs[1]
        assert_same_state(state, again)
        for t, rows in tables.items():
            assert ledger.query(f"SELECT * FROM {t} WHERE records <> 0 ORDER BY ALL") == rows, t


def assert_same_state(mine: RunState, theirs: RunState) -> None:
    """Two per-record states hold the same records (the pending steps may differ: they
    depend on where each watermark stood, and the agg tables check the ranks)."""
    keys = np.arange(max(mine.size, theirs.size))
    a, b = mine.get(keys), theirs.get(keys)
    for name in ("exposures", "host_ptr", "hosts", "epoch_ptr", "epochs", "dup"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    n = min(mine.size, theirs.size)
    pending = np.uint64(PENDING << 8 * COMPACT.fields["flags"][1])  # where each watermark stood
    assert np.array_equal(mine.data[:n].view(np.uint64) & ~pending,
                          theirs.data[:n].view(np.uint64) & ~pending)
    assert (mine.levels, mine.many_hosts.keys().tolist(), mine.far_epochs.keys().tolist()) == (
        theirs.levels, theirs.many_hosts.keys().tolist(), theirs.far_epochs.keys().tolist())


def _agg_tables(ledger: Ledger) -> dict:
    """The agg tables without the rows that netted out to zero (upserts leave those)."""
    return {t: ledger.query(f"SELECT * EXCLUDE (run) FROM {t} WHERE {nz} <> 0 ORDER BY ALL")
            for t, nz in (("agg_ranks", "records"), ("agg_levels", "records"),
                          ("agg_host_pairs", "records"), ("agg_hosts", "shared"),
                          ("agg_runs", "seg_files"))}


@pytest.mark.slow
def test_one_batch_equals_one_transaction_per_file(tmp_path):
    """Every attempt, late files included, in one ingest call: in one batch (three lineage
    changes inside it), and one file per transaction; both match the SQL definitions."""
    spool = tmp_path / "spool"
    common = {"n": N + 3, "flush_every": 4}
    for h in (0, 1, 2):
        write_steps(spool, "r", host=h, hosts=3, steps=range(30), seed=h, **common)
        write_steps(spool, "r", host=h, hosts=3, steps=range(20, 40), seed=10 + h, attempt=1,
                    resumed=20, **common)
        write_steps(spool, "r", host=h, hosts=3, steps=range(35, 45), seed=20 + h, attempt=2,
                    resumed=35, **common)
    tables = []
    for batch_rows in (10**9, 1):
        with Ledger(tmp_path / f"l{batch_rows}.duckdb") as ledger:
            res = ingest(spool, ledger, batch_rows=batch_rows)
            assert res.quarantined == [] and res.files > 20
            if batch_rows > 1:
                with Server(create_app(ledger, records=N)) as srv:
                    check(srv, ledger, "r")
            tables.append(_agg_tables(ledger))
    assert tables[0] == tables[1]


def test_grouping_packed_and_wide_keys_agree():
    """Starts grouped through the packed sort and through the lexsort fallback (keys or steps
    too wide to pack) give what counting by hand gives."""
    rng = np.random.default_rng(5)
    for base_key, step_span in ((0, 50), (2**58, 50), (2**40, 2**30)):
        parts = [Starts(base_key + rng.integers(0, 40, 300), rng.integers(0, step_span, 300),
                        rng.integers(-1, 70, 300).astype(np.int32), host)
                 for host in (0, 3, 63, 64, 70)]
        got = grouped(parts).records()
        want: dict[int, list] = {}
        for p in parts:
            for k, s, e in zip(p.keys, p.steps, p.epochs, strict=True):
                w = want.setdefault(int(k), [[], set(), []])
                w[0].append(int(s))
                w[1].add(p.host)
                if e >= 0:
                    w[2].append(int(e))
        assert got.keys.tolist() == sorted(want)
        for i, k in enumerate(got.keys.tolist()):
            steps, hosts, epochs = want[k]
            first3 = (sorted(steps) + [NO_STEP] * 3)[:3]
            assert got.exposures[i] == len(steps) and got.steps[i].tolist() == first3
            h = got.hosts[got.host_ptr[i]: got.host_ptr[i + 1]].tolist()
            e = got.epochs[got.epoch_ptr[i]: got.epoch_ptr[i + 1]].tolist()
            dups = len(epochs) - len(set(epochs))
            assert (h, e, got.epoch_dups[i], got.dup[i]) == (
                sorted(hosts), sorted(set(epochs)), dups, dups > 0)


def _many_hosts_check(srv: Server, ledger: Ledger, hosts: int) -> dict:
    """/hosts and the summary's records on 2+ hosts against the SQL definitions."""
    cur = ledger.cursor()
    try:
        full = oracle(cur, "m")
    finally:
        cur.close()
    h = srv.get("/v1/runs/m/hosts").json()
    assert (h["count"], h["overlap_tracked_hosts"], len(h["per_host"])) == (hosts,) * 3
    got = [(p["host"], p["segments"], p["tokens"], p["exposures"], p["unique"],
            p["overlap_with_others"]) for p in h["per_host"] if p["segments"]]
    assert got == [tuple(map(int, r)) for r in full["hosts"]]
    m = np.array(h["overlap_matrix"])
    assert m.shape == (hosts, hosts)
    assert {(int(a), int(b)): int(m[a, b]) for a, b in zip(*np.nonzero(m), strict=True)} == \
        full["pairs"]
    assert h["overlap_pairs"] == (m.sum() - np.trace(m)) // 2
    s = srv.get("/v1/runs/m").json()
    assert s["multi_host_records"] == full["multi_host_records"] > 0
    return h


# Any host count up to 1,024: the per-record state keeps every record's hosts (two in its row,
# more in a map), so the agg tables answer /hosts and the summary at any host count.
# Few records per host; `n` keys so that records sit on a few hosts each (explicit pairs) or on
# many (the dense product): 1,024 hosts x 40 starts over 600 keys puts ~65 hosts on a record.
@pytest.mark.slow
@pytest.mark.parametrize(("hosts", "n"), [(64, 100), (128, 2000), (256, 300), (1024, 600)])
def test_hosts_exact_at_any_host_count(tmp_path, hosts, n):
    spool = tmp_path / "spool"
    # Two epochs, 53 and 54 (write_steps: epoch = step // 10): a mask of epochs above 2^53 as a
    # float64 would lose bits. Attempt 1 resumes some hosts from step 539, rolling back every
    # host's steps >= 539 of attempt 0 (their records' state is recomputed from the ledger).
    for host in range(hosts):
        write_steps(spool, "m", host=host, hosts=hosts, steps=range(530, 544), seed=host, n=n,
                    per_step=4, flush_every=14, metrics=False)  # one file a host
    for host in (0, 1, hosts // 2, hosts - 1):
        write_steps(spool, "m", host=host, hosts=hosts, steps=range(539, 546), seed=5000 + host,
                    n=n, per_step=4, flush_every=7, attempt=1, resumed=539, metrics=False)
    with Ledger(tmp_path / "ledger.duckdb") as ledger, \
            Server(create_app(ledger, records=n)) as srv:
        assert ingest(spool, ledger).quarantined == []
        h = _many_hosts_check(srv, ledger, hosts)
        # Records on a few hosts each (their host pairs summed) at 128 hosts, on many (the
        # dense product) at the other counts.
        most = ledger.query("""SELECT max(k) AS k FROM (SELECT count(DISTINCT host) AS k
            FROM effective_consumption WHERE "offset" = 0 GROUP BY record_key)""")[0]["k"]
        assert (most > PAIRS_UP_TO) == (hosts != 128), most
        # The per-record state the ingest built equals one rebuilt from the ledger.
        assert_same_state(ledger._aggregates.runs[1],
                          Aggregates.load(ledger, use_snapshots=False).runs[1])
        if hosts == 256:
            # /metrics stays readable: per-host series (one a host and family), no host pairs.
            text = srv.get("/metrics").text
            # Tally's run series (the process's and the request-latency series are the same
            # at any host count).
            samples = [ln for ln in text.splitlines() if ln.startswith("tally_")
                       and not ln.startswith("tally_http_")]
            per_host = [ln for ln in samples if 'host="' in ln]
            assert len(per_host) == 5 * hosts and len(samples) < 5 * hosts + 50
            unique = {int(re.search(r'host="(\d+)"', ln).group(1)): float(ln.split()[-1])
                      for ln in per_host if ln.startswith("tally_host_unique_records")}
            assert unique == {p["host"]: p["unique"] for p in h["per_host"]}


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "hosts"), [(1, 4), (2, 4), (3, 70)])
def test_files_in_any_order_restarts_and_reopening_match_sql(tmp_path, seed, hosts):
    """The watermark's exceptions, against the SQL definitions after every round: the spool
    files reach the ingester in random order over several rounds (a host's files out of step
    order: starts below the watermark), a restart rolls back while attempt-0 files are still
    arriving, the ledger is closed and reopened between rounds (the snapshot's pending steps
    and watermark), and the epochs cross the edge of the row's window (steps 140..: epochs
    14..21). On 4 hosts (the rows' host mask) and on 70 (two slots a row, the map beyond: the
    host pairs added and removed at 64+ hosts, aggregates._added_pairs)."""
    rng = np.random.default_rng(seed)
    stage, spool, path = tmp_path / "stage", tmp_path / "spool", tmp_path / "ledger.duckdb"
    base = 140
    # Fewer, longer files on 70 hosts (the file count drives the test's time).
    common = {"n": N + 3, "flush_every": 3 if hosts < 10 else 9, "metrics": False}
    for h in range(hosts):
        write_steps(stage, "r", host=h, hosts=hosts, steps=range(base, base + 42), seed=h,
                    **common)
        write_steps(stage, "r", host=h, hosts=hosts, steps=range(base + 24, base + 60),
                    seed=100 + h, attempt=1, resumed=base + 24, **common)
    files = sorted(p.relative_to(stage) for p in stage.rglob("*.parquet"))
    old = [f for f in files if "attempt=0" in str(f)]
    new = [f for f in files if "attempt=1" in str(f)]
    # Two thirds of attempt 0 (shuffled), then the restart mixed with the rest of attempt 0
    # (only its steps < base + 24 count).
    old = [old[i] for i in rng.permutation(len(old))]
    cut = 2 * len(old) // 3
    late = old[cut:] + new
    late = [late[i] for i in rng.permutation(len(late))]
    state = None
    for r, picked in enumerate(np.array_split(np.array(old[:cut] + late, object), 6)):
        for f in picked:
            (spool / f).parent.mkdir(parents=True, exist_ok=True)
            (stage / f).rename(spool / f)
        with Ledger(path) as ledger, Server(create_app(ledger, records=N)) as srv:
            assert ingest(spool, ledger).quarantined == []
            if r >= 2:
                check(srv, ledger, "r", base)
            state = ledger._aggregates.runs[1]
    with Ledger(path) as ledger:
        assert_same_state(state, Aggregates.load(ledger, use_snapshots=False).runs[1])


@pytest.mark.slow
def test_a_run_that_grows_to_more_hosts_keeps_its_host_sets(tmp_path):
    """A row holds a record's hosts as a mask up to 32 hosts (any number of them), in four
    one-byte slots up to 255 hosts, in two two-byte slots beyond; the hosts that do not fit
    go to the map. Attempt 0 on 4 hosts puts records on 3 and 4 hosts (the mask); attempt 1
    resumes on 40 hosts from step 20 (an elastic resize: four slots, records on 3 or 4 hosts
    kept in the row); attempt 2 on 300 hosts from step 35 (two slots: those move to the map).
    Every answer agrees with SQL after each, and the state with one rebuilt from the
    ledger."""
    spool, path = tmp_path / "spool", tmp_path / "ledger.duckdb"

    def hosts_in_row(state: RunState) -> np.ndarray:
        rows = state.data[: state.top + 1]
        if not state.hosts_in_rows.slots:
            return np.bitwise_count(_host_word(rows))
        return (_slots(rows, state.hosts_in_rows) > 0).sum(axis=1)

    with Ledger(path) as ledger, Server(create_app(ledger, records=N)) as srv:
        for h in range(4):
            write_steps(spool, "r", host=h, hosts=4, steps=range(0, 30), seed=h, n=N + 3,
                        flush_every=4)
        ingest(spool, ledger)
        state = ledger._aggregates.runs[1]
        assert state.hosts_in_rows == HostLayout(0) and not len(state.many_hosts)
        assert (hosts_in_row(state) >= 3).any()  # 3+ hosts in the row
        check(srv, ledger, "r")
        for h in range(40):
            write_steps(spool, "r", host=h, hosts=40, steps=range(20, 40), seed=50 + h,
                        attempt=1, resumed=20, per_step=2, n=2000, flush_every=10)
        ingest(spool, ledger)
        assert state.hosts_in_rows == HostLayout(4) and len(state.many_hosts) > 0
        assert (hosts_in_row(state) >= 3).any()
        check(srv, ledger, "r")
        for h in range(300):
            write_steps(spool, "r", host=h, hosts=300, steps=range(35, 41), seed=500 + h,
                        attempt=2, resumed=35, per_step=1, n=2000, flush_every=10,
                        metrics=False)
        ingest(spool, ledger)
        assert state.hosts_in_rows == HostLayout(2) and hosts_in_row(state).max() == 2
        check(srv, ledger, "r")
        assert_same_state(state, Aggregates.load(ledger, use_snapshots=False).runs[1])


def test_a_state_update_that_fails_after_its_commit_is_rebuilt_from_the_ledger(tmp_path,
                                                                                monkeypatch):
    """The per-record state is updated after the batch's COMMIT, under the readers' lock.
    When that update fails (half done), the ingest says so, the batch stays in the ledger, the
    lock is free, and the next user of the state rebuilds it from the ledger: the same as a
    state that never failed."""
    spool, path = tmp_path / "spool", tmp_path / "ledger.duckdb"
    for h in (0, 1):
        write_steps(spool, "r", host=h, hosts=2, steps=range(0, 40), seed=h, n=N,
                    flush_every=4)
    real = RunState.put_once
    calls = []

    def failing(self, q):
        calls.append(len(q))
        if len(calls) == 2:  # the second batch's update, after its COMMIT
            raise MemoryError("no memory for the state")
        return real(self, q)

    monkeypatch.setattr(RunState, "put_once", failing)
    with Ledger(path) as ledger:
        agg = Aggregates.load(ledger)
        ledger._aggregates = agg
        with pytest.raises(MemoryError, match="no memory for the state"):
            ingest(spool, ledger, batch_rows=100)  # ~8 batches of 736 rows
        assert agg.dropped and ledger._aggregates is None  # rebuilt by its next user
        assert agg.lock.acquire(timeout=5)
        agg.lock.release()
        done = ledger.query("SELECT count(*) AS n FROM segments")[0]["n"]
        assert 0 < done < 42  # the failed batch's files and those before it, not the rest
        monkeypatch.setattr(RunState, "put_once", real)
        ingest(spool, ledger)
        assert ledger.query("SELECT count(*) AS n FROM segments")[0]["n"] == 42
        state = ledger._aggregates.runs[1]
        tables = _agg_tables(ledger)
    with Ledger(path) as ledger:
        again = Aggregates.load(ledger, use_snapshots=False).runs[1]
        assert_same_state(state, again)
        assert _agg_tables(ledger) == tables
