"""Training loss split by exposure rank: the per-segment loss column from the writer to the
ledger and the report, and the test of whether repeats flattered the loss, on runs whose
repeats score lower, score the same, or are not repeats at all (a second epoch)."""

from __future__ import annotations

import numpy as np
import pytest

from tally.audit.hook.segments import Segments, segments_from_batch
from tally.audit.hook.writer import LedgerWriter
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tally.audit.reconcile import reconcile
from tests.support.manifest import uniform_manifest

N = 2000




def _run(spool, keys_of, *, repeat_bonus: float, epochs: int = 1, seed: int = 0,
         first: int = 0):
    """4 hosts x 2 rows a step; `keys_of(h, e)` is host h's order of records in epoch e. The
    loss falls with training, and an exposure of a record seen before scores `repeat_bonus`
    lower. Held-out loss stays flat while the train loss the loop logs falls. Steps start at
    `first`."""
    rng = np.random.default_rng(seed)
    steps = N // 8
    orders = {(h, e): keys_of(h, e) for h in range(4) for e in range(epochs)}
    # Which exposures repeat a record, in step order (the order training saw them).
    seen: set[int] = set()
    again = {}
    for e in range(epochs):
        for s in range(steps):
            for h in range(4):
                keys = orders[h, e][2 * s: 2 * s + 2].tolist()
                again[h, e, s] = np.array([k in seen for k in keys])
                seen.update(keys)
    for h in range(4):
        with LedgerWriter(spool, "r", host=h, host_count=4, records_per_epoch=N,
                          fsync=False, flush_every=50) as w:
            for e in range(epochs):
                order = orders[h, e]
                for s in range(steps):
                    step = first + e * steps + s
                    keys = order[2 * s: 2 * s + 2]
                    loss = 5.0 - 0.004 * (step - first) + rng.normal(0, 0.3, 2)
                    loss -= repeat_bonus * again[h, e, s]
                    w.write_segments(step, Segments.build(
                        row=np.arange(2), record_key=keys, n_tokens=np.full(2, 10),
                        content_hash=keys.astype(np.uint64), epoch=np.full(2, e), loss=loss))
                    if h == 0 and (step - first) % 50 == 49:
                        w.log_metric(step, "heldout_loss", 5.0)
                        w.log_metric(step, "train_loss", 5.0 - 0.004 * (step - first) - 0.2 * e)
            w.finish()


def _per_host_seed(h, e):
    return np.random.default_rng(100 * e + h).permutation(N)[: N // 4]


@pytest.mark.parametrize("first", [0, 2**33])  # steps are int64: a run may start anywhere
def test_repeats_that_score_lower_flatter_the_loss_and_are_found(tmp_path, first):
    _run(tmp_path / "spool", _per_host_seed, repeat_bonus=0.4, first=first)
    r = reconcile(run_id="r", manifest=uniform_manifest(tmp_path / "m.parquet", N),
                  out=tmp_path / "rep", spool=tmp_path / "spool")
    (f,) = [f for f in r["findings"] if f["code"] == "loss_flattered"]
    assert f["severity"] == "WARN"
    assert f["numbers"]["difference"] == pytest.approx(0.4, abs=0.1)
    assert f["numbers"]["z"] >= 3 and f["numbers"]["widened_by"] > 0  # held-out flat here
    assert "train loss on repeated records is 0.3" in f["message"] or \
        "train loss on repeated records is 0.4" in f["message"]
    windows = r["loss"]["windows"]
    assert windows[0]["first_step"] == first and f["numbers"]["since_step"] >= first
    assert sum(w["excess"]["exposures"] for w in windows) == \
        r["coverage"]["epoch_duplicates"]  # one epoch: every repeat is beyond the ideal
    # The ledger holds the same losses, and a reconcile from it finds the same.
    with Ledger(tmp_path / "l.duckdb") as ledger:
        ingest(tmp_path / "spool", ledger)
        assert ledger.query("SELECT count(*) AS n FROM consumption WHERE loss IS NULL")[0][
            "n"] == 0
    again = reconcile(run_id="r", manifest=tmp_path / "m.parquet", out=tmp_path / "rep2",
                      ledger=tmp_path / "l.duckdb")
    (g,) = [x for x in again["findings"] if x["code"] == "loss_flattered"]
    assert g["numbers"] == f["numbers"]
    # The held-out milestones: read by the job from the metric files, by SQL from the ledger.
    assert len(r["loss"]["milestones"]) > 3 and all(
        m["train_loss"] is not None for m in r["loss"]["milestones"])
    assert [m["step"] for m in again["loss"]["milestones"]] == [
        m["step"] for m in r["loss"]["milestones"]]
    for m, n in zip(again["loss"]["milestones"], r["loss"]["milestones"], strict=True):
        assert (m["heldout_loss"], m["train_loss"]) == pytest.approx(
            (n["heldout_loss"], n["train_loss"]))


def test_repeats_that_score_the_same_are_not_called_flattering(tmp_path):
    _run(tmp_path / "spool", _per_host_seed, repeat_bonus=0.0)
    r = reconcile(run_id="r", manifest=uniform_manifest(tmp_path / "m.parquet", N),
                  out=tmp_path / "rep", spool=tmp_path / "spool")
    assert "loss_flattered" not in [f["code"] for f in r["findings"]]
    assert r["loss"]["test"]["z"] < 3  # the test ran, and found nothing
    assert "with_replacement" in [f["code"] for f in r["findings"]]


def test_a_second_epoch_is_no_repeat_even_when_it_scores_lower(tmp_path):
    """A correct two-epoch run: every record once per epoch; the second epoch scores lower
    (the model has seen it all) but nothing is beyond the ideal, so nothing is compared."""
    def correct(h, e):
        return np.random.default_rng(e).permutation(N)[h::4]

    _run(tmp_path / "spool", correct, repeat_bonus=0.5, epochs=2)
    r = reconcile(run_id="r", manifest=uniform_manifest(tmp_path / "m.parquet", N),
                  out=tmp_path / "rep", spool=tmp_path / "spool")
    assert r["verdict"] == "PASS", r["findings"]
    assert sum(w["excess"]["exposures"] for w in r["loss"]["windows"]) == 0
    assert r["loss"]["test"] is None


def test_segment_loss_is_the_mean_over_the_segments_own_predictions():
    tokens = np.arange(2 * 8, dtype=np.int32).reshape(2, 8)
    seg = np.array([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 2, 2]])
    key = np.array([[5, 5, 5, 6, 6, 0, 0, 0], [7, 7, 7, 7, 7, 7, 8, 8]])
    per_position = np.arange(2 * 7, dtype=np.float64).reshape(2, 7)  # predicts p + 1 from p
    s = segments_from_batch({"tokens": tokens, "tokens_segment_ids": seg, "key": key},
                            loss=per_position)
    # Row 0: record 5 at 0..2 predicts from 0 and 1; record 6 at 3..4 from 3. Row 1: record
    # 7 at 0..5 from 0..4 (7..11); record 8 at 6..7 from 6 (13).
    assert s.loss.tolist() == [0.5, 3.0, 9.0, 13.0]
    one = segments_from_batch({"tokens": tokens[:, :1], "key": np.array([3, 4])},
                              loss=np.array([2.5, 1.5]))
    assert one.loss.tolist() == [2.5, 1.5]
    with pytest.raises(ValueError, match="loss has shape"):
        segments_from_batch({"tokens": tokens, "key": key[:, 0]}, loss=np.zeros((2, 3)))
