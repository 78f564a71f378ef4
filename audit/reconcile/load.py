"""A reconcile report read back in one call, for a notebook: `tally.audit.load_report(OUT)` gives
its
verdict, findings and coverage as typed objects (tally.audit.core.exposure's Finding and Coverage)
and its tables as Arrow tables (the files `tally.audit.reconcile.report.write` and the job wrote).
Needs the base install only: pyarrow reads every table."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from tally.audit.core.errors import TallyError
from tally.audit.core.exposure import Coverage, Finding

TABLES = ("steps", "hosts", "domains")


@dataclass
class Report:
    """A reconcile report: `data` is report.json as written; the rest are views of it and of
    the tables beside it."""

    path: Path
    data: dict[str, Any]
    verdict: str  # PASS, WARN or FAIL
    findings: list[Finding]
    coverage: Coverage
    steps: pa.Table  # per step: consumed, new unique, repeats, coverage, ideal, ...
    hosts: pa.Table  # per host
    domains: pa.Table  # per manifest domain: planned vs actual
    records: pa.Table  # per manifest record: exposures, first step, ... (OUT/records/)
    tables: dict[str, pa.Table] = field(default_factory=dict)  # every table above, by name

    @property
    def run_id(self) -> str:
        return self.data["run_id"]

    def findings_table(self) -> pa.Table:
        """The findings as a table (numbers and evidence as JSON text), for a notebook's display."""
        return pa.Table.from_pylist(
            [{"severity": f.severity, "code": f.code, "message": f.message,
              "numbers": json.dumps(f.numbers, default=str),
              "evidence": None if f.evidence is None else json.dumps(f.evidence)}
             for f in self.findings],
            schema=pa.schema([("severity", pa.string()), ("code", pa.string()),
                              ("message", pa.string()), ("numbers", pa.string()),
                              ("evidence", pa.string())]))


def load_report(path: str | Path) -> Report:
    """The report in `path` (the directory `tally reconcile -o` wrote, or its report.json)."""
    out = Path(path)
    if out.name == "report.json":
        out = out.parent
    try:
        data = json.loads((out / "report.json").read_text())
    except FileNotFoundError:
        raise TallyError(f"no report.json in {out}: give the directory `tally reconcile -o` "
                         "wrote") from None
    except ValueError as exc:
        raise TallyError(f"{out / 'report.json'} is not JSON: {exc}") from None
    tables = {name: _table(out / f"{name}.parquet") for name in TABLES}
    records = out / "records"
    tables["records"] = ds.dataset(records, format="parquet").to_table() \
        if records.is_dir() else pa.table({})
    findings = [Finding(f["severity"], f["code"], f["message"], f.get("numbers") or {},
                        f.get("evidence")) for f in data.get("findings", [])]
    return Report(out, data, data["verdict"], findings, _coverage(data["coverage"]),
                  tables=tables, **tables)


def _table(path: Path) -> pa.Table:
    return pq.read_table(path) if path.exists() else pa.table({})


def _coverage(c: dict[str, Any]) -> Coverage:
    """The report's coverage answer as tally.audit.core.exposure.Coverage (its one home)."""
    h = c["histogram"]
    return Coverage(c["train_records"], c["exposures"], c["seen"], h["2"] + h["3+"], h["3+"],
                    c.get("excess_exposures"), c.get("missing_exposures"))
