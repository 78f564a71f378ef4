"""The test suite's own layout (docs/DESIGN.md, "Testing"): the longest files start first, and
the fast layer leaves out only what is marked slow."""

from __future__ import annotations

import tomllib

from tests.support import ROOT
from tests.support.layers import LONGEST_FIRST


def test_the_longest_files_named_first_exist_and_keep_their_order():
    """A name that no longer matches a file would quietly stop counting, and pytest-xdist's
    own reordering (files with most tests first) would undo the order without
    --no-loadscope-reorder."""
    missing = [name for name in LONGEST_FIRST if not (ROOT / "tests" / name).is_file()]
    assert not missing, missing
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    options = pytest_options["ini_options"]
    assert "--no-loadscope-reorder" in options["addopts"].split()
    assert any(m.startswith("slow:") for m in options["markers"])
