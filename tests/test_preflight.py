"""Pre-flight on real runs: real keyed loaders for the old topology, their batches through the
real writer into a spool, ingested into a real ledger, the loader states in a real orbax
checkpoint; then the shadow run of the new topology from the manifest, checked."""

import json
import time

import numpy as np
import pytest

from tally.audit.cli import main
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.preflight import record_verdict, run_preflight
from tally.pipeline.corpus import TokenSource
from tally.pipeline.loader import KeyedLoader, LoaderConfig
from tally.pipeline.shadow import ShadowSource, record_starts, shadow_run
from tally.trainer import checkpoint

STEPS = 40  # steps the old topology ran before its checkpoint


def _cfg(**kw) -> LoaderConfig:
    kw.setdefault("global_batch", 16)
    return LoaderConfig(seq_len=32, read_threads=0, read_buffer=0, seed=3, **kw)


@pytest.fixture(scope="module")
def corpus(corpora):
    # 2,048 train records: 128 steps of 16 rows an epoch.
    c = corpora.corpus(records=2089, seed=5, heldout_fraction=0.02, length_scale=0.05,
                       min_len=1, max_len=64)
    source = TokenSource(c)
    assert len(source) == 2048
    return corpora.manifest(c), source


def _old_run(tmp, source, cfg, hosts, *, steps=STEPS, unrecorded=0, checkpoint_dir=None):
    """`hosts` loaders consume `steps` steps into the ledger (plus `unrecorded` more the
    ledger never sees), then the trainer's checkpoint of all their states."""
    states = {}
    for h in range(hosts):
        loader = KeyedLoader(source, cfg, h, hosts)
        with LedgerWriter(tmp / "spool", "r", host=h, host_count=hosts, fsync=False,
                          records_per_epoch=len(source), flush_every=64,
                          checkpoint_dir=checkpoint_dir) as w:
            for step in range(steps):
                w.write_batch(step, next(loader))
        for _ in range(unrecorded):
            next(loader)
        states[str(h)] = loader.get_state()
    with Ledger(tmp / "ledger.duckdb") as ledger:
        assert not ingest(tmp / "spool", ledger).quarantined
    mngr = checkpoint.manager(tmp / "ckpt")
    checkpoint.save(mngr, steps + unrecorded, {"w": np.zeros(2, np.float32)},
                    {"mu": np.zeros(2, np.float32)},
                    {"step": steps + unrecorded, "attempt": 0, "loaders": states})
    return tmp / "ckpt"


def _preflight(tmp, manifest, new_hosts, **kw):
    return run_preflight(tmp / "ledger.duckdb", "r", manifest, tmp / "ckpt", new_hosts, **kw)


def _codes(v):
    return [f.code for f in v.findings if f.severity != "INFO"]


@pytest.mark.parametrize("packing", ["first_fit", "concat_split"])
def test_unchanged_topology_with_packing_is_safe(corpus, tmp_path, packing):
    manifest, source = corpus
    _old_run(tmp_path, source, _cfg(packing=packing), 4)
    v = _preflight(tmp_path, manifest, 4)
    assert v.status == "safe" and v.exit_code == 0 and _codes(v) == []
    n = v.numbers
    assert n["reached_epoch_end"] and n["epoch"] == 0 and n["skipped"] == 0
    assert n["repeats"] == 0 and n["duplicates"] == 0
    # Consumed + planned is the epoch, every record exactly once.
    assert n["consumed_in_epoch"] + n["planned_in_epoch"] == 2048
    assert "SAFE to resume step 40 on 4 host(s) (was 4)" in v.summary()


@pytest.mark.parametrize("old,new", [(8, 4), (4, 8)])
def test_elastic_reshard_is_safe(corpus, tmp_path, old, new):
    manifest, source = corpus
    _old_run(tmp_path, source, _cfg(elastic=True), old)
    v = _preflight(tmp_path, manifest, new)
    assert v.status == "safe", v.summary()
    n = v.numbers
    assert (n["repeats"], n["skipped"], n["duplicates"]) == (0, 0, 0)
    assert n["consumed_in_epoch"] == STEPS * 16 and n["reached_epoch_end"]


def test_naive_state_transfer_8_to_4_repeats_a_band(corpus, tmp_path):
    manifest, source = corpus
    _old_run(tmp_path, source, _cfg(fault="naive_reshard"), 8)
    v = _preflight(tmp_path, manifest, 4)
    assert v.status == "unsafe" and v.exit_code == 1
    assert _codes(v) == ["state_incompatible", "repeats"]
    # Old host h stopped at position 80 of [h::8] (global 8*80+h); new host h resumes at
    # position 80 of [h::4] (global 4*80+h): global 320..639 is read again.
    assert v.numbers["repeats"] == 320 and v.numbers["skipped"] == 0
    assert "would repeat 320 records" in v.headline()
    assert "between steps 40 and 59" in v.headline()


def test_naive_state_transfer_4_to_8_skips_a_band(corpus, tmp_path):
    manifest, source = corpus
    _old_run(tmp_path, source, _cfg(fault="naive_reshard"), 4)
    v = _preflight(tmp_path, manifest, 8)
    assert v.status == "unsafe"
    assert _codes(v) == ["state_incompatible", "skips"]
    # Old hosts stopped at global 640; new hosts resume at position 160 of [h::8]: 1280.
    assert v.numbers["skipped"] == 640 and v.numbers["repeats"] == 0
    (skip,) = [f for f in v.findings if f.code == "skips"]
    assert "would skip 640 of the 2,048 records of epoch 0" in skip.message


def test_non_elastic_state_on_another_host_count_is_refused_and_measured(corpus, tmp_path):
    manifest, source = corpus
    _old_run(tmp_path, source, _cfg(), 8)
    v = _preflight(tmp_path, manifest, 4)
    assert _codes(v) == ["state_incompatible", "repeats"]
    (f,) = [f for f in v.findings if f.code == "state_incompatible"]
    assert "saved on 8 hosts cannot be restored on 4 without the elastic iterator" in f.message
    assert "would refuse it" in f.message


@pytest.mark.parametrize("fault,codes", [
    ("per_host_seed", ["planned_twice", "repeats", "skips"]),
    ("double_slice", ["skips"]),
    ("no_sharding", ["planned_twice"]),
])
def test_loader_faults_on_an_unchanged_topology_are_unsafe(corpus, tmp_path, fault, codes):
    manifest, source = corpus
    _old_run(tmp_path, source, _cfg(fault=fault), 4)
    v = _preflight(tmp_path, manifest, 4)
    assert v.status == "unsafe" and _codes(v) == codes, v.summary()
    if fault == "no_sharding":
        (f,) = [f for f in v.findings if f.code == "planned_twice"]
        # Every host plans the whole rest of the epoch.
        assert f.numbers["on_several_hosts"] == f.numbers["records"] >= 2048 - 160


def test_changed_global_batch_is_unsafe(corpus, tmp_path):
    manifest, source = corpus
    _old_run(tmp_path, source, _cfg(elastic=True), 4)
    v = _preflight(tmp_path, manifest, 4, global_batch=32)
    assert v.status == "unsafe" and _codes(v) == ["global_batch_changed"]
    assert v.findings[0].numbers == {"before": 16, "after": 32}
    assert v.numbers["repeats"] == 0  # the elastic state still names the next record


@pytest.mark.parametrize("packing,elastic,old,new", [
    ("first_fit", False, 2, 2), ("concat_split", False, 2, 2), ("none", True, 4, 2)])
def test_shadow_plan_is_what_the_real_loaders_read_next(corpus, packing, elastic, old, new):
    manifest, source = corpus
    cfg = _cfg(packing=packing, elastic=elastic)
    states = []
    for h in range(old):
        loader = KeyedLoader(source, cfg, h, old)
        for _ in range(7):
            next(loader)
        states.append(loader.get_state())
    states = [states[h % old] for h in range(new)]
    plans, steps = shadow_run(ShadowSource.from_manifest(manifest), cfg, new, states, steps=12)
    assert steps == 12 and sum(len(p.index) for p in plans) > 12 * new
    for h, plan in enumerate(plans):
        real = KeyedLoader(source, cfg, h, new)  # the real corpus, read from its shards
        real.set_state(states[h])
        for t in range(12):
            np.testing.assert_array_equal(plan.index[plan.step == t], record_starts(next(real)))


def test_cli_exit_codes_json_and_recorded_verdicts(corpus, tmp_path, capsys, in_process):
    manifest, source = corpus
    ckpt = _old_run(tmp_path, source, _cfg(fault="naive_reshard"), 4)
    base = ["preflight", "--run", "r", "--ledger", str(tmp_path / "ledger.duckdb"),
            "--manifest", str(manifest), "--checkpoint", str(ckpt)]
    assert main(base + ["--hosts", "4"]) == 0
    said = capsys.readouterr()
    assert "SAFE to resume step 40 on 4 host(s)" in said.out
    assert "preflight r: shadow run of the loader on 4 host(s)" in said.err  # its progress
    assert main(base + ["--hosts", "4", "-q"]) == 0
    assert capsys.readouterr().err == ""
    assert main(base + ["--hosts", "8", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "unsafe" and out["numbers"]["skipped"] == 640
    assert {f["code"] for f in out["findings"]} == {"state_incompatible", "skips"}
    # A horizon short of the epoch's end cannot see the skip.
    assert main(base + ["--hosts", "8", "--horizon", "5", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["numbers"]["horizon_steps"] == 5 and out["numbers"]["skipped"] is None
    assert main(base + ["--hosts", "4", "--record"]) == 0
    assert main(base + ["--hosts", "8", "--record"]) == 1
    capsys.readouterr()
    with Ledger(tmp_path / "ledger.duckdb") as ledger:
        rows = ledger.query("SELECT status, new_hosts, forced, requested_by, verdict "
                            "FROM preflight_verdicts ORDER BY id")
        assert [(r["status"], r["new_hosts"]) for r in rows] == [("safe", 4), ("unsafe", 8)]
        assert json.loads(rows[1]["verdict"])["numbers"]["skipped"] == 640
        v = run_preflight(ledger, "r", manifest, ckpt, 8)  # an open ledger, as the API has it
        vid = record_verdict(ledger, v, forced=True, requested_by="trainer")
        assert ledger.query("SELECT forced, requested_by FROM preflight_verdicts WHERE id = ?",
                            [vid]) == [{"forced": True, "requested_by": "trainer"}]


def test_bad_or_missing_input_exits_2_with_a_message(corpus, tmp_path, capsys, in_process):
    manifest, source = corpus
    ckpt = _old_run(tmp_path, source, _cfg(), 2)
    led = str(tmp_path / "ledger.duckdb")

    def run(*args):
        argv = dict(zip(["--run", "--ledger", "--manifest", "--checkpoint", "--hosts"],
                        ["r", led, str(manifest), str(ckpt), "2"], strict=True))
        argv.update(dict(zip(args[::2], args[1::2], strict=True)))
        code = main(["preflight", *[x for kv in argv.items() for x in kv]])
        return code, capsys.readouterr().err

    code, err = run("--checkpoint", str(tmp_path / "nope"))
    assert code == 2 and f"checkpoint {tmp_path / 'nope'} is not a directory" in err
    code, err = run("--ledger", str(tmp_path / "none.duckdb"))  # after the progress line
    assert code == 2 and "Traceback" not in err and err.count("tally: error:") == 1
    assert err.splitlines()[-1] == f"tally: error: no ledger at {tmp_path / 'none.duckdb'}"
    assert "run 'other' is not in ledger" in run("--run", "other")[1]
    assert "cannot read manifest" in run("--manifest", led)[1]
    assert "--hosts must be at least 1" in run("--hosts", "0")[1]
    (tmp_path / "empty").mkdir()
    assert "no checkpoint in" in run("--checkpoint", str(tmp_path / "empty"))[1]


def test_a_ledger_behind_the_checkpoint_cannot_tell(corpus, tmp_path, capsys, in_process):
    manifest, source = corpus
    _old_run(tmp_path, source, _cfg(), 2, steps=30, unrecorded=10)
    v = _preflight(tmp_path, manifest, 2)
    assert v.status == "unknown" and v.exit_code == 2
    (f,) = v.findings
    assert f.code == "ledger_behind"
    assert "holds steps up to 29" in f.message and "ingest the spool first" in f.message


def test_config_file_gives_the_new_loader_config(corpus, tmp_path, capsys, in_process):
    manifest, source = corpus
    ckpt = _old_run(tmp_path, source, _cfg(packing="first_fit"), 2)
    base = ["preflight", "--run", "r", "--ledger", str(tmp_path / "ledger.duckdb"),
            "--manifest", str(manifest), "--checkpoint", str(ckpt), "--hosts", "2", "--json"]
    conf = tmp_path / "train.json"
    conf.write_text(json.dumps({"seq_len": 32, "global_batch": 16, "packing": "first_fit",
                                "seed": 3}))
    assert main(base + ["--config", str(conf)]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "safe"
    conf.write_text(json.dumps({"seq_len": 32, "global_batch": 16, "packing": "none",
                                "seed": 3}))
    assert main(base + ["--config", str(conf)]) == 1
    out = json.loads(capsys.readouterr().out)
    (f,) = [f for f in out["findings"] if f["code"] == "state_incompatible"]
    assert "packing was 'first_fit' when saved, is 'none' now" in f["message"]
    conf.write_text("{")
    assert main(base + ["--config", str(conf)]) == 2
    assert "cannot read config" in capsys.readouterr().err


def test_horizon_to_the_epoch_end_keeps_hosts_in_lockstep(corpus):
    manifest, source = corpus
    shadow = ShadowSource.from_manifest(manifest)
    cfg = _cfg(packing="first_fit", global_batch=8)
    plans, steps = shadow_run(shadow, cfg, 4, [None] * 4, steps=1000, until_epoch=0,
                              to_epoch_end=True)
    # Hosts finish their share of the epoch at different steps; the ones that finish first
    # are extended to the common horizon, exactly as a fixed horizon plans them.
    fixed, _ = shadow_run(shadow, cfg, 4, [None] * 4, steps=steps, until_epoch=0)
    assert len({p.passed for p in plans}) > 1 and max(p.passed for p in plans) == steps
    for a, b in zip(plans, fixed, strict=True):
        np.testing.assert_array_equal(a.step, b.step)
        np.testing.assert_array_equal(a.index, b.index)
    everything = np.concatenate([p.index for p in plans])
    assert sorted(everything[everything < 2048]) == list(range(2048))


@pytest.mark.slow
def test_the_preflight_endpoint_reads_only_checkpoints_it_may_and_bounds_its_work(corpus,
                                                                                   tmp_path):
    """A client names a path on the server: only under the checkpoint directories the service
    may read, with answers that reveal nothing of the file system, a capped horizon, a time
    box, and no work left running when the client goes away."""
    import httpx

    from tally.api.app import create_app
    from tests.support.api import Server

    manifest, source = corpus
    ckpt = _old_run(tmp_path, source, _cfg(), 4, checkpoint_dir=tmp_path / "ckpt")
    (ckpt / "junk").mkdir()
    (ckpt / "junk" / "meta").mkdir()

    def post(srv, checkpoint, timeout=60, **kw):
        return httpx.post(srv.url + "/v1/runs/r/preflight", timeout=timeout,
                          json={"checkpoint": str(checkpoint), "hosts": 8, **kw})

    with Ledger(tmp_path / "ledger.duckdb") as ledger:
        # The run's trainer recorded its checkpoint directory: that is where it may read.
        with Server(create_app(ledger, manifest=manifest)) as srv:
            ok = post(srv, ckpt)
            assert ok.status_code == 200 and ok.json()["status"] == "unsafe"
            for outside in ("/proc", "/etc/passwd", ckpt / ".." / "spool", tmp_path):
                r = post(srv, outside)
                assert r.status_code == 403, (outside, r.text)
                assert str(tmp_path) not in r.text and "/proc" not in r.text
            r = post(srv, ckpt / "nope")
            assert (r.status_code, r.json()["detail"]) == (404, "no checkpoint at that path")
            r = post(srv, ckpt / "junk")
            assert r.status_code in (404, 422) and "junk" not in r.text, r.text
            assert post(srv, ckpt, horizon=5000).status_code == 422
        # --checkpoints DIR replaces the recorded ones.
        with Server(create_app(ledger, manifest=manifest,
                               checkpoints=[str(tmp_path / "spool")])) as srv:
            assert post(srv, ckpt).status_code == 403
        # Work past the time box stops, and is not recorded.
        before = ledger.query("SELECT count(*) AS n FROM preflight_verdicts")[0]["n"]
        with Server(create_app(ledger, manifest=manifest, preflight_seconds=0.2)) as srv:
            t0 = time.monotonic()
            r = post(srv, ckpt, horizon=2000)
            assert r.status_code == 503 and "time box" in r.json()["detail"]
            assert time.monotonic() - t0 < 10
        # A client that goes away: the work stops (this process, which runs the server, goes
        # idle) and records nothing.
        with Server(create_app(ledger, manifest=manifest, preflight_seconds=600)) as srv:
            with pytest.raises(httpx.TimeoutException):
                post(srv, ckpt, horizon=2000, timeout=1.0)
            time.sleep(1.0)
            cpu = time.process_time()
            time.sleep(1.5)
            assert time.process_time() - cpu < 0.3
        after = ledger.query("SELECT count(*) AS n FROM preflight_verdicts")[0]["n"]
        assert after == before
