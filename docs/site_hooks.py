"""MkDocs hooks (mkdocs.yml): README.md is the site's home page, so the manual has one text that
reads the same on the repository and on the site."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

README = Path(__file__).resolve().parent.parent / "README.md"
# A Markdown link's target: ](target) or ](target#anchor).
LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")
# A fence's words after its language (```bash cluster) are for tests/test_readme.py; Python
# Markdown takes a fence with them for a paragraph.
FENCE_WORDS = re.compile(r"^(```\w+) [^\n]*$", re.M)


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "index.md", abs_src_path=str(README)))
    return files


def _repository_path(src_uri: str) -> str:
    return "README.md" if src_uri == "index.md" else f"docs/{src_uri}"


def _site_target(target: str, src_uri: str) -> str:
    """A relative link written for the repository, as the site's page at src_uri needs it."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return target
    here = posixpath.dirname(_repository_path(src_uri))
    path = posixpath.normpath(posixpath.join(here, target))
    site = "index.md" if path == "README.md" else path.removeprefix("docs/")
    return posixpath.relpath(site, posixpath.dirname(src_uri) or ".")


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    src = page.file.src_uri
    markdown = LINK.sub(lambda m: f"]({_site_target(m.group(1), src)}{m.group(2) or ''})",
                        markdown)
    return FENCE_WORDS.sub(r"\1", markdown)
