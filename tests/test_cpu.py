"""tally.audit.core.cpu: numpy's AVX-512 kernels off on AMD Zen 4 only, set before numpy loads,
and the user's own setting left alone."""

from __future__ import annotations

import os
import subprocess
import sys

from tally.audit.core import cpu

ZEN4_FLAGS = ("fpu sse2 avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512ifma avx512vbmi "
              "avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq avx512_bf16")
# Two processors: only the first one is read.
ZEN4 = (f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        f"model name\t: AMD EPYC 9R14\nflags\t\t: {ZEN4_FLAGS}\n\n"
        "processor\t: 1\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nflags\t\t: fpu\n")


def _cpu(vendor: str, family: int, flags: str) -> str:
    return f"vendor_id\t: {vendor}\ncpu family\t: {family}\nflags\t\t: {flags}\n"


def test_zen4_gets_its_avx512_targets_named_as_the_numpy_version_names_them():
    assert cpu.avx512_to_disable(ZEN4, (2, 1)) == [
        "AVX512F", "AVX512CD", "AVX512_SKX", "AVX512_CLX", "AVX512_CNL", "AVX512_ICL"]
    # numpy 2.4 groups them; Zen 4 has no AVX512-FP16, so AVX512_SPR is not named.
    assert cpu.avx512_to_disable(ZEN4, (2, 4)) == ["X86_V4", "AVX512_ICL"]


def test_anything_else_is_left_to_numpy():
    avx512 = "avx2 avx512f avx512dq avx512cd avx512bw avx512vl"
    assert cpu.avx512_to_disable(ZEN4, (1, 26)) == []  # no AVX2 sort to fall back to
    assert cpu.avx512_to_disable(ZEN4, None) == []  # numpy not installed
    assert cpu.avx512_to_disable(_cpu("GenuineIntel", 6, avx512), (2, 1)) == []
    assert cpu.avx512_to_disable(_cpu("AuthenticAMD", 25, "avx2"), (2, 1)) == []  # Zen 3
    assert cpu.avx512_to_disable(_cpu("AuthenticAMD", 26, avx512), (2, 1)) == []  # Zen 5
    assert cpu.avx512_to_disable("", (2, 1)) == []  # no /proc/cpuinfo
    assert cpu.avx512_to_disable("cpu family : x\n", (2, 1)) == []


PROBE = """
import os, sys
from tally.audit.core import cpu
cpu.tune()
import numpy as np
a = np.random.default_rng(0).integers(0, 2**62, 100_000)
assert (np.sort(a) == sorted(a.tolist())).all()
print(os.environ.get("NPY_DISABLE_CPU_FEATURES", "-"))
core = getattr(np, "_core", None) or np.core  # numpy 2 / 1.26
print(core._multiarray_umath.__cpu_features__.get("AVX512F"))
"""


def _probe(env: dict[str, str]) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    return out[-2], out[-1]


def test_a_process_tuned_before_numpy_loads_runs_without_what_it_names():
    env = {k: v for k, v in os.environ.items() if k != cpu.ENV}
    named = cpu.avx512_to_disable(cpu._cpuinfo(), cpu._numpy_version())
    setting, avx512 = _probe(env)
    if named:  # this machine is a Zen 4
        assert setting.split() == named and avx512 == "False"
    else:
        assert setting == "-"
    # The user's own setting, even an empty one, wins.
    env[cpu.ENV] = ""
    setting, avx512 = _probe(env)
    assert setting == "" and (avx512 == "True") == ("avx512f" in cpu._cpuinfo())
