"""Choosing a Beam runner: always explicit, never the default (which downloads Prism).

- `direct` (default): FnApiRunner, in memory, or `multi_processing` with `workers` processes.
- `dask`: Beam's DaskRunner on a dask.distributed cluster: the one at `dask_address`, or a
  local cluster of `workers` processes started here and stopped afterwards. A scheduler that
  cannot be reached, or workers lost beyond what Dask reschedules, is a TallyError.
- anything else (`DataflowRunner`, `FlinkRunner`, `SparkRunner`, ...): passed to Beam by name,
  configured through the standard pipeline options in `beam_args`.

In memory, FnApiRunner runs a stage's bundle in one thread; the jobs' heavy stages are wrapped
in `threaded`, which works on up to `workers` of a bundle's elements at once in threads (their
work is numpy and Arrow, which release the GIL), so the default runner uses the cores without
starting worker processes.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from tally.audit.core import logs
from tally.audit.core.errors import TallyError


@dataclass
class RunnerSpec:
    name: str = "direct"
    workers: int = 2
    mode: str = "in_memory"  # FnApiRunner: in_memory | multi_processing
    dask_address: str | None = None
    beam_args: Sequence[str] = field(default_factory=list)

    @property
    def threads(self) -> int:
        """Elements a `threaded` stage works on at once in each worker: `workers` in memory
        (one process), else 1 (the workers are processes, or the runner's own)."""
        return max(1, self.workers) if (self.name, self.mode) == ("direct", "in_memory") else 1

    @property
    def parallel(self) -> int | None:
        """Elements worked on at once in the whole job where this spec says (the direct runner,
        a local Dask cluster); None where the runner's cluster decides."""
        if self.name == "direct" or (self.name == "dask" and not self.dask_address):
            return max(1, self.workers)
        return None


def threaded(spec: RunnerSpec, fn: beam.DoFn) -> beam.DoFn:
    """`fn`, working on up to `spec.threads` elements of a bundle at once (itself when 1)."""
    return _Threaded(fn, spec.threads) if spec.threads > 1 else fn


class _Threaded(beam.DoFn):
    """A DoFn whose elements are processed by `threads` threads, each element's outputs kept
    together. Each element goes to the pool as it comes; past `threads` elements in flight the
    oldest one's outputs are emitted (so at most `threads` elements' work is held at once), and
    the rest at the bundle's end. Outputs keep the global window (the jobs' only one).

    Measured on 2 cores (the in-memory runner, reconcile of 9.6M rows): 4.0 -> 2.7 s; at 49.6M
    rows 26.9 -> 13.0 s, where 2 worker processes took 16.6-17.6 s (bench/RESULTS.md)."""

    def __init__(self, fn: beam.DoFn, threads: int) -> None:
        self.fn, self.threads = fn, threads

    def setup(self) -> None:
        self.fn.setup()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tally-stage")
        self._pending: collections.deque[Future] = collections.deque()

    def start_bundle(self) -> None:
        self._pending.clear()

    def _outputs(self, element: object) -> list:
        return list(self.fn.process(element))

    def process(self, element: object):
        self._pending.append(self._pool.submit(self._outputs, element))
        while len(self._pending) > self.threads:
            yield from self._oldest()

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.timestamp import MIN_TIMESTAMP
        from apache_beam.utils.windowed_value import WindowedValue

        while self._pending:
            for value in self._oldest():
                yield WindowedValue(value, MIN_TIMESTAMP, (GlobalWindow(),))

    def _oldest(self) -> list:
        """The outputs of the oldest element in flight; its error fails the bundle, and the
        elements not started yet are dropped (the job fails with it)."""
        try:
            return self._pending.popleft().result()
        except BaseException:
            for future in self._pending:
                future.cancel()
            self._pending.clear()
            raise

    def teardown(self) -> None:
        self._pool.shutdown(cancel_futures=True)
        self.fn.teardown()


@contextlib.contextmanager
def pipeline(spec: RunnerSpec, *, partitions: int = 0) -> Iterator[beam.Pipeline]:
    """A Beam pipeline on the runner `spec` names; it runs when the block exits."""
    args = list(spec.beam_args)
    if spec.name == "direct":
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        runner = FnApiRunner()
        if spec.mode == "multi_processing":
            # What `--direct_running_mode=multi_processing` does, with Tally's quiet start in
            # front of Beam's SDK worker (tally.pipeline.workers): the mode's own command cannot be
            # changed. Beam then warns that the (default) `in_memory` mode wants one worker:
            # not so, the workers are this environment's processes.
            from apache_beam.transforms.environments import SubprocessSDKEnvironment

            workers = f"{sys.executable} -m tally.pipeline.workers"
            runner = FnApiRunner(default_environment=SubprocessSDKEnvironment
                                 .from_command_string(workers))
            args += [f"--direct_num_workers={spec.workers}"]
        with logs.without("apache_beam.runners.portability.fn_api_runner.fn_runner",
                          "If direct_num_workers is not equal to 1"), \
                beam.Pipeline(runner=runner, options=PipelineOptions(args)) as p:
            yield p
        return
    if spec.name == "dask":
        with _dask_cluster(spec) as address:
            from apache_beam.runners.dask.dask_runner import DaskRunner

            args += [f"--dask_client_address={address}"]
            sized = ("--dask_npartitions", "--dask_partition_size")  # the user's choice wins
            if partitions and not any(a.startswith(sized) for a in args):
                args += [f"--dask_npartitions={min(partitions, 2 * _dask_threads(address))}"]
            p = beam.Pipeline(runner=DaskRunner(), options=PipelineOptions(args))
            yield p
            _run_on_dask(p, address)
        return
    try:
        p = beam.Pipeline(runner=spec.name, options=PipelineOptions(args))
    except ValueError as exc:
        raise TallyError(f"Beam runner {spec.name!r}: {exc}") from None
    with p:
        yield p


@contextlib.contextmanager
def _dask_cluster(spec: RunnerSpec) -> Iterator[str]:
    if spec.dask_address:
        yield spec.dask_address
        return
    import dask
    from distributed import LocalCluster

    # Quiet the local cluster, here and in its worker processes (which read the environment).
    os.environ.setdefault("DASK_DISTRIBUTED__LOGGING__DISTRIBUTED", "error")
    dask.config.set({"distributed.logging.distributed": "error"})
    logging.getLogger("distributed").setLevel(logging.ERROR)
    # SIGTERM (how `tally`'s supervisor stops a command on Ctrl-C) ends the job with the local
    # cluster closed: killed with it open, its workers' semaphores were left to
    # multiprocessing's resource tracker, which printed "There appear to be 12 leaked
    # semaphore objects to clean up at shutdown". A signal while the cluster starts waits
    # until it has started (interrupted there, it could not be closed).
    with _SigtermInterrupts() as signals:
        signals.held = True
        # The workers import Beam, which logs at import: tally.pipeline.workers quiets them first.
        try:
            # No dashboard; the scheduler's HTTP server (metrics) still starts, on port 8787
            # unless told otherwise, and a second local cluster on the machine then warned
            # on stderr that the port was taken: any free port, on loopback.
            cluster = LocalCluster(n_workers=spec.workers, threads_per_worker=1,
                                   processes=True, dashboard_address=None,
                                   scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                                   silence_logs=logging.ERROR, preload=["tally.pipeline.workers"])
        except Exception:
            signals.release()  # the signal that stopped its workers: the interrupt
            raise
        try:
            signals.release()
            yield cluster.scheduler_address
        finally:
            cluster.close()


class _SigtermInterrupts:
    """Within the block, SIGTERM raises KeyboardInterrupt; while `held`, at `release()`."""

    def __init__(self) -> None:
        self.held, self._pending, self._before = False, False, None

    def __call__(self, signum: int, frame: object) -> None:
        if self.held:
            self._pending = True
            return
        raise KeyboardInterrupt

    def release(self) -> None:
        self.held = False
        if self._pending:
            raise KeyboardInterrupt

    def __enter__(self) -> _SigtermInterrupts:
        import signal

        if threading.current_thread() is threading.main_thread():
            self._before = signal.signal(signal.SIGTERM, self)
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        if self._before is not None:
            signal.signal(signal.SIGTERM, self._before)


def _dask_threads(address: str) -> int:
    """The worker threads of the cluster at `address`; TallyError when it cannot be reached.

    The job's partition count is capped at twice this: the Dask runner turns each GroupByKey
    into a task shuffle of about P x P tasks for P partitions, which on a 2-worker cluster made
    reconcile of 1M rows take 15.5 s with P = 20 (one per input file) and 3.0 s with P = 2
    (bench/RESULTS.md); two partitions per thread still balance uneven elements."""
    from distributed import Client

    try:
        with Client(address, set_as_default=False) as client:
            if not client.nthreads():  # workers still starting (a compose stack coming up)
                with contextlib.suppress(TimeoutError):
                    client.wait_for_workers(1, timeout=30)
            return max(1, sum(client.nthreads().values()))
    except OSError as exc:
        raise TallyError(f"cannot reach the Dask scheduler at {address}: {exc}") from None


def _run_on_dask(p: beam.Pipeline, address: str) -> None:
    """Run `p` on the cluster and wait; a lost worker, scheduler or cluster is a TallyError.

    Dask reschedules the tasks of a worker that dies and recomputes the results it held (up
    to `distributed.scheduler.allowed-failures` deaths per task, 3 by default); past that, or
    with no worker left for `distributed.scheduler.no-workers-timeout`, the job fails here and
    its tasks not yet started are cancelled (a task already running still finishes)."""
    from distributed import CancelledError
    from distributed.scheduler import KilledWorker, NoValidWorkerError

    try:
        result = p.run()
    except OSError as exc:
        raise TallyError(f"cannot reach the Dask scheduler at {address}: {exc}") from None
    done = False
    try:
        _wait_for(result.futures)
        done = True
    except KilledWorker as exc:
        raise TallyError(
            f"a Dask worker died while running the job ({exc.last_worker.address}), and "
            f"{exc.allowed_failures + 1} death(s) of a worker running the same task are more "
            "than the cluster allows (distributed.scheduler.allowed-failures); the job did "
            "not finish") from None
    except NoValidWorkerError as exc:
        raise TallyError(f"no Dask worker was left to run the job (task {exc.args[0]!r} "
                         f"waited {exc.args[-1]} s); the job did not finish") from None
    except CancelledError as exc:
        raise TallyError(f"the Dask cluster at {address} dropped the job ({exc}); the job did "
                         "not finish") from None
    finally:
        if not done:
            with contextlib.suppress(Exception):  # the scheduler may be gone: nothing to cancel
                result.cancel()
        # The runner's client would otherwise retry the closed scheduler for 30 s.
        result.client.close()


def _wait_for(futures: Sequence) -> None:
    """Until every future of the job has finished; a failed one's error raised.

    Not Beam's `DaskRunnerResult.wait_until_finish`, which gathers every result to the client
    through `as_completed(..., with_results=True)`: in a run of the suite on 2 busy cores it
    waited forever after the cluster had finished the job (the scheduler held the last result
    in memory, both workers and the scheduler idle, the client in `as_completed`; that call is
    known to loop, dask/distributed#7331). The job's outputs are files it wrote, so no result
    is gathered: each future's state is waited for, and an erred one's `result()` raises the
    worker's error (KilledWorker, NoValidWorkerError, the task's own)."""
    from distributed import CancelledError, wait

    wait(futures)
    for future in futures:
        if future.status == "error":
            future.result()
        elif future.status != "finished":
            raise CancelledError(future.key)
