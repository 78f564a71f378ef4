"""Reconcile on a real Dask cluster of 1, 2 and 4 worker processes, against FnApiRunner.

Builds a manifest of `--records` records and a spool of `--rows` consumption rows (8 hosts,
`--file-rows` rows a file, keys uniform; bench/reconcile_rate.py's data), then, in one run:

1. the job's own work, per stage and per element: each input file read and cut into bucket
   files (`ReadConsumption`), then each bucket joined with its manifest rows (`BucketStats`),
   called one after the other in this process without Beam, timed in thread CPU seconds. This
   is the work the workers share; a reader can extrapolate to N machines from it.
2. the reference: `reconcile()` on FnApiRunner in_memory (one process).
3. for each worker count: `dask scheduler` and that many `dask worker` processes (one thread
   each, bench/reference/dask_cluster.py), each made to import the job first (a one-off ~2.5 s
   that is not the scaling), then `reconcile()` submitted to it `--repeats` times: wall
   seconds, CPU seconds of each worker process, the seconds each spent in tasks (Dask's task
   stream), CPU seconds of the scheduler and of this (submitting) process, and the ratio
   FnApiRunner time / Dask time. Every report must equal the reference.

    python -m bench.dask_scaling [--rows 20000000] [--records 4000000] [--workers 1,2,4]
        [--repeats 3] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.reconcile_rate import make_manifest, make_spool  # noqa: E402
from tally.audit.reconcile import reconcile  # noqa: E402
from tally.pipeline.runners import RunnerSpec  # noqa: E402


def job_work(spool: Path, manifest: Path, memory_gb: float) -> dict:
    """Thread CPU seconds of the job's two stages, element by element, in this process."""
    from tally.audit.buckets.plan import PlanOptions, chunks, make_plan, spool_inputs
    from tally.audit.buckets.stages import ReadConsumption
    from tally.audit.reconcile.job import BucketStats

    inputs = spool_inputs(spool, "bench")
    plan = make_plan("bench", manifest, inputs, PlanOptions(memory_gb=memory_gb))
    with tempfile.TemporaryDirectory(dir=spool.parent) as work:
        read, slices = ReadConsumption(plan, f"{work}/buckets"), {}
        per_file = []
        for f in chunks(plan.files):  # the job's tasks: files a chunk of rows at a time
            t0 = time.thread_time()
            for kind, value in read.process(f):
                if kind == "by_bucket":
                    slices.setdefault(value[0], []).append(value[1])
            per_file.append(time.thread_time() - t0)
        Path(work, "records").mkdir()
        stats, per_bucket = BucketStats(plan, f"{work}/records"), []
        for b in range(plan.buckets + 1):
            t0 = time.thread_time()
            for _ in stats.process((b, {"consumption": slices.get(b, []), "manifest": [b]})):
                pass
            per_bucket.append(time.thread_time() - t0)
    return {"files": len(per_file), "buckets": plan.buckets, "read_s": per_file,
            "bucket_s": per_bucket}


def _import_the_job() -> bool:
    """Run on each worker before timing: its first import of Beam and Tally (~2.5 s) is a
    one-off, not part of what scales."""
    import tally.audit.reconcile.job  # noqa: F401

    return True


def _numbers(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "generated_at"}


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        out[pid] = t.user + t.system
    return out


def own_cpu() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20_000_000)
    ap.add_argument("--records", type=int, default=4_000_000)
    ap.add_argument("--file-rows", type=int, default=100_000, help="rows per spool file")
    ap.add_argument("--workers", default="1,2,4", help="Dask worker processes, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="timed Dask runs per worker count")
    ap.add_argument("--memory-gb", type=float, default=3.0, help="reconcile's --memory-gb")
    ap.add_argument("--dir", default="bench/out/dask_scaling")
    ap.add_argument("--keep", action="store_true", help="keep the data (default: removed)")
    args = ap.parse_args(argv)
    from distributed import Client

    from bench.reference.dask_cluster import DaskProcesses

    out = Path(args.dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        make_spool(out / "spool", args.rows, make_manifest(out / "manifest.parquet",
                                                           args.records),
                   per_file=args.file_rows)
        files = len(list((out / "spool").rglob("seg-*.parquet")))
        print(f"setup: {args.records:,}-record manifest, {args.rows:,} rows in {files} "
              f"files; {time.perf_counter() - t0:.0f} s; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)

        def run(runner: RunnerSpec) -> tuple[float, dict]:
            t0 = time.perf_counter()
            report = reconcile(run_id="bench", manifest=out / "manifest.parquet",
                               out=out / "report", spool=out / "spool", runner=runner,
                               memory_gb=args.memory_gb)
            return time.perf_counter() - t0, report

        work = job_work(out / "spool", out / "manifest.parquet", args.memory_gb)
        read_s, bucket_s = sum(work["read_s"]), sum(work["bucket_s"])
        print(f"the job's own work, one thread: read stage {read_s:.2f} CPU s over "
              f"{work['files']} chunks of files (max {max(work['read_s']):.3f} s a chunk); "
              f"bucket stage {bucket_s:.2f} CPU s over {work['buckets'] + 1} buckets (max "
              f"{max(work['bucket_s']):.2f} s a bucket); total {read_s + bucket_s:.2f} CPU s",
              flush=True)

        cpu0 = own_cpu()
        ref_s, ref = run(RunnerSpec("direct", mode="in_memory"))
        ref_cpu = own_cpu() - cpu0
        print(f"reference, FnApiRunner in_memory: {ref_s:.2f} s = "
              f"{args.rows / ref_s / 1e6:.2f} M rows/s, {ref_cpu:.1f} CPU s", flush=True)

        results = []
        for n in (int(w) for w in args.workers.split(",")):
            with contextlib.ExitStack() as stack:
                cluster = stack.enter_context(DaskProcesses(n, folder=out / f"dask-{n}"))
                address = cluster.address
                client = stack.enter_context(Client(address))
                client.run(_import_the_job)
                client.get_task_stream()  # the scheduler records tasks from now on
                pids = [p.pid for p in cluster.workers]
                for _ in range(args.repeats):
                    before, sched0 = cpu_seconds(pids), cpu_seconds([cluster.scheduler.pid])
                    cpu0, start = own_cpu(), time.time()
                    wall, report = run(RunnerSpec("dask", dask_address=address))
                    driver = own_cpu() - cpu0
                    after, sched1 = cpu_seconds(pids), cpu_seconds([cluster.scheduler.pid])
                    per_worker = [after[p] - before[p] for p in pids]
                    sched = sum(sched1.values()) - sum(sched0.values())
                    tasks = client.get_task_stream(start=start)
                    busy: dict[str, float] = {}
                    for t in tasks:
                        for ss in t["startstops"]:
                            if ss["action"] == "compute":
                                busy[t["worker"]] = busy.get(t["worker"], 0.0) + \
                                    ss["stop"] - ss["start"]
                    same = _numbers(report) == _numbers(ref)
                    results.append({"workers": n, "wall": wall, "worker_cpu": per_worker,
                                    "busy": sorted(busy.values(), reverse=True),
                                    "tasks": len(tasks), "scheduler_cpu": sched,
                                    "driver_cpu": driver, "same": same, "ratio": ref_s / wall})
                    print(f"Dask, {n} worker process(es): {wall:.2f} s = "
                          f"{args.rows / wall / 1e6:.2f} M rows/s; ratio to FnApiRunner "
                          f"{ref_s / wall:.2f}; {len(tasks)} tasks; per worker: CPU s "
                          f"{', '.join(f'{c:.1f}' for c in per_worker)} (sum "
                          f"{sum(per_worker):.1f}), in tasks "
                          f"{', '.join(f'{b:.1f}' for b in results[-1]['busy'])} s; scheduler "
                          f"{sched:.1f} CPU s, submitting process {driver:.1f} CPU s; report "
                          f"equals the reference: {same}", flush=True)
                    if not same:
                        print("MISMATCH against the FnApiRunner report")
        best = {}
        for r in results:
            if r["workers"] not in best or r["wall"] < best[r["workers"]]["wall"]:
                best[r["workers"]] = r
        base = best[min(best)]["wall"]
        own = read_s + bucket_s
        print("best of each: " + "; ".join(
            f"{n} worker(s) {r['wall']:.2f} s (speed-up {base / r['wall']:.2f}, ratio to "
            f"FnApiRunner {r['ratio']:.2f}, workers' CPU {sum(r['worker_cpu']):.1f} s = the "
            f"job's own {own:.1f} s + {sum(r['worker_cpu']) - own:.1f} s)"
            for n, r in sorted(best.items())))
        return {"rows": args.rows, "ref_s": ref_s, "work": work, "runs": results,
                "same": all(r["same"] for r in results)}
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
