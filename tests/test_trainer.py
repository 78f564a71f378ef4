"""The trainer: real JAX steps on the keyed loader, audited by the ledger writer."""

import shutil

import jax.numpy as jnp
import pytest

from tally.audit.core.errors import TallyError
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.trainer.config import TrainConfig
from tally.trainer.loop import train
from tally.trainer.step import init

# Trains the model (JAX).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(corpora):
    return corpora.corpus(records=600, seed=1, length_scale=0.2, max_len=512)


def test_training_learns_and_the_ledger_holds_every_consumed_segment(corpus, tmp_path):
    cfg = TrainConfig(corpus=str(corpus), spool=str(tmp_path / "spool"), steps=30,
                      run_id="t", eval_every=15, eval_records=32)
    result = train(cfg)
    assert len(result.losses) == 30
    assert sum(result.losses[-5:]) / 5 < result.losses[0] - 0.5  # it learns
    assert sorted(result.evals) == [14, 29]
    assert result.evals[29]["heldout_loss"] < result.evals[14]["heldout_loss"]
    domains = {k for k in result.evals[29] if k.startswith("ppl/")}
    assert len(domains) >= 2
    with Ledger(tmp_path / "l.duckdb") as ledger:
        res = ingest(tmp_path / "spool", ledger)
        assert not res.quarantined
        steps = ledger.query('SELECT count(DISTINCT step) AS s, count(DISTINCT "row") AS r '
                             "FROM consumption")[0]
        assert steps == {"s": 30, "r": cfg.global_batch}
        losses = ledger.query("SELECT step, value FROM metrics WHERE name = 'train_loss' "
                              "ORDER BY step")
        assert [m["value"] for m in losses] == pytest.approx(result.losses)
        evals = ledger.query("SELECT step, name, value FROM metrics "
                             "WHERE name NOT IN ('train_loss', 'tally/finished')")
        assert {(m["step"], m["name"]): m["value"] for m in evals} == pytest.approx(
            {(s, k): v for s, ev in result.evals.items() for k, v in ev.items()})
        # The writer's finish() at the last step marks the run finished.
        assert ledger.query("SELECT step FROM metrics WHERE name = 'tally/finished'") == [
            {"step": 29}]


def test_bf16_moments_change_the_optimizer_state_dtype():
    import jax
    leaves32 = jax.tree_util.tree_leaves(init(TrainConfig(), jax.random.PRNGKey(0))[2])
    leaves16 = jax.tree_util.tree_leaves(init(TrainConfig(bf16_moments=True),
                                              jax.random.PRNGKey(0))[2])
    dtypes32 = {jnp.dtype(x.dtype) for x in leaves32 if x.ndim > 1}
    dtypes16 = {jnp.dtype(x.dtype) for x in leaves16 if x.ndim > 1}
    assert dtypes32 == {jnp.dtype(jnp.float32)}
    # First moments in bfloat16, second moments still float32 (optax's mu_dtype).
    assert dtypes16 == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}


def test_config_file_and_overrides(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"steps": 7, "d_model": 32}')
    cfg = TrainConfig.load(path, ["steps=9", "bf16_moments=true", "learning_rate=0.01"])
    assert (cfg.steps, cfg.d_model, cfg.bf16_moments, cfg.learning_rate) == (9, 32, True, 0.01)
    with pytest.raises(TallyError, match="override 'nope=1'"):
        TrainConfig.load(None, ["nope=1"])
    path.write_text('{"stepz": 1}')
    with pytest.raises(TallyError, match="unknown key 'stepz'"):
        TrainConfig.load(path)


def test_resume_from_checkpoint_replays_exactly_as_a_new_attempt(corpus, tmp_path):
    from tally.audit.reconcile import reconcile
    from tally.pipeline.manifest import build_manifest

    base = dict(corpus=str(corpus), spool=str(tmp_path / "spool"), run_id="r",
                checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=10)
    # Attempt 0 stops after step 14 and its final checkpoint (step 15) is removed, as if the
    # process had died before writing it: the last checkpoint is at step 10.
    first = train(TrainConfig(steps=15, **base))
    shutil.rmtree(tmp_path / "ckpt" / "15")
    second = train(TrainConfig(steps=20, **base), resume=True)
    assert second.steps == 10
    # The replayed steps compute the same losses: same parameters, same batches.
    assert second.losses[:5] == pytest.approx(first.losses[10:15], rel=1e-5)
    build_manifest(corpus, tmp_path / "m.parquet")
    r = reconcile(run_id="r", manifest=tmp_path / "m.parquet", out=tmp_path / "rep",
                  spool=tmp_path / "spool")
    (rs,) = [x for x in r["restarts"] if x["attempt"] == 0]
    assert (rs["rolled_back_from_step"], rs["rolled_back_steps"], rs["exact"]) == (10, 5, True)
    assert r["consumption"]["last_step"] == 19 and r["verdict"] == "PASS"
    with pytest.raises(TallyError, match="no checkpoint"):
        train(TrainConfig(steps=5, **{**base, "checkpoint_dir": str(tmp_path / "none")}),
              resume=True)


def test_compare_reports_kl_between_checkpoints(corpus, tmp_path, capsys):
    from tally.trainer.evaluate import compare

    ckpt = tmp_path / "ckpt"
    train(TrainConfig(corpus=str(corpus), spool=str(tmp_path / "spool"), steps=10,
                      checkpoint_dir=str(ckpt), checkpoint_every=5, eval_records=16))
    same = compare(ckpt / "10", ckpt)  # the directory means its latest step: the final, 10
    assert (same["step_a"], same["step_b"], same["mean_kl"]) == (10, 10, pytest.approx(0, abs=1e-6))
    apart = compare(ckpt / "5", ckpt / "10", progress=True)
    assert apart["mean_kl"] > 0.01 and apart["tokens"] > 100
    # The progress names the held-out records evaluated: up to eval_records, as the corpus has.
    assert f"compare: evaluating both models on {apart['records']} held-out records" in \
        capsys.readouterr().err
    with pytest.raises(TallyError, match="does not exist"):
        compare(tmp_path / "nope", ckpt)
