"""The manual's code blocks, all of them: README.md's, then each docs page's in the site's nav
order (mkdocs.yml; a page may use what an earlier one made), run in order in one empty
directory, as a reader would.

Blocks marked `bash cluster` need a cluster (Dask scheduler, Dataflow, Flink, Spark): each of
their commands is parsed by the real CLI and its Beam options by Beam's own parser. The first
two blocks are README's set-up commands: the demo they end in is run by tests/test_cli.py and
the test command is what .ci/run runs.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from tally.audit.cli import parse
from tests.support import ROOT

BLOCK = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```$", re.M | re.S)
SETUP = ("python3.11 -m venv .venv && .venv/bin/pip install -e '.[all]' && .venv/bin/tally demo",
         "python3.11 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/pytest -q")


def pages() -> list[Path]:
    """README.md, the site's pages in nav order, then any other page under docs/ (none is left
    unrun): the order in which the blocks run."""
    import yaml

    def paths(nav) -> list[str]:
        items = nav if isinstance(nav, list) else list(nav.values())
        return [p for item in items for p in ([item] if isinstance(item, str) else paths(item))]

    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = ROOT / site.get("docs_dir", "docs")
    ordered = [ROOT / "README.md"] + [docs / p for p in paths(site["nav"]) if p != "index.md"]
    return ordered + sorted(set(docs.rglob("*.md")) - set(ordered))


def page_blocks() -> list[tuple[Path, str, str, str]]:
    """(page, language, the fence's other words, code) for every block of the manual."""
    return [(page, m.group(1), m.group(2).strip(), m.group(3)) for page in pages()
            for m in BLOCK.finditer(page.read_text())]


def blocks() -> list[tuple[str, str, str]]:
    return [(lang, attrs, code) for _, lang, attrs, code in page_blocks()]


def test_readme_opens_with_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    first = text.split("\n## ", 1)[0]
    found = [code.strip() for lang, _, code in blocks()[:2]]
    assert found == list(SETUP) and first.count("```bash") == 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert ".venv/bin/pip install -q -e '.[test]'" in ci and ci.rstrip().endswith(
        ".venv/bin/pytest -q")


def _check_cluster_commands(code: str) -> int:
    from apache_beam.options.pipeline_options import PipelineOptions

    n = 0
    for line in filter(None, map(str.strip, code.splitlines())):
        words = shlex.split(line)
        assert words[0] == "tally", line
        args = parse(words[1:])
        if args.beam_args:
            opts = PipelineOptions(args.beam_args)
            unknown = (set(opts.get_all_options(retain_unknown_options=True))
                       - set(opts.get_all_options()))
            assert not unknown, f"{line}: Beam does not know {sorted(unknown)}"
        n += 1
    return n


def _free_port() -> int:
    from tally.trainer.launch import free_port

    return free_port()


def test_every_block_runs_in_order(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    port = str(_free_port())
    background: list[subprocess.Popen] = []
    ran = {"bash": 0, "python": 0, "cluster": 0}
    try:
        for page, lang, attrs, code in page_blocks()[2:]:
            where = page.relative_to(ROOT)
            code = code.replace("8000", port)
            if lang == "bash" and attrs == "cluster":
                ran["cluster"] += _check_cluster_commands(code)
                continue
            assert lang in ("bash", "python"), f"{where}: a block in {lang!r}: nothing runs it"
            if lang == "bash" and code.rstrip().endswith("&"):
                background.append(subprocess.Popen(
                    ["bash", "-c", code.rstrip()[:-1]], cwd=tmp_path, env=env,
                    start_new_session=True))
                continue
            cmd = (["bash", "-euo", "pipefail", "-c", code] if lang == "bash"
                   else [sys.executable, "-c", code])
            done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert done.returncode == 0, (
                f"{where}: {lang} block failed:\n{code}\n--- stdout\n{done.stdout[-3000:]}"
                f"\n--- stderr\n{done.stderr[-3000:]}")
            ran[lang] += 1
    finally:
        for p in background:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(30)
    assert ran["bash"] >= 6 and ran["python"] >= 4 and ran["cluster"] >= 6, ran
    # What the blocks made is real: the tour's report, the verdicts, the attached loops' spools.
    import json

    assert json.loads((tmp_path / "report" / "report.json").read_text())["verdict"] == "PASS"
    assert json.loads((tmp_path / "verdict.json").read_text())["status"] == "unsafe"
    for spool in ("spool-grain", "spool-maxtext", "spool-torch"):
        assert list((tmp_path / spool).rglob("seg-*.parquet")), spool
    torch_run = json.loads((tmp_path / "report-torch" / "report.json").read_text())
    assert [f["code"] for f in torch_run["findings"] if f["severity"] == "FAIL"] == ["padding"]
    assert torch_run["coverage"]["epoch_duplicate_records"] == 4
