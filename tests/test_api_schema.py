"""Fuzz every operation of the OpenAPI schema (schemathesis) against a real server with data:
no 500, status codes and bodies as documented, bad parameters rejected with 422."""

from __future__ import annotations

import json
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import positive_data_acceptance

from tally.api.app import create_app
from tally.audit.ledger.database import Ledger
from tally.audit.ledger.ingest import ingest
from tests.support.api import Server, write_steps
from tests.test_api_live import N, write_manifest

# Schemathesis over every operation (~15 s).
pytestmark = pytest.mark.slow

# By default the same 50 requests per operation every run (derandomized): a failure in CI is
# then reproducible, never the luck of the draw. TALLY_FUZZ_EXAMPLES=N draws N fresh random
# requests per operation instead, to fuzz harder (1000 passed before this was committed).
EXAMPLES = int(os.environ.get("TALLY_FUZZ_EXAMPLES", "0"))


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    spool, reports = tmp / "spool", tmp / "reports"
    reports.mkdir()
    (reports / "report.json").write_text(json.dumps({"run_id": "r", "verdict": "PASS"}))
    for h in (0, 1):
        write_steps(spool, "r", host=h, hosts=2, steps=range(30), n=N, seed=h, flush_every=7)
    with Ledger(tmp / "l.duckdb") as ledger:
        ingest(spool, ledger)
        app = create_app(ledger, spool=spool, manifest=write_manifest(tmp / "m.parquet"),
                         reports=reports)
        with Server(app) as srv:
            yield schemathesis.openapi.from_url(srv.url + "/openapi.json")


def _int(value, default: int = -1) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def test_no_operation_fails_on_any_input(api_schema):
    # Operations one by one with Hypothesis (schemathesis' pytest fixture loader does not run
    # on pytest 9); each gets a bounded number of generated requests, valid and invalid.
    ops = [r.ok() for r in api_schema.get_all_operations()]
    assert len(ops) >= 12
    for op in ops:
        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES or 50, derandomize=not EXAMPLES, deadline=None,
                  database=None, suppress_health_check=list(HealthCheck))
        def fuzz(case):
            q = case.query or {}
            if _int(q.get("start")) > _int(q.get("end"), 2**63):
                # `start` after `end` is a 422 by design, a rule across two parameters that
                # the schema cannot state: every other check still applies.
                r = case.call_and_validate(excluded_checks=[positive_data_acceptance])
                assert r.status_code == 422, (case.path, q, r.status_code)
                return
            case.call_and_validate()

        fuzz()
