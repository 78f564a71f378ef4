"""numpy's CPU dispatch for Tally's own processes: no AVX-512 kernels on AMD Zen 4.

numpy (>= 2) sorts 32- and 64-bit numbers with x86-simd-sort, whose AVX-512 kernels store each
partition with the memory form of `vpcompressq`; Zen 4 runs that form in microcode (AMD's
optimization guide for the family: avoid it), and there the AVX-512 sort is no faster than a
scalar one. Measured on this project's 2-core AMD EPYC (Zen 4), numpy 2.1.3, 10M values:

| | AVX-512 (numpy's choice) | AVX2 (this setting) |
| --- | --- | --- |
| int64 sort | 66 ns a value | 13 ns |
| int64 argsort | 142 ns | 85 ns |
| int32 sort | 39 ns | 7.7 ns |
| add, compare, shift, bincount, gather of int64 | the same within 10% | |

Sorting is much of what the ingest's per-record state, the lookup index and a bucket's
statistics cost (bench/RESULTS.md: the ingest of 20M rows 13.9-15.0 -> 12.1-13.3 s, a
reconcile of 9.6M rows 2.7-3.3 -> 2.1-2.9 s). Zen 4 runs 512-bit operations as two 256-bit
halves, so the other kernels lose nothing on the AVX2 path.

Set through `NPY_DISABLE_CPU_FEATURES`, which numpy reads once, as it loads: `tune()` must run
before anything imports numpy (the command line calls it first), and the processes it starts
inherit it. Only where it helps: AMD family 0x19 with AVX-512 (Zen 4: Zen 3 has no AVX-512, and
Zen 5, family 0x1A, stores compressed vectors at full speed), numpy 2 or later (1.26 has no
AVX2 sort to fall back to). The user's own setting, even an empty one, is left as it is: a
numpy built to require AVX-512 (none on PyPI) refuses the setting at import ("You cannot
disable CPU feature ... part of the baseline optimizations"), and `NPY_DISABLE_CPU_FEATURES=`
keeps numpy's own choice.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "NPY_DISABLE_CPU_FEATURES"
ZEN4_FAMILY = 0x19
# numpy's AVX-512 dispatch targets with the CPU flags each needs (so that none is named that
# the CPU lacks, which numpy would warn about). numpy 2.4 grouped the first ones as X86_V4.
_BY_FEATURE = {"AVX512F": ("avx512f",), "AVX512CD": ("avx512cd",),
               "AVX512_SKX": ("avx512vl", "avx512bw", "avx512dq"),
               "AVX512_CLX": ("avx512_vnni",), "AVX512_CNL": ("avx512ifma", "avx512vbmi"),
               "AVX512_ICL": ("avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq")}
_GROUPED = {"X86_V4": ("avx512f", "avx512cd", "avx512vl", "avx512bw", "avx512dq"),
            "AVX512_ICL": _BY_FEATURE["AVX512_ICL"] + _BY_FEATURE["AVX512_CNL"]
            + _BY_FEATURE["AVX512_CLX"],
            "AVX512_SPR": ("avx512_fp16",)}


def tune() -> None:
    """Turn numpy's AVX-512 kernels off for this process and its children on Zen 4 (see the
    module); anywhere else, or where the user set `NPY_DISABLE_CPU_FEATURES`, nothing."""
    if ENV in os.environ or "numpy" in sys.modules:
        return
    features = avx512_to_disable(_cpuinfo(), _numpy_version())
    if features:
        os.environ[ENV] = " ".join(features)


def avx512_to_disable(cpuinfo: str, numpy_version: tuple[int, int] | None) -> list[str]:
    """The names to give numpy `numpy_version` for the first processor of `cpuinfo` (the text
    of /proc/cpuinfo): its AVX-512 targets on a Zen 4, else none."""
    if numpy_version is None or numpy_version < (2, 0):
        return []
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if first:
                break
            continue
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    try:
        family = int(first.get("cpu family", ""))
    except ValueError:
        return []
    flags = set(first.get("flags", "").split())
    if first.get("vendor_id") != "AuthenticAMD" or family != ZEN4_FAMILY or \
            "avx512f" not in flags:
        return []
    targets = _GROUPED if numpy_version >= (2, 4) else _BY_FEATURE
    return [name for name, need in targets.items() if flags.issuperset(need)]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:  # not Linux
        return ""


def _numpy_version() -> tuple[int, int] | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("numpy").split(".")[:2]
        return int(major), int(minor)
    except (PackageNotFoundError, ValueError):
        return None
