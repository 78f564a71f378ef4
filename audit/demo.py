"""`tally demo`: the smallest real end-to-end path, on embedded defaults.

Synthesizes a small corpus, builds its manifest with the Beam job (FnApiRunner), and has two
hosts consume it through the keyed Grain loader (first-fit packing). Every consumed batch goes
through the real ledger writer into a spool. The hosts save their loader state at step 30 (a
checkpoint), run on to step 45 and die; attempt 1 resumes from the checkpoint. The spool is
then ingested into a DuckDB ledger and summarised (the rolled-back steps 30..44 stay in the
ledger beside their replay), and reconciled against the manifest: report.html and a verdict.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from audit.cli import format_overview
from audit.ingest import ingest
from audit.ledger import Ledger
from audit.reconcile import reconcile
from audit.report import summary
from audit.writer import LedgerWriter

HOSTS, CHECKPOINT, CRASH, STEPS = 2, 30, 45, 60


def run_demo(out: Path) -> None:
    from pipeline.corpus import TokenSource
    from pipeline.loader import KeyedLoader, LoaderConfig
    from pipeline.manifest import build_manifest
    from pipeline.synth import synth_corpus

    if out.exists():
        shutil.rmtree(out)
    corpus = out / "corpus"
    desc = synth_corpus(corpus, records=3000, seed=0, length_scale=0.25, max_len=1024)
    print(f"corpus: {desc['records']:,} records, {desc['tokens']:,} tokens in {corpus}")
    built = build_manifest(corpus, out / "manifest.parquet")
    print(built.line())

    source = TokenSource(corpus)
    cfg = LoaderConfig(seq_len=256, global_batch=16, packing="first_fit", seed=0)
    spool = out / "spool"
    checkpoint = {}
    for attempt, first, last in ((0, 0, CRASH), (1, CHECKPOINT, STEPS)):
        for host in range(HOSTS):
            loader = KeyedLoader(source, cfg, host, HOSTS)
            if attempt:
                loader.set_state(checkpoint[host])
            with LedgerWriter(spool, "demo", host=host, host_count=HOSTS, attempt=attempt,
                              resumed_from_step=first if attempt else None,
                              records_per_epoch=len(source), flush_every=10,
                              manifest_fingerprint=built.fingerprint) as writer:
                for step in range(first, last):
                    if step == CHECKPOINT and not attempt:
                        writer.flush()  # the ledger is never behind a checkpoint
                        checkpoint[host] = loader.get_state()
                    writer.write_batch(step, next(loader))
        if not attempt:
            print(f"attempt 0: hosts died at step {CRASH}; resuming from the step-{CHECKPOINT} "
                  "checkpoint")
    with Ledger(out / "ledger.duckdb") as ledger:
        print(ingest(spool, ledger).summary())
        print(format_overview(ledger.overview(), out / "ledger.duckdb"))
    report = reconcile(run_id="demo", manifest=out / "manifest.parquet", out=out / "report",
                       spool=spool)
    print(summary(report, out / "report"))
