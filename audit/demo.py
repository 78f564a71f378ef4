"""`tally demo`: two real 4-host training runs, audited live, reconciled, side by side.

On embedded defaults and a fresh machine: synthesize a small corpus, build its manifest (Beam
on FnApiRunner), start the API service on the spool (it ingests while the runs go on), then
train two runs of one epoch each with `tally train --hosts 4` machinery: one correct, one with
the per-host-seed fault (every host shuffles with its own seed, then takes its slice: the
double-sharding bug of the 7B reproduction). Both are reconciled with the Beam job; the table
compares them, every number read from the reports and the API, none from constants.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tally.audit.core.errors import TallyError
from tally.audit.reconcile.report import summary

HOSTS = 4
RUNS = (("demo-ok", ""), ("demo-per-host-seed", "per_host_seed"))
LABELS = {"demo-ok": "correct", "demo-per-host-seed": "per-host seeds"}


def run_demo(out: Path, *, records: int = 2000, keep_serving: bool = False) -> dict:
    from tally.pipeline.corpus import TokenSource
    from tally.pipeline.manifest import build_manifest
    from tally.pipeline.synth import synth_corpus
    from tally.trainer.config import TrainConfig
    from tally.trainer.launch import free_port, launch

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    corpus, manifest, spool = out / "corpus", out / "manifest.parquet", out / "spool"
    desc = synth_corpus(corpus, records=records, seed=0, length_scale=0.2, max_len=512)
    print(f"corpus: {desc['records']:,} records, {desc['tokens']:,} tokens in {corpus}")
    print(build_manifest(corpus, manifest).line())
    spool.mkdir()
    # Both runs train the same model on the same shapes: compile once, not once per host.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(out / "jax-cache"))

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "tally.audit.cli", "serve", "--spool", str(spool), "--ledger",
         str(out / "ledger.duckdb"), "--manifest", str(manifest), "--reports",
         str(out / "reports"), "--port", str(port), "--interval", "0.5"],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    try:
        _wait_for(lambda: _get(url, "/healthz"), 60, "the API service to start")
        print(f"API service: {url}/ (ingesting {spool} live)")
        n = len(TokenSource(corpus))
        global_batch = 32
        steps = n // global_batch  # one epoch: one record per row, no packing
        reports = {}
        for run_id, fault in RUNS:
            cfg = TrainConfig(run_id=run_id, corpus=str(corpus), manifest=str(manifest),
                              spool=str(spool), steps=steps, global_batch=global_batch,
                              packing="none", seq_len=128, flush_every=4,
                              # A learning rate at which the small model remembers what it
                              # saw a few steps ago: what makes repeats flatter its loss.
                              learning_rate=0.01,
                              eval_every=-(-steps // 3), eval_records=32, fault=fault)
            print(f"\ntraining {run_id}: {HOSTS} hosts, {steps} steps x {global_batch} records "
                  f"(one epoch of {n:,})" + (f", fault {fault}" if fault else ""))
            code = launch(cfg, HOSTS)
            if code:
                raise TallyError(f"training run {run_id} failed (exit status {code})")
            from tally.audit.reconcile import reconcile

            rep_dir = out / "reports" / run_id
            reports[run_id] = reconcile(run_id=run_id, manifest=manifest, out=rep_dir,
                                        spool=spool)
            print(summary(reports[run_id], rep_dir))
        published = sum(1 for _ in spool.rglob("*.parquet"))
        _wait_for(lambda: _get(url, "/healthz")["files_in_ledger"] >= published, 120,
                  "the API service to ingest every spool file")
        metrics = {r: _get(url, f"/v1/runs/{r}/metrics") for r, _ in RUNS}
        live = {r: _get(url, f"/v1/runs/{r}") for r, _ in RUNS}
        print()
        print(table(reports, metrics))
        print("Same steps, similar loss: the loss curves cannot tell these runs apart; the "
              "ledger can.")
        print("\nreports:   " + "\n           ".join(
            str(out / "reports" / r / "report.html") for r, _ in RUNS))
        print(f"dashboard: {url}/")
        if keep_serving:
            print("serving until Ctrl-C")
            server.wait()
        else:
            print(f"(the service stops with the demo; reopen it with: tally serve --ledger "
                  f"{out / 'ledger.duckdb'} --manifest {manifest} --reports {out / 'reports'})")
        return {"reports": reports, "metrics": metrics, "live": live, "url": url}
    finally:
        server.terminate()
        server.wait(30)


def table(reports: dict[str, dict], metrics: dict[str, dict]) -> str:
    runs = list(reports)
    rows: list[tuple[str, ...]] = []

    def add(label: str, fn) -> None:
        rows.append((label, *(fn(r) for r in runs)))

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    add("verdict", lambda r: reports[r]["verdict"])
    add("coverage", lambda r: pct(reports[r]["coverage"]["coverage"]))
    add("never seen", lambda r: pct(reports[r]["coverage"]["histogram_fraction"]["0"]))
    add("seen 2+", lambda r: pct(reports[r]["coverage"]["histogram_fraction"]["2"]
                                 + reports[r]["coverage"]["histogram_fraction"]["3+"]))
    add("host overlap (records x host pairs)", lambda r: f"{_overlap(reports[r]):,}")
    add("train loss, repeats vs due (nats)", lambda r: _flattered(reports[r]))
    for i, m in enumerate(metrics[runs[0]]["milestones"]):
        add(f"step {m['step']}: train / held-out loss",
            lambda r, i=i: _losses(metrics[r]["milestones"], i))
    widths = [max(len(row[c]) for row in rows + [("", *map(LABELS.get, runs))])
              for c in range(len(runs) + 1)]
    head = ("", *map(LABELS.get, runs))
    lines = ["  ".join(h.ljust(w) if c == 0 else h.rjust(w)
                       for c, (h, w) in enumerate(zip(head, widths, strict=True)))]
    lines += ["  ".join(v.ljust(w) if c == 0 else v.rjust(w)
                        for c, (v, w) in enumerate(zip(row, widths, strict=True)))
              for row in rows]
    return "\n".join(lines)


def _overlap(report: dict) -> int:
    """Records two hosts both consumed, summed over host pairs."""
    m = report["hosts"]["overlap_matrix"]
    return sum(m[i][j] for i in range(len(m)) for j in range(i + 1, len(m)))


def _flattered(report: dict) -> str:
    """How much lower repeated exposures scored than due ones (the loss test), or '-'."""
    t = (report.get("loss") or {}).get("test")
    if not t:
        return "- (no repeats)"
    return f"{-t['difference']:+.3f} (z {t['z']:.1f})"


def _losses(milestones: list[dict], i: int) -> str:
    if i >= len(milestones):
        return "-"
    m = milestones[i]
    train = "-" if m["train_loss"] is None else f"{m['train_loss']:.3f}"
    return f"{train} / {m['heldout_loss']:.3f}"


def _get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=10) as resp:
        return json.loads(resp.read())


def _wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TallyError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.3)
