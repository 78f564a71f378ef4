"""The manual's code blocks, all of them: README.md's, then each docs page's in the site's nav
order (mkdocs.yml; a page may use what an earlier one made), run in order as a reader would.

They run in two directories, one test each, so that pytest-xdist's two workers share them
(`--dist loadfile`): the tour and all that builds on it here, and the sections in APART, which
make their own corpora and datasets, in tests/test_manual_apart.py. Blocks marked `bash cluster`
need a cluster (Dask scheduler, Dataflow, Flink, Spark): each of their commands is parsed by the
real CLI and its Beam options by Beam's own parser. The first two blocks are README's set-up
commands: the demo they end in is run by tests/test_cli.py and the test command is what .ci/run
runs.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tally.audit.cli import parse
from tests.support import ROOT

# Every runnable block of README and the guides, in order (minutes).
pytestmark = pytest.mark.slow

BLOCK = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```$", re.M | re.S)
SETUP = ("python3.11 -m venv .venv && .venv/bin/pip install -e '.[all]' && .venv/bin/tally demo",
         "python3.11 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/pytest -q")


# Sections that build on nothing the tour made, by page and heading anchor (a page's own path
# alone: all of it). A block belongs to the headings above it; these run apart, in order.
APART = {
    "docs/guides/corpus.md": (),
    "docs/guides/attach.md": ("hugging-face-datasets", "mosaicml-streaming", "litdata",
                              "olmo-core", "attaching-tally-to-a-grain-dataloader"),
}
HEADING = re.compile(r"^(#{1,6}) (.+)$", re.M)


@dataclass(frozen=True)
class Block:
    page: Path
    lang: str
    attrs: str  # the fence's words after the language
    code: str
    sections: tuple[str, ...]  # the anchors of the headings it is under, outermost first

    @property
    def apart(self) -> bool:
        where = str(self.page.relative_to(ROOT))
        return where in APART and (not APART[where] or bool(set(APART[where])
                                                             & set(self.sections)))


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub (and MkDocs' toc, for the manual's headings) makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def nav() -> tuple[Path, list[str]]:
    """The site's docs folder and its nav's pages, in order (mkdocs.yml)."""
    import yaml

    def paths(items) -> list[str]:
        items = items if isinstance(items, list) else list(items.values())
        return [p for item in items for p in ([item] if isinstance(item, str) else paths(item))]

    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return ROOT / site.get("docs_dir", "docs"), paths(site["nav"])


def pages() -> list[Path]:
    """README.md (the site's index.md), the site's pages in nav order, then any other page under
    docs/ (none is left unrun): the order in which the blocks run."""
    docs, listed = nav()
    ordered = [ROOT / "README.md"] + [docs / p for p in listed if p != "index.md"]
    return ordered + sorted(set(docs.rglob("*.md")) - set(ordered))


def page_blocks() -> list[Block]:
    """Every block of the manual, in the order they run."""
    found = []
    for page in pages():
        text = page.read_text()
        fences = [(m.start(), m.end()) for m in BLOCK.finditer(text)]
        headings = [(m.start(), len(m.group(1)), slug(m.group(2)))
                    for m in HEADING.finditer(text)
                    if not any(a <= m.start() < b for a, b in fences)]
        for m in BLOCK.finditer(text):
            stack: list[tuple[int, str]] = []
            for at, level, anchor in headings:
                if at > m.start():
                    break
                stack = [h for h in stack if h[0] < level] + [(level, anchor)]
            found.append(Block(page, m.group(1), m.group(2).strip(), m.group(3),
                               tuple(a for _, a in stack)))
    return found


def blocks() -> list[tuple[str, str, str]]:
    """(language, the fence's other words, code) for every block of the manual."""
    return [(b.lang, b.attrs, b.code) for b in page_blocks()]


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


def run_in_order(chosen: list[Block], cwd: Path) -> dict[str, int]:
    """Run the blocks one after another in cwd, as a reader would; a block ending in `&` keeps
    running in the background until the last is done. What ran, by kind."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    port = str(_free_port())
    background: list[subprocess.Popen] = []
    ran = {"bash": 0, "python": 0, "cluster": 0}
    try:
        for block in chosen:
            where, lang, code = block.page.relative_to(ROOT), block.lang, block.code
            code = code.replace("8000", port)
            if lang == "bash" and block.attrs == "cluster":
                ran["cluster"] += _check_cluster_commands(code)
                continue
            assert lang in ("bash", "python"), f"{where}: a block in {lang!r}: nothing runs it"
            if lang == "bash" and code.rstrip().endswith("&"):
                background.append(subprocess.Popen(
                    ["bash", "-c", code.rstrip()[:-1]], cwd=cwd, env=env,
                    start_new_session=True))
                continue
            cmd = (["bash", "-euo", "pipefail", "-c", code] if lang == "bash"
                   else [sys.executable, "-c", code])
            done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert done.returncode == 0, (
                f"{where} ({'/'.join(block.sections)}): {lang} block failed:\n{code}\n"
                f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
            ran[lang] += 1
    finally:
        for p in background:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(30)
    return ran


def test_the_sections_run_apart_are_still_there():
    """APART names sections by their anchors: one renamed or moved would run with the tour."""
    every = page_blocks()[2:]
    for where, anchors in APART.items():  # a renamed heading must not leave its blocks here
        found = {a for b in every if str(b.page.relative_to(ROOT)) == where for a in b.sections}
        assert (ROOT / where).exists() and set(anchors) <= found, (where, set(anchors) - found)
    kinds = [("cluster" if b.attrs == "cluster" else b.lang) for b in every]
    assert kinds.count("bash") >= 10 and kinds.count("python") >= 8 and kinds.count(
        "cluster") >= 3, kinds


def test_the_tour_and_what_builds_on_it_run_in_order(tmp_path):
    ran = run_in_order([b for b in page_blocks()[2:] if not b.apart], tmp_path)
    assert ran["bash"] >= 6 and ran["python"] >= 4 and ran["cluster"] >= 1, ran
    # What the blocks made is real: the tour's report, the verdicts, the attached loops' spools.
    import json

    assert json.loads((tmp_path / "report" / "report.json").read_text())["verdict"] == "PASS"
    assert json.loads((tmp_path / "verdict.json").read_text())["status"] == "unsafe"
    for spool in ("spool-grain", "spool-maxtext", "spool-torch"):
        assert list((tmp_path / spool).rglob("seg-*.parquet")), spool
    torch_run = json.loads((tmp_path / "report-torch" / "report.json").read_text())
    assert [f["code"] for f in torch_run["findings"] if f["severity"] == "FAIL"] == ["padding"]
    assert torch_run["coverage"]["epoch_duplicate_records"] == 4
    _the_grain_and_pytorch_loops_see_the_same_set_per_epoch_in_another_order(tmp_path)


def _the_grain_and_pytorch_loops_see_the_same_set_per_epoch_in_another_order(tour: Path) -> None:
    """The guides' Grain loop and PyTorch loop over the tour's corpus, as `tally diff` compared
    them (diff-loaders): the same records in epoch 0, in another order, DistributedSampler's 4
    padded records twice; every number equal to the SQL reference over their ledgers; with
    `--strict`, exit status 1."""
    import json

    from tally.audit.ledger.database import Ledger
    from tally.audit.ledger.ingest import ingest
    from tally.pipeline.corpus import TokenSource
    from tests.support.cli import tally_bare
    from tests.test_posthoc import agrees

    d = json.loads((tour / "diff-loaders" / "diff.json").read_text())
    r = tally_bare("diff", "--manifest", "manifest.parquet", "-o", "diff-loaders-strict", "--a",
                   "spool-grain:grain-run", "--b", "spool-torch:torch-run", "--strict", cwd=tour)
    assert r.returncode == 1, r.stderr  # they differ: --strict says so
    assert "DIFFERENT" in r.stdout and "first divergent step 0" in r.stdout, r.stdout
    for spool in ("spool-grain", "spool-torch"):
        with Ledger(tour / f"{spool}-check.duckdb") as ledger:
            ingest(tour / spool, ledger)
    agrees(d, tour / "diff-loaders", (tour / "spool-grain-check.duckdb", "grain-run"),
           (tour / "spool-torch-check.duckdb", "torch-run"), tour / "manifest.parquet")
    n = len(TokenSource(tour / "corpus"))
    assert d["epochs"] == [{
        "epoch": 0, "exposures_a": n, "exposures_b": n + 4, "records_a": n, "records_b": n,
        "common_records": n, "jaccard": 1.0, "multiset_difference": 4, "same_set": True,
        "same_multiset": False}]
    assert d["first_divergent_step"] == 0 and d["jaccard"]["mean"] < 0.2
    assert d["records"]["more_often_b"] == 4 and d["records"]["same"] == n - 4
    assert {f["code"] for f in d["findings"]} >= {"diverged", "same_set_per_epoch",
                                                  "unequal_length"}
    said = next(f["message"] for f in d["findings"] if f["code"] == "same_set_per_epoch")
    assert said.startswith("in 1 epoch (0) both runs") and "(s)" not in said, said
