"""The order test files start in (docs/DESIGN.md, "Testing").

Under `--dist loadfile` a file runs whole on one worker. pytest-xdist's default order (files
with the most tests first) started the few-test files that take longest last, where the
longest alone set the suite's wall time; they start first now, longest first, and the rest
follow in their own order (`--no-loadscope-reorder` keeps this order).
"""

from __future__ import annotations

import pytest

# The files that take longest on 2 cores, longest first.
LONGEST_FIRST: tuple[str, ...] = ()


def longest_first(items: list[pytest.Item]) -> None:
    """Sort `items` so that LONGEST_FIRST's files come first, in its order; stable, so each
    file's tests stay together and in their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
