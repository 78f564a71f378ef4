"""The C allocator's settings for Tally's own processes (the command line and what it starts).

Ingest and reconcile work in numpy temporaries of a few MB each, made and freed for every batch
or bucket. glibc's malloc maps an allocation above its mmap threshold afresh and unmaps it when
freed, and returns free memory at the top of its heap beyond its trim threshold: either way the
next temporary faults its pages in again and the kernel zeroes them. Its dynamic threshold
learns to keep such sizes on the heap, but trimming still gave them back: a 10M-row ingest
from 128 hosts took 542k page faults and 3.8 s of system time (of 15 CPU s). Keeping
allocations up to 32 MiB on the heap and up to 256 MiB free at its top: 255k faults, 2.5 s of
system time, 8 % less wall time; a 10M-row reconcile 13 % (bench/RESULTS.md). The cost is up to
256 MiB of freed memory kept by each malloc arena rather than returned.

Set by `tune()`: `mallopt` for this process, and the environment variables glibc reads at the
start of a process for the processes it starts (Beam and Dask workers, the supervised child);
numpy's huge pages off (`NUMPY_HUGE_PAGES`), in this process and those it starts. A setting the
environment already has is left as it is. Elsewhere than Linux, nothing; elsewhere than glibc,
numpy's huge pages only.

One malloc arena for all of this process's threads (`ARENAS`): glibc gives each thread that
allocates an arena of its own, whose heaps (64 MiB at most) it maps, faults in and gives back
as the thread's temporaries come and go, where the main arena reuses what another thread freed.
A reconcile whose stages work in 2 threads (tally.pipeline.runners.threaded) took 3.0-5.1 s of
system time for 9.6M rows with an arena a thread, 0.8-1.3 s with one, and 2.5-2.8 s instead of
3.5-4.9 s in all (bench/RESULTS.md); an ingest (2 threads of numpy beside DuckDB's, which
allocate through their own jemalloc) ran the same either way. Set in this process only, not
through the environment: the processes Tally starts are single-threaded workers, the
supervised child (which tunes itself) and training hosts, whose allocator is their own affair.
"""

from __future__ import annotations

import ctypes
import os
import sys

MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 256 << 20
ARENAS = 1
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # mallopt's numbers (malloc.h)
_ENV = {"MALLOC_MMAP_THRESHOLD_": (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        "MALLOC_TRIM_THRESHOLD_": (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)}


# numpy asks Linux for transparent huge pages for each array of 4 MiB or more it allocates
# (madvise), unless this is "0" as it loads. Where THP is "madvise" (this box, and the default
# of many distributions) those faults compact and zero 2 MiB at a time, and a batch's
# temporaries come and go: a 40M-row ingest of 16 hosts' files over 100M records
# (bench/ingest_rate.py, alternated, two runs each) took 24.3-24.5 s and 8.6-10.5 system CPU s
# with them, 21.0-21.1 s and 4.9 without (more faults, 4 KiB each); a 10M-row reconcile was no
# slower (bench/RESULTS.md). Read by numpy as it loads: tune() runs first where it can, and
# switches it off after if not.
NUMPY_HUGE_PAGES = "NUMPY_MADVISE_HUGEPAGE"


def tune() -> None:
    """Apply the settings to this process and to the processes it starts (glibc only)."""
    if not sys.platform.startswith("linux"):
        return
    if NUMPY_HUGE_PAGES not in os.environ:  # the user's own setting wins
        os.environ[NUMPY_HUGE_PAGES] = "0"
        # numpy already loaded (a library caller, the benches): its run-time switch
        switch = getattr(sys.modules.get("numpy._core.multiarray"), "_set_madvise_hugepage",
                         None)
        if switch is not None:
            switch(False)
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return
    for name, (param, value) in _ENV.items():
        if name not in os.environ:
            os.environ[name] = str(value)
            mallopt(param, value)
    if "MALLOC_ARENA_MAX" not in os.environ:  # the user's own setting wins
        # Takes effect for threads that have not allocated yet: the command line tunes before
        # its work starts a thread.
        mallopt(_M_ARENA_MAX, ARENAS)


def release() -> None:
    """Give back to the system the memory the allocators hold free (glibc's `malloc_trim`, and
    Arrow's memory pool, which keeps its own):
    at the end of an ingest, what `tune` keeps for the next batch's temporaries (up to
    TRIM_THRESHOLD an arena, and each thread that allocates has its arena) would otherwise
    stay resident while the service idles between rounds. A live ingest of 2M rows over 20M
    records from 256 hosts held 33.7 bytes a record of anonymous memory beyond an empty
    service, tuned as the command line runs; 14.7 after this (bench/RESULTS.md). Elsewhere
    than glibc, Arrow's pool only."""
    import pyarrow as pa  # here: the allocator's settings load before anything else

    pa.default_memory_pool().release_unused()
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)
