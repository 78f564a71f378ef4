"""tally.pipeline.runners.threaded: a stage's elements worked on in threads on the in-memory
FnApiRunner, every output kept, at most `workers` elements at once, a failure the job's."""

from __future__ import annotations

import threading

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to

from tally.pipeline.runners import RunnerSpec, pipeline, threaded

# Module-level, so that the pickled DoFns below reach the same objects in this process.
TOGETHER = threading.Barrier(2, timeout=20)
LOCK = threading.Lock()
FLIGHT = {"now": 0, "most": 0, "threads": set()}


class Meet(beam.DoFn):
    """Each element waits for another to be processed at the same time (the barrier), then
    yields a few outputs."""

    def process(self, n: int):
        with LOCK:
            FLIGHT["now"] += 1
            FLIGHT["most"] = max(FLIGHT["most"], FLIGHT["now"])
            FLIGHT["threads"].add(threading.get_ident())
        try:
            TOGETHER.wait()
        finally:
            with LOCK:
                FLIGHT["now"] -= 1
        for i in range(3):
            yield (n, i)


class Fail(beam.DoFn):
    def process(self, n: int):
        if n == 5:
            raise ValueError("element 5 is bad")
        yield n


def test_a_threaded_stage_works_on_two_elements_at_once_and_keeps_every_output():
    spec = RunnerSpec("direct", mode="in_memory", workers=2)
    assert spec.threads == 2
    FLIGHT.update(now=0, most=0, threads=set())
    with pipeline(spec) as p:
        out = (p | beam.Create(range(10), reshuffle=False)
               | beam.ParDo(threaded(spec, Meet())))
        assert_that(out, equal_to([(n, i) for n in range(10) for i in range(3)]))
    # Every element met another at the barrier: two at once, never more.
    assert FLIGHT["most"] == 2 and len(FLIGHT["threads"]) == 2


def test_a_failing_element_fails_the_job_with_its_error():
    spec = RunnerSpec("direct", mode="in_memory", workers=2)
    with pytest.raises(Exception, match="element 5 is bad"), pipeline(spec) as p:
        _ = p | beam.Create(range(10), reshuffle=False) | beam.ParDo(threaded(spec, Fail()))


def test_worker_processes_and_one_worker_take_the_stage_as_it_is():
    fn = Fail()
    assert threaded(RunnerSpec("direct", mode="multi_processing", workers=2), fn) is fn
    assert threaded(RunnerSpec("direct", mode="in_memory", workers=1), fn) is fn
    assert threaded(RunnerSpec("dask", workers=4), fn) is fn
    assert RunnerSpec("dask", workers=4).parallel == 4
    assert RunnerSpec("dask", workers=4, dask_address="tcp://x:8786").parallel is None
    assert RunnerSpec("DataflowRunner").parallel is None


def test_buckets_are_sized_for_what_the_runner_works_on_at_once():
    from tally.audit.buckets.plan import BUCKETS_IN_FLIGHT, bucket_records_for, in_flight

    assert in_flight(None) == in_flight(2) == BUCKETS_IN_FLIGHT  # 2 workers and the runner
    assert in_flight(RunnerSpec("direct", workers=8).parallel) == 9
    # 100M records, 50M rows, 128 hosts, 3 GB: 9 buckets at once hold what 4 did.
    four, nine = (bucket_records_for(100_000_000, 50_000_000, 128, 3.0, n) for n in (4, 9))
    assert 0 < nine < four and abs(nine * 9 - four * 4) < 0.01 * four * 4
