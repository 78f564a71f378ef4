"""The manual as a site (issue 34, point 7): README.md and docs/ built by MkDocs with --strict
(every link between pages and every anchor resolves), offline (no page or stylesheet asks
another host for anything), every page in the nav; and every relative link of README.md and the
docs pages leads, on the repository too, to a file that exists and a heading it has."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.test_readme import nav, pages, slug

# Builds the MkDocs site (--strict) and checks every page.
pytestmark = pytest.mark.slow

# What would make a page fetch from another host: a script, a stylesheet, an import in CSS,
# a web font service.
REMOTE = re.compile(r"""<script[^>]+src=["']?(https?:)?//|<link[^>]+href=["']?(https?:)?//"""
                    r"""|@import\s+(url\()?["']?(https?:)?//|fonts\.googleapis|fonts\.gstatic""",
                    re.I)
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCED = re.compile(r"^```.*?^```$", re.M | re.S)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site") / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_site_builds_strict_and_fetches_nothing(site):
    built = [p for p in site.rglob("*") if p.suffix in (".html", ".css", ".js")]
    assert (site / "index.html").exists() and len(built) > 10
    remote = {str(p.relative_to(site)): m.group(0) for p in built
              if (m := REMOTE.search(p.read_text(errors="replace")))}
    assert remote == {}
    # The home page is README itself, its links made the site's own.
    home = (site / "index.html").read_text()
    assert "A tour" in home and 'href="guides/attach.html"' in home


def test_every_page_is_in_the_nav_and_every_guide_is_linked_from_readme():
    docs, listed = nav()
    assert sorted(listed) == sorted(["index.md"] + [str(p.relative_to(docs))
                                                    for p in docs.rglob("*.md")])
    readme = (ROOT / "README.md").read_text()
    assert all(f"(docs/guides/{p.name})" in readme for p in (docs / "guides").glob("*.md"))


def _anchors(page: Path) -> set[str]:
    text = FENCED.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_relative_links_lead_to_files_and_headings_that_exist():
    """As read on the repository: MkDocs checks the site's view of the same links."""
    broken = []
    for page in pages():
        for target in LINK.findall(FENCED.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md"
                                     and anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []
