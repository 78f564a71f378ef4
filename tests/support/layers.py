"""The order test files start in (docs/DESIGN.md, "Testing").

Under `--dist loadfile` a file runs whole on one worker. pytest-xdist's default order (files
with the most tests first) started the few-test files that take longest last, where the
longest alone set the suite's wall time; they start first now, longest first, and the rest
follow in their own order (`--no-loadscope-reorder` keeps this order).
"""

from __future__ import annotations

import pytest

# The files that take longest on 2 cores, longest first (per-file times, `pytest -n 0
# --durations=0 FILE`, on a shared 2-core box, 2026-12-05).
LONGEST_FIRST: tuple[str, ...] = (
    "test_readme.py", "test_manual_apart.py", "test_cli.py", "test_train_hosts.py",
    "test_posthoc.py",
    "test_grain_attach.py", "test_dask_cluster.py", "test_bench.py", "test_olmo_core_loader.py",
    "test_litdata_loader.py", "test_hf_loader.py", "test_faults.py", "test_crash.py",
    "test_reconcile.py", "test_grain_replay.py", "test_vocabulary.py", "test_pages.py",
    "test_cli_conventions.py",
)


def longest_first(items: list[pytest.Item]) -> None:
    """Sort `items` so that LONGEST_FIRST's files come first, in its order; stable, so each
    file's tests stay together and in their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
