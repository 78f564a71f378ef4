"""tally.audit.core.allocator: the allocator keeps a batch's temporaries instead of faulting them in
afresh each time, in this process and in the processes it starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import resource, sys
if sys.argv[1] == "tuned":
    from tally.audit.core import allocator
    allocator.tune()
import numpy as np
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):  # six 8 MiB temporaries, made and freed, as each ingest batch does
    a = [np.ones(1 << 20, np.int64) for _ in range(6)]
    del a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.slow
def test_tuned_processes_reuse_freed_temporaries_and_pass_it_on():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, check=True,
                             capture_output=True, text=True).stdout
        return int(out.split()[-1])

    # Untuned, glibc gives freed pages back (122k faults here, 12 MiB of pages a round);
    # tuned, the first round's stay (3k).
    assert faults("plain") > 5 * 6 * 2048
    assert faults("tuned") < 2 * 6 * 2048
    # Its children inherit the settings through the environment (Beam and Dask workers).
    child = subprocess.run(
        [sys.executable, "-c", "from tally.audit.core import allocator; allocator.tune(); "
         "import os, subprocess, sys; print(subprocess.run([sys.executable, '-c', "
         f"{PROBE!r}, 'plain'], capture_output=True, text=True).stdout)"],
        env=env, check=True, capture_output=True, text=True).stdout
    assert int(child.split()[-1]) < 2 * 6 * 2048


RELEASE_PROBE = """
import sys
from tally.audit.core import allocator
allocator.tune()
import numpy as np

def anon():
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("RssAnon"))

base = anon()
# Many 1 MiB temporaries alive at once, then freed: below the tuned mmap threshold they live on
# the heap, and below its trim threshold freeing them keeps them resident.
a = [np.ones(1 << 17, np.int64) for _ in range(160)]
del a
kept = anon() - base
if sys.argv[1] == "release":
    allocator.release()
print(kept, anon() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_release_gives_back_what_the_tuned_allocator_keeps():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def kib(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", RELEASE_PROBE, mode], env=env, check=True,
                             capture_output=True, text=True).stdout
        kept, after = out.split()
        return int(kept), int(after)

    kept, after = kib("keep")
    assert kept > 100 * 1024 and after > 100 * 1024  # 160 MiB freed, still resident
    kept, after = kib("release")
    assert kept > 100 * 1024 and after < 20 * 1024  # given back


THREADS_PROBE = """
import ctypes, resource, sys, tempfile, threading
from tally.audit.core import allocator
allocator.tune()
if sys.argv[1] == "arena-a-thread":  # as glibc's default (8 a core) would, before any thread
    ctypes.CDLL(None).mallopt(-8, 8)
import numpy as np

SIZE, KEPT = 2_621_440, 6  # six 20 MiB temporaries, made and freed: a bucket's, in a stage thread

def work(out):
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(40):
        a = [np.ones(SIZE, np.int64) for _ in range(KEPT)]
        del a
    out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

out = []
threads = [threading.Thread(target=work, args=(out,)) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile() as info:  # glibc's own account: a <heap> element an arena
    f = libc.fopen(info.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(f))
    libc.fclose(ctypes.c_void_p(f))
    arenas = open(info.name).read().count("<heap nr=")
print(arenas, sum(out), 2 * KEPT * SIZE * 8 // resource.getpagesize())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_tuned_threads_share_one_arena_and_reuse_what_the_other_freed():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def probe(mode: str) -> tuple[int, int, int]:
        out = subprocess.run([sys.executable, "-c", THREADS_PROBE, mode], env=env,
                             check=True, capture_output=True, text=True).stdout
        arenas, faults, first_touch = (int(x) for x in out.split())
        return arenas, faults, first_touch

    # Tuned, both threads allocate from one arena, and no page is faulted in twice: the faults
    # are at most the first touch of both threads' temporaries (61,431 of 61,440 here and on
    # CI), whatever the threads' interleaving. With an arena a thread glibc maps and gives back
    # heaps as the temporaries come and go (107k-753k faults, varying with the interleaving and
    # the box's load: compared here by the arenas glibc reports, not by a count of faults).
    arenas, faults, first_touch = probe("tuned")
    assert arenas == 1
    assert faults <= first_touch * 21 // 20, (faults, first_touch)
    assert probe("arena-a-thread")[0] > 1
    # The user's own setting wins.
    env["MALLOC_ARENA_MAX"] = "8"
    assert probe("tuned")[0] > 1


HUGE_PROBE = """
import sys
if sys.argv[1] == "before":
    from tally.audit.core import allocator
    allocator.tune()
import numpy as np
if sys.argv[1] == "after":  # a library caller, or a bench, that loaded numpy first
    from tally.audit.core import allocator
    allocator.tune()
a = np.ones(8 << 20, np.int64)  # 64 MiB, written: numpy madvises 4 MiB and more
rollup = {x.split(":")[0]: x.split()[1] for x in open("/proc/self/smaps_rollup")}
print(int(rollup.get("AnonHugePages", 0)))
"""
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's huge pages")
def test_tuned_processes_keep_numpy_off_huge_pages_unless_the_user_asks():
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}

    def huge_kib(mode: str, **extra: str) -> int:
        out = subprocess.run([sys.executable, "-c", HUGE_PROBE, mode], env={**env, **extra},
                             check=True, capture_output=True, text=True).stdout
        return int(out.split()[-1])

    assert huge_kib("before") == huge_kib("after") == 0 or _thp() == "always"
    if _thp() != "madvise":
        pytest.skip(f"transparent huge pages are {_thp()!r} here: numpy's advice changes nothing")
    # Where THP is left to madvise (this box), numpy's own choice backs the array with them
    # (all 64 MiB here), and the user's setting wins over tune's.
    if huge_kib("plain") == 0:
        pytest.skip("the kernel gave numpy's own advice no huge page here (none free)")
    assert huge_kib("before", NUMPY_MADVISE_HUGEPAGE="1") > 0


def _thp() -> str:
    try:
        text = Path(THP).read_text()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1: text.index("]")] if "[" in text else "unknown"
