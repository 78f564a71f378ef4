"""The command line's conventions, run as real processes: --version, examples and exit codes in
the help, -q and --json, progress on stderr, -q silencing Beam's worker processes, the report
loaded for a notebook, and the lean base install (a fresh virtual environment) whose commands
say which extra they miss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tally.audit.cli import build_parser
from tally.audit.hook.writer import LedgerWriter
from tests.support import ROOT
from tests.support.batches import unpacked_batch
from tests.support.cli import tally_bare

QUIET_AND_JSON = {"ingest", "manifest", "reconcile", "diff", "exposure", "compare", "preflight"}


def _commands(parser) -> dict:
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    out = {}
    for name, p in sub.choices.items():
        out[name] = p
        out.update({f"{name} {k}": v for k, v in _commands(p).items()} if any(
            a.__class__.__name__ == "_SubParsersAction" for a in p._actions) else {})
    return out


def test_version_examples_exit_codes_quiet_and_json_in_the_help():
    r = tally_bare("--version")
    assert r.returncode == 0 and r.stdout.startswith("tally 0.")
    top = tally_bare("--help").stdout
    for code in ("0 ", "1 ", "2 ", "130 "):
        assert f"\n  {code}" in top, top
    for name, p in _commands(build_parser()).items():
        text = p.format_help()
        assert "examples:\n  tally " + name.split()[0] in text, name
        flags = {o for a in p._actions for o in a.option_strings}
        if name in QUIET_AND_JSON:
            assert {"-q", "--json"} <= flags, name
    assert "-q" in {o for a in _commands(build_parser())["serve"]._actions
                    for o in a.option_strings}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("small")
    assert tally_bare("corpus", "synth", "corpus", "--records", "300", "--length-scale", "0.1",
                      "--max-len", "128", cwd=tmp).returncode == 0
    assert tally_bare("manifest", "corpus", "-o", "m.parquet", "-q", cwd=tmp).returncode == 0
    for h in range(2):
        with LedgerWriter(tmp / "spool", "r", host=h, host_count=2) as w:
            for s in range(10):
                w.write_batch(s, unpacked_batch(s, host=h, hosts=2, n_records=290))
    return tmp


@pytest.mark.slow
def test_progress_on_stderr_and_quiet_json_with_beam_workers_silenced(small):
    r = tally_bare("reconcile", "--spool", "spool", "--manifest", "m.parquet", "--run", "r", "-o",
                   "rep", cwd=small)
    assert r.returncode == 0 and r.stdout.startswith("run r: PASS"), r.stderr
    # Into a pipe: a line per stage, no redraws (tests/test_logs.py).
    assert "tally: [info] reconcile r: key buckets (2 parts)" in r.stderr
    assert "\r" not in r.stderr
    # Worker processes print 40 lines of INFO (and "apitools not found") without -q.
    r = tally_bare("reconcile", "--spool", "spool", "--manifest", "m.parquet", "--run", "r", "-o",
                   "rep-q", "--mode", "multi_processing", "-q", "--json", cwd=small)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    got = json.loads(r.stdout)
    assert got["verdict"] == "PASS" and got["report"] == str(Path("rep-q") / "report.json")
    # An error still says its one line under -q.
    r = tally_bare("reconcile", "--spool", "spool", "--manifest", "m.parquet", "--run", "nope",
                   "-o", "rep-n", "-q", cwd=small)
    assert r.returncode == 2 and r.stderr.startswith("tally: error: no segment files")


@pytest.mark.slow
def test_load_report_gives_typed_objects_and_arrow_tables(small):
    from tally import audit
    if not (small / "rep" / "report.json").exists():
        assert tally_bare("reconcile", "--spool", "spool", "--manifest", "m.parquet", "--run", "r",
                          "-o", "rep", "-q", cwd=small).returncode == 0
    rep = audit.load_report(small / "rep")
    data = json.loads((small / "rep" / "report.json").read_text())
    assert (rep.run_id, rep.verdict) == ("r", data["verdict"])
    assert rep.coverage.to_dict().items() <= data["coverage"].items()
    assert [f.code for f in rep.findings] == [f["code"] for f in data["findings"]]
    assert rep.steps.num_rows == 10 and rep.hosts.num_rows == 2
    assert rep.records.num_rows == 300 and "exposures" in rep.records.column_names
    assert rep.findings_table().num_rows == len(rep.findings)
    with pytest.raises(audit.TallyError, match="no report.json"):
        audit.load_report(small)


@pytest.mark.slow
def test_the_lean_base_install_writes_and_ingests_and_names_missing_extras(tmp_path):
    """A fresh virtual environment with the base install only (pip reuses its wheel cache;
    about 30 s here, --no-compile)."""
    venv = tmp_path / "lean"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                          "install", "-q", "--no-compile", "-e", str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    py, exe = str(venv / "bin" / "python"), str(venv / "bin" / "tally")
    heavy = subprocess.run([py, "-c", "import importlib.util as u; print([m for m in ("
                            "'apache_beam', 'jax', 'flax', 'grain', 'fastapi', 'dask', 'torch')"
                            " if u.find_spec(m)])"], capture_output=True, text=True)
    assert heavy.stdout.strip() == "[]", heavy.stdout + heavy.stderr
    # A PyTorch-style host in a user's repository with packages of its own named like the
    # repository's folders: both import, Tally's through its namespace.
    for own in ("audit", "pipeline", "api", "trainer"):
        (tmp_path / own).mkdir()
        (tmp_path / own / "__init__.py").write_text(f"OWNER = 'user {own}'\n")
    # The writer, then ingest and the ledger.
    host = subprocess.run([py, "-c", """
import numpy as np
import audit, pipeline
from tally.audit import LedgerWriter
assert (audit.OWNER, pipeline.OWNER) == ("user audit", "user pipeline")
with LedgerWriter("spool", "torch-run", host=0, host_count=1, records_per_epoch=100) as w:
    for s in range(3):
        w.write_batch(s, {"tokens": np.ones((4, 8), np.int32), "key": np.arange(4) + 4 * s,
                          "tokens_segment_ids": np.ones((4, 8), np.int32)})
    w.finish()
"""], cwd=tmp_path, capture_output=True, text=True)
    assert host.returncode == 0, host.stderr
    run = lambda *a: subprocess.run([exe, *a], cwd=tmp_path, capture_output=True,  # noqa: E731
                                    text=True, timeout=120)
    r = run("ingest", "spool", "--ledger", "l.duckdb", "-q", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["files"] == 2, r.stderr
    assert "attempt 0: fresh start, 1 host(s), 12 segments" in run("ledger", "l.duckdb").stdout
    for args, extra in ((["serve", "--ledger", "l.duckdb"], "api"),
                        (["reconcile", "--spool", "spool", "--manifest", "m", "--run", "r",
                          "-o", "o"], "beam"),
                        (["train"], "train"), (["compare", "a", "b"], "train"),
                        (["preflight", "--run", "r", "--ledger", "l.duckdb", "--manifest", "m",
                          "--checkpoint", "c", "--hosts", "1"], "train"),
                        (["demo"], "all")):
        r = run(*args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (args, r.stderr)
        assert r.stderr.startswith(f"tally: error: 'tally {args[0]}' needs the {extra} extra")
        assert f"pip install 'tally-audit[{extra}]'" in r.stderr


def test_the_installed_namespace_lists_every_package_and_nothing_imports_around_it():
    """Installed, the four folders are tally.audit, tally.pipeline, tally.trainer, tally.api
    (pyproject's package-dir): a package left off the list would be missing from a wheel, and a
    bare `import audit` would work here (the repository root) and fail in a user's install."""
    import re
    import tomllib

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = {v: k for k, v in conf["package-dir"].items()}
    found = {tops[p.parent.parts[len(ROOT.parts)]] + "".join(
        "." + part for part in p.parent.parts[len(ROOT.parts) + 1:])
        for top in tops for p in (ROOT / top).rglob("__init__.py")}
    assert sorted(conf["packages"]) == sorted(found)
    bare = re.compile(r"^\s*(from|import) (audit|pipeline|trainer|api)\b|-m (audit|pipeline|trainer"
                      r"|api)\.", re.M)
    offenders = [str(p.relative_to(ROOT)) for d in (*tops, "tests", "bench")
                 for p in (ROOT / d).rglob("*.py")
                 if p.name != "test_cli_conventions.py" and bare.search(p.read_text())]
    manual = [ROOT / "README.md", ROOT / "docker-compose.yml", *(ROOT / "docs").rglob("*.md")]
    offenders += [str(p.relative_to(ROOT)) for p in manual if bare.search(p.read_text())]
    assert offenders == []


@pytest.mark.parametrize("runner", ["direct", "DataflowRunner"])
def test_a_job_run_here_leaves_beams_cloud_filesystems_unloaded(tmp_path, runner):
    """A reconcile on the direct runner (its process, and so its workers') runs without Beam's
    cloud filesystems, whose client libraries (here through MosaicML Streaming and litdata)
    cost 0.3 CPU s of every such process's start; the job runs as before. A job for a runner
    by name keeps them: Dataflow stages through cloud storage (only parsed here, never run)."""
    from tests.support.api import write_steps
    from tests.support.manifest import uniform_manifest

    assert write_steps(tmp_path / "spool", "r", host=0, hosts=1, steps=range(4), n=30,
                       seed=0) == 32
    uniform_manifest(tmp_path / "m.parquet", 30)
    job = (f"main(['reconcile', '--spool', {str(tmp_path / 'spool')!r}, '--manifest', "
           f"{str(tmp_path / 'm.parquet')!r}, '--run', 'r', '-o', {str(tmp_path / 'rep')!r}, "
           f"'-q', '--runner', 'direct'])" if runner == "direct" else
           f"parse(['reconcile', '--spool', 's', '--manifest', 'm', '--run', 'r', '-o', 'o', "
           f"'--runner', {runner!r}])")
    probe = f"""if True:
        import sys
        from tally.audit.cli import main, parse
        print({job})
        from apache_beam.io.filesystems import FileSystems
        try:
            print(type(FileSystems.get_filesystem("gs://bucket/x")).__name__)
        except ValueError:
            print("none")
        print("azure.storage.blob" in sys.modules)"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                              "TALLY_SUPERVISED": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    if runner == "direct":
        assert lines[-3:] == ["0", "none", "False"], out.stdout
        report = json.loads((tmp_path / "rep" / "report.json").read_text())
        assert report["coverage"]["exposures"] == 24  # every fourth row continues a record
    else:  # the libraries are there: without the switch, Beam loads them
        assert lines[-2:] == ["GCSFileSystem", "True"], out.stdout


def test_the_schema_and_the_training_hosts_writer_load_without_pandas(tmp_path):
    """pyarrow's conversions (`pa.array`, `from_pydict`, `to_numpy`, `to_pandas_dtype`) load
    pandas, 0.26-0.4 s here: the schema's dtypes must not, since every training host and every
    command's child imports them, nor the writer's publishing (a host's writer thread took
    that time at its first file, holding the GIL); and the dtypes and tables are what Arrow's
    own conversions give."""
    import numpy as np
    import pyarrow as pa

    from tally.audit.core.schema import (
        METRIC_SCHEMA,
        SEGMENT_COLUMNS_ALL,
        SEGMENT_DTYPES,
        SEGMENT_SCHEMA_WITH_LOSS,
        arrow_table,
    )

    probe = f"""if True:
        import sys
        import numpy as np
        import tally.audit.core.schema
        from tally.audit.hook.writer import LedgerWriter
        batch = {{"tokens": np.arange(64, dtype=np.int32).reshape(2, 32),
                  "tokens_segment_ids": np.ones((2, 32), np.int32),
                  "key": np.repeat([[3], [5]], 32, axis=1), "pos": np.tile(np.arange(32), (2, 1))}}
        with LedgerWriter({str(tmp_path / "spool")!r}, "r", flush_every=1) as w:
            w.write_batch(0, batch, loss=np.full((2, 31), 0.5, np.float32))
            w.log_metrics([(0, "train_loss", 0.5)])
        print('pandas' in sys.modules)"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["False"], out.stderr[-2000:]
    assert {p.name[:3] for p in (tmp_path / "spool").rglob("*.parquet")} == {"seg", "met"}
    for c in SEGMENT_COLUMNS_ALL:
        assert SEGMENT_DTYPES[c.name] == pa.array([], c.arrow).to_numpy().dtype, c.name
    rng = np.random.default_rng(0)
    cols = {c.name: rng.integers(0, 100, 5).astype(c.dtype) for c in SEGMENT_COLUMNS_ALL}
    cols["loss"][1] = np.nan
    cols["content_hash"][0] = np.uint64(2**64 - 1)
    metrics = {"step": (0, 1), "host": [2, 2], "name": ("train_loss", "ppl/wéb"),
               "value": (0.5, float("nan"))}
    for schema, values, floats in ((SEGMENT_SCHEMA_WITH_LOSS, cols, "loss"),
                                   (METRIC_SCHEMA, metrics, "value")):
        ours, theirs = arrow_table(schema, values), pa.Table.from_pydict(values, schema=schema)
        ours.validate(full=True)
        assert ours.schema == theirs.schema and ours[floats].null_count == 0
        assert ours.drop_columns([floats]).equals(theirs.drop_columns([floats]))
        assert np.array_equal(ours[floats].to_numpy(), theirs[floats].to_numpy(),
                              equal_nan=True)  # Arrow's equals holds NaN unequal to itself
    with pytest.raises(ValueError, match="row: values do not fit int32"):
        arrow_table(SEGMENT_SCHEMA_WITH_LOSS, {**cols, "row": np.array([2**31] * 5)})
    with pytest.raises(TypeError, match="flag: bool is not built from buffers"):
        arrow_table(pa.schema([("flag", pa.bool_())]), {"flag": [True]})  # Arrow packs bits
