"""The manual's sections that make their own data (tests/test_readme.py's APART: corpora and
manifests, the loaders audited as they are), run in order in a directory of their own, beside
the tour's on the other pytest-xdist worker."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from tests.test_readme import page_blocks, run_in_order

# The guides' sections that make their own data, run in order (minutes).
pytestmark = pytest.mark.slow


def test_the_sections_that_make_their_own_data_run_in_order(tmp_path):
    ran = run_in_order([b for b in page_blocks() if b.apart], tmp_path)
    assert ran["bash"] >= 8 and ran["python"] >= 8 and ran["cluster"] >= 2, ran
    # What they made is real: the manifests of each format, and the audited loaders' reports.
    assert pq.read_table(tmp_path / "manifest-dolma.parquet").num_rows == 600
    for name in ("report-hf", "report-hf-iter", "report-mds", "report-litdata",
                 "report-olmo-core", "report-olmo", "report-olmo-replay"):
        report = json.loads((tmp_path / name / "report.json").read_text())
        assert report["verdict"] in ("PASS", "WARN"), (name, report["findings"])
    live, replay = (json.loads((tmp_path / name / "report.json").read_text())
                    for name in ("report-olmo", "report-olmo-replay"))
    assert replay["replayed"] and not live["replayed"]
    assert replay["coverage"] == live["coverage"]  # the replayed run is the live one
