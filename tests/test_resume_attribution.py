"""Which resume a report blames: repeats and skipped records charged to the attempt whose
consumption produced them (tally.audit.reconcile.verdict), through the real `tally reconcile`
on spools written by the real LedgerWriter.

The runs read an epoch as a stream: each epoch a permutation of the N records, every step's
global batch the stream's next G positions, host h taking its B of them. A correct resume
(elastic on another host count, or on the same hosts) continues at the position the
checkpoint saved; a wrong one restarts from another position, or in another order. The
expected numbers are counted here from the keys each step was written with, not by Tally.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tests.support.manifest import uniform_manifest

N = 192  # records; global batch 12 on 2 x 6 or 3 x 4 rows


class Stream:
    """Epochs in order, each a permutation of the N records, and the (step, host, keys,
    epochs) every attempt consumed, as written."""

    def __init__(self, seed: int, epochs: int) -> None:
        rng = np.random.default_rng(seed)
        self.keys = np.concatenate([rng.permutation(N) for _ in range(epochs)])
        self.epoch = np.repeat(np.arange(epochs), N)
        self.read: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        self.rng = rng

    def attempt(self, spool: Path, attempt: int, hosts: int, first: int, steps: int,
                position: int, *, order: np.ndarray | None = None, pad_to: int = 0,
                rows: int | None = None, finish: bool = False) -> int:
        """Attempt `attempt` reads `steps` global batches from stream `position` on `hosts`
        hosts from step `first`: the stream's keys, or from `position` on those of another
        order of epoch 0; `pad_to`: each epoch padded to a multiple of it by repeating its
        first records; `rows` a host a step (a global batch of 12 by default). Returns the
        position it reached."""
        rows = rows or 12 // hosts
        batch = rows * hosts
        keys, epoch = self.keys, self.epoch
        if order is not None:
            keys = np.concatenate([self.keys[:position], order[position:]])
            epoch = np.resize(self.epoch, len(keys))
        if pad_to:
            cut = [np.r_[keys[e * N:(e + 1) * N], keys[e * N:e * N + (-N % pad_to)]]
                   for e in range(len(keys) // N)]
            keys = np.concatenate(cut)
            epoch = np.repeat(np.arange(len(cut)), [len(c) for c in cut])
        for h in range(hosts):
            with LedgerWriter(spool, "r", host=h, host_count=hosts, attempt=attempt,
                              resumed_from_step=first if attempt else None, flush_every=4,
                              fsync=False) as w:
                for s in range(first, first + steps):
                    step_at = position + (s - first) * batch
                    at, take = step_at + h * rows, rows
                    if len(keys) - step_at < batch:  # the stream's end: its rest shared
                        at, take = _share(max(0, len(keys) - step_at), hosts, h)
                        at += step_at
                    k, e = keys[at:at + take], epoch[at:at + take]
                    if not len(k):
                        continue
                    w.write_segments(s, Segments.build(
                        row=np.arange(len(k)), record_key=k, epoch=e,
                        n_tokens=np.full(len(k), 10), content_hash=k))
                    self.read.append((s, h, k, e))
                if finish:
                    w.finish()
        return position + steps * batch

    def effective(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(step, keys, epochs) of the surviving lineage: a step's last writing wins (the
        runs here roll nothing back but resume where the last one stopped)."""
        by_step: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        for s, h, k, e in self.read:
            by_step[(s, h)] = (k, e)
        return [(s, k, e) for (s, _), (k, e) in sorted(by_step.items())]

    def repeats_from(self, step: int, until: int | None = None) -> int:
        """Exposures at steps step <= s < until of records already read in their epoch."""
        seen: set[tuple[int, int]] = set()
        out = 0
        for s, keys, epochs in self.effective():
            for k, e in zip(keys.tolist(), epochs.tolist(), strict=True):
                if (k, e) in seen and s >= step and (until is None or s < until):
                    out += 1
                seen.add((k, e))
        return out

    def never_read(self, epoch: int) -> int:
        return N - len({k for _, keys, epochs in self.effective()
                        for k, e in zip(keys.tolist(), epochs.tolist(), strict=True)
                        if e == epoch})


def _share(left: int, hosts: int, h: int) -> tuple[int, int]:
    """Host h's (offset, rows) of the `left` positions at a stream's end, shared evenly."""
    sizes = [left // hosts + (j < left % hosts) for j in range(hosts)]
    return sum(sizes[:h]), sizes[h]


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    """`tally reconcile` in this process (as its supervised child runs it)."""
    monkeypatch.setenv("TALLY_SUPERVISED", "1")


def reconcile(tmp_path: Path, spool: Path) -> dict:
    from tally.audit.cli import main

    m = uniform_manifest(tmp_path / "m.parquet", N)
    out = tmp_path / f"rep-{spool.name}"
    assert main(["reconcile", "--spool", str(spool), "--manifest", str(m), "--run", "r",
                 "-o", str(out), "-q", "--json"]) in (0, 1)
    return json.loads((out / "report.json").read_text())


def by_code(r: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in r["findings"]:
        out.setdefault(f["code"], []).append(f)
    return out


def elastic_then_stale(tmp_path: Path, *, stale: bool) -> tuple[dict, Stream]:
    """Attempt 0 on 2 hosts (steps 0-5), attempt 1 resumed elastically on 3 (steps 6-9),
    attempt 2 resumed on the same 3 hosts at step 10 to the epoch's end: from the state
    attempt 1 saved (right) or, stale, restarting at position 48 of another order of the
    epoch (a state that lost its resume mode and replays another grid's order), the litdata
    run's shape."""
    st = Stream(seed=11, epochs=1)
    spool = tmp_path / ("stale" if stale else "right")
    at = st.attempt(spool, 0, 2, 0, 6, 0)
    at = st.attempt(spool, 1, 3, 6, 4, at)
    if stale:
        st.attempt(spool, 2, 3, 10, 12, 48, order=st.rng.permutation(N), finish=True)
    else:
        st.attempt(spool, 2, 3, 10, (N - at) // 12, at, finish=True)
    return reconcile(tmp_path, spool), st


def test_a_stale_same_topology_resume_after_a_clean_reshard_is_the_one_named(tmp_path):
    """The skipped records and the repeats are attempt 2's: it re-read records attempts 0
    and 1 consumed and left others unread; attempt 1's reshard repeated nothing and is
    settled as clean (it was blamed for the epoch's skipped records before)."""
    r, st = elastic_then_stale(tmp_path, stale=True)
    repeated, skipped = st.repeats_from(10), st.never_read(0)
    assert repeated > 12 and skipped > 0 and st.repeats_from(0, 10) == 0
    codes = by_code(r)
    assert r["verdict"] == "FAIL" and "reshard_band" not in codes, r["findings"]
    (band,) = codes["resume_band"]
    assert band["severity"] == "FAIL"
    assert band["numbers"] == {"attempt": 2, "step": 10, "hosts": 3, "previous_hosts": 3,
                               "repeated": repeated, "skipped": skipped}
    assert band["message"].startswith(
        f"attempt 2 resumed at step 10 on the same 3 hosts: {repeated} exposures at its "
        f"steps 10-21 repeated records already seen in their epoch")
    assert f"{skipped} records of epoch 0 skipped" in band["message"]
    (settled,) = codes["resharded"]
    assert (settled["severity"], settled["numbers"]) == ("INFO", {"attempt": 1, "step": 6})
    assert (f"nothing it consumed (steps 6-9) repeated a record, and the {skipped} records "
            "epoch 0 skipped are attempt 2's (resumed at step 10)") in settled["message"]
    assert band["evidence"]["steps"][0]["step"] >= 10


def test_the_same_run_resumed_right_passes(tmp_path):
    r, st = elastic_then_stale(tmp_path, stale=False)
    assert st.repeats_from(0) == 0 and st.never_read(0) == 0
    assert r["verdict"] == "PASS", r["findings"]
    (f,) = r["findings"]
    assert (f["severity"], f["code"]) == ("INFO", "resharded")
    assert "its epoch (0) ended with every record seen once" in f["message"]


def test_a_same_topology_resume_that_restarts_the_epoch_is_named(tmp_path):
    """No loader state restored: attempt 1 reads epoch 0 again from its start on the same
    2 hosts; the records attempt 0 read are read twice, nothing is skipped."""
    st = Stream(seed=5, epochs=1)
    spool = tmp_path / "forgot"
    st.attempt(spool, 0, 2, 0, 5, 0)
    st.attempt(spool, 1, 2, 5, N // 12, 0, finish=True)
    r = reconcile(tmp_path, spool)
    (band,) = by_code(r)["resume_band"]
    assert band["numbers"] == {"attempt": 1, "step": 5, "hosts": 2, "previous_hosts": 2,
                               "repeated": 60, "skipped": 0}
    assert st.repeats_from(5) == 60 and st.never_read(0) == 0
    assert [f["code"] for f in r["findings"] if f["severity"] != "INFO"] == ["resume_band"]


def test_a_same_topology_resume_that_jumps_ahead_is_named_by_the_records_it_skipped(
        tmp_path):
    """Epoch 0 read whole; attempt 1 resumes inside epoch 1 on the same hosts from a state
    saved two batches ahead (batches read ahead counted as consumed): epoch 1 ends with those
    24 records never read, nothing repeated; epoch 2 starts."""
    st = Stream(seed=8, epochs=3)
    spool = tmp_path / "ahead"
    at = st.attempt(spool, 0, 2, 0, 20, 0) + 24
    st.attempt(spool, 1, 2, 20, (3 * N - at) // 12, at, finish=True)
    r = reconcile(tmp_path, spool)
    assert st.repeats_from(0) == 0 and st.never_read(1) == 24 and st.never_read(0) == 0
    codes = by_code(r)
    (band,) = codes["resume_band"]
    assert band["numbers"] == {"attempt": 1, "step": 20, "hosts": 2, "previous_hosts": 2,
                               "repeated": 0, "skipped": 24}
    assert "epoch_skipped" not in codes, r["findings"]


@pytest.mark.parametrize("case", ["right", "padded"])
def test_a_correct_same_topology_resume_is_not_named(tmp_path, case):
    """Resumed where the checkpoint left off, mid epoch 1 of three, on the same 2 hosts: PASS;
    with a sampler that pads each epoch to a multiple of 34 (12 records repeated in each
    epoch's last step; the steps of epoch 1 before the resume repeat none, those after it
    do), the padding is the cause named, not the resume."""
    st = Stream(seed=3, epochs=3)
    spool = tmp_path / case
    pad = 34 if case == "padded" else 0
    length = (N + (-N % pad if pad else 0)) * 3
    at = st.attempt(spool, 0, 2, 0, 24, 0, pad_to=pad)
    st.attempt(spool, 1, 2, 24, length // 12 - 24, at, pad_to=pad, finish=True)
    r = reconcile(tmp_path, spool)
    codes = by_code(r)
    assert "resume_band" not in codes, r["findings"]
    if case == "right":
        assert r["verdict"] == "PASS" and r["findings"] == [], r["findings"]
    else:
        assert st.repeats_from(24) == 24 and st.repeats_from(17, 24) == 0
        assert list(codes) == ["padding"], r["findings"]


def test_a_clean_reshard_that_changed_the_global_batch_is_not_a_fault(tmp_path):
    """2 hosts x 6 rows, then 3 x 6 continuing at the sample position (an elastic loader
    counts samples, not steps) to the epoch's end: every record once; the reshard is settled
    and the larger batch said as its consequence, nothing failed."""
    st = Stream(seed=2, epochs=1)
    spool = tmp_path / "wider"
    at = st.attempt(spool, 0, 2, 0, 7, 0)
    st.attempt(spool, 1, 3, 7, (N - at) // 18, at, rows=6, finish=True)
    r = reconcile(tmp_path, spool)
    assert st.repeats_from(0) == 0 and st.never_read(0) == 0
    assert [(f["severity"], f["code"]) for f in r["findings"]] == [
        ("INFO", "resharded"), ("WARN", "batch_changed")], r["findings"]


# A loader that runs out of data: one epoch of N = 192 records in global batches of 10 (2 hosts
# x 5 rows), so the epoch's last batch holds 2. Attempt 0 reads 5 steps (50 records).


def test_records_lost_by_a_resume_in_an_epoch_the_loader_ran_out_of_are_the_resume(tmp_path):
    """The resume restores a position 30 records ahead of what was consumed (a shuffle
    buffer, or batches read ahead, not restored) and the loader reads on to the end of its
    data, its last batch short: the 30 are the resume's, not a batch change and not the
    loader's own (a loader that gives its remainder drops none)."""
    st = Stream(seed=4, epochs=1)
    spool = tmp_path / "ahead"
    at = st.attempt(spool, 0, 2, 0, 5, 0, rows=5)
    st.attempt(spool, 1, 2, 5, 12, at + 30, rows=5, finish=True)
    r = reconcile(tmp_path, spool)
    assert st.never_read(0) == 30 and st.repeats_from(0) == 0
    codes = by_code(r)
    assert r["verdict"] == "FAIL" and list(codes) == ["resume_band"], r["findings"]
    (f,) = codes["resume_band"]
    assert {k: f["numbers"][k] for k in ("step", "repeated", "skipped")} == {
        "step": 5, "repeated": 0, "skipped": 30}
    assert r["batch_changes"] == [] and r["epochs"][0]["complete"]


def test_a_resume_that_reads_on_to_the_data_end_in_a_short_batch_passes(tmp_path):
    st = Stream(seed=4, epochs=1)
    spool = tmp_path / "right"
    at = st.attempt(spool, 0, 2, 0, 5, 0, rows=5)
    st.attempt(spool, 1, 2, 5, 15, at, rows=5, finish=True)
    r = reconcile(tmp_path, spool)
    assert st.never_read(0) == 0
    assert r["verdict"] == "PASS" and r["findings"] == [], r["findings"]
    assert r["epochs"][0]["complete"] and r["epochs"][0]["skipped"] == 0


@pytest.mark.parametrize("ahead", [0, 30])
def test_a_run_its_budget_stopped_inside_the_epoch_is_not_charged(tmp_path, ahead):
    """The same runs stopped by their step budget (the last step full): the loader did not
    run out, so the records not read are the epoch's rest, said, not flagged."""
    st = Stream(seed=4, epochs=1)
    spool = tmp_path / f"budget{ahead}"
    at = st.attempt(spool, 0, 2, 0, 5, 0, rows=5)
    st.attempt(spool, 1, 2, 5, 6, at + ahead, rows=5, finish=True)
    r = reconcile(tmp_path, spool)
    assert r["verdict"] == "PASS", r["findings"]
    assert [f["code"] for f in r["findings"]] == ["final_epoch_short"]
    assert not r["epochs"][0]["complete"]


def test_a_smaller_batch_then_a_budget_stop_is_not_the_data_end(tmp_path):
    """A resume at a smaller global batch (12 -> 8 on the same hosts) that then runs 6 steps
    and stops: its last step is as full as its batch, so its epoch is not taken as ended and
    the records after it are not called skipped; the batch change is named."""
    st = Stream(seed=4, epochs=1)
    spool = tmp_path / "smaller"
    at = st.attempt(spool, 0, 2, 0, 5, 0, rows=6)
    st.attempt(spool, 1, 2, 5, 6, at, rows=4, finish=True)
    r = reconcile(tmp_path, spool)
    codes = by_code(r)
    assert r["batch_changes"] == [{"step": 5, "before": 12, "after": 8}]
    assert "batch_changed" in codes and "epoch_skipped" not in codes, r["findings"]
    assert "resume_band" not in codes and not r["epochs"][0]["complete"]


def test_batches_of_varying_rows_stopped_inside_the_epoch_are_not_a_data_end(tmp_path):
    """A loader whose global batch varies from step to step (a token budget) and a run stopped
    by its step budget on a smaller step: no batch of its own to compare with, so not taken as
    the loader running out of data; the rest of the epoch is said, not flagged."""
    keys = np.random.default_rng(5).permutation(N)
    sizes = [10, 12, 9, 11, 12, 10, 8]
    spool, at = tmp_path / "varying", 0
    with LedgerWriter(spool, "r", host=0, host_count=1, fsync=False) as w:
        for s, size in enumerate(sizes):
            k = keys[at:at + size]
            at += size
            w.write_segments(s, Segments.build(row=np.arange(size), record_key=k,
                                               epoch=np.zeros(size, np.int64),
                                               n_tokens=np.full(size, 10), content_hash=k))
        w.finish()
    r = reconcile(tmp_path, spool)
    assert r["verdict"] == "PASS", r["findings"]
    assert [f["code"] for f in r["findings"]] == ["final_epoch_short"]
    assert not r["epochs"][0]["complete"] and r["epochs"][0]["skipped"] == N - sum(sizes)
