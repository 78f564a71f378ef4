"""Choosing a Beam runner: always explicit, never the default (which downloads Prism).

- `direct` (default): FnApiRunner, in memory, or `multi_processing` with `workers` processes.
- `dask`: Beam's DaskRunner on a dask.distributed cluster: the one at `dask_address`, or a
  local cluster of `workers` processes started here and stopped afterwards.
- anything else (`DataflowRunner`, `FlinkRunner`, `SparkRunner`, ...): passed to Beam by name,
  configured through the standard pipeline options in `beam_args`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from audit.core.errors import TallyError


@dataclass
class RunnerSpec:
    name: str = "direct"
    workers: int = 2
    mode: str = "in_memory"  # FnApiRunner: in_memory | multi_processing
    dask_address: str | None = None
    beam_args: Sequence[str] = field(default_factory=list)


@contextlib.contextmanager
def pipeline(spec: RunnerSpec, *, partitions: int = 0) -> Iterator[beam.Pipeline]:
    """A Beam pipeline on the runner `spec` names; it runs when the block exits."""
    args = list(spec.beam_args)
    if spec.name == "direct":
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        if spec.mode == "multi_processing":
            args += ["--direct_running_mode=multi_processing",
                     f"--direct_num_workers={spec.workers}"]
        with beam.Pipeline(runner=FnApiRunner(), options=PipelineOptions(args)) as p:
            yield p
        return
    if spec.name == "dask":
        with _dask_cluster(spec) as address:
            from apache_beam.runners.dask.dask_runner import DaskRunner

            args += [f"--dask_client_address={address}"]
            if partitions:
                args += [f"--dask_npartitions={partitions}"]
            p = beam.Pipeline(runner=DaskRunner(), options=PipelineOptions(args))
            yield p
            result = p.run()
            result.wait_until_finish()
            # The runner's client would otherwise retry the closed scheduler for 30 s.
            client = getattr(result, "client", None)
            if client is not None:
                client.close()
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
    cluster = LocalCluster(n_workers=spec.workers, threads_per_worker=1, processes=True,
                           dashboard_address=None, silence_logs=logging.ERROR)
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close()
