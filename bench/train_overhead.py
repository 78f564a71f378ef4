"""Trainer overhead: step time with the ledger writer vs the same loop without it.

Same config, same corpus, same process; runs alternate (audited, bare, audited, ...) so drift
on a shared machine hits both alike. Steady-state step time excludes the first `--warmup`
steps (compilation):  (end - end of step warmup) / (steps - warmup - 1).

    python -m bench.train_overhead [--steps 150] [--repeats 3] [key=value config overrides]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from tally.pipeline.synth import synth_corpus
from tally.trainer.config import TrainConfig
from tally.trainer.loop import train


def steady_step_s(result, warmup: int) -> float:
    ends = result.step_ends
    return (result.finished - ends[warmup]) / (len(ends) - warmup - 1)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--records", type=int, default=4000)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        synth_corpus(tmp / "c", records=args.records, seed=0, length_scale=0.3, max_len=1024)
        base = TrainConfig.load(None, [f"corpus={tmp / 'c'}", f"steps={args.steps}",
                                       *args.overrides])
        times: dict[bool, list[float]] = {True: [], False: []}
        blocked, background, wall = 0.0, 0.0, 0.0
        for i in range(args.repeats):
            for audit in (True, False):
                cfg = TrainConfig(**{**base.__dict__, "spool": str(tmp / f"spool{i}"),
                                     "run_id": f"r{i}"})
                result = train(cfg, audit=audit)
                if audit:
                    blocked += result.writer_blocked_s
                    background += result.writer_background_s
                    wall += result.seconds
                times[audit].append(steady_step_s(result, args.warmup))
    audited, bare = statistics.median(times[True]), statistics.median(times[False])
    out = {"steps": args.steps, "repeats": args.repeats, "audited_ms": audited * 1e3,
           "bare_ms": bare * 1e3, "ratio": audited / bare,
           "rows": base.global_batch, "seq_len": base.seq_len,
           "audited_all_ms": [t * 1e3 for t in times[True]],
           "bare_all_ms": [t * 1e3 for t in times[False]],
           "blocked_fraction": blocked / wall,
           "background_ms_per_step": background / (args.repeats * args.steps) * 1e3}
    print(f"step time, steady state, median of {args.repeats}: with writer "
          f"{out['audited_ms']:.2f} ms, without {out['bare_ms']:.2f} ms -> ratio "
          f"{out['ratio']:.4f} ({(out['ratio'] - 1) * 100:+.2f}%)")
    print("  with writer:", ", ".join(f"{t:.2f}" for t in out["audited_all_ms"]),
          "| without:", ", ".join(f"{t:.2f}" for t in out["bare_all_ms"]))
    print(f"  training thread inside the writer: {100 * out['blocked_fraction']:.3f}% of the "
          f"audited wall time; writer thread: {out['background_ms_per_step']:.3f} ms per step "
          "(hashing and publishing, beside the step)")
    return out


if __name__ == "__main__":
    main()
