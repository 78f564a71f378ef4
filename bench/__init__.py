"""Benchmarks (bench/RESULTS.md has what each measured). Each runs as the command line does:
numpy's CPU dispatch is set before any benchmark imports numpy (tally.audit.core.cpu)."""

from tally.audit.core import cpu

cpu.tune()
