"""Every package's public face: its `__init__.py` declares in `__all__` what its siblings may
use (a submodule, or a name it exports), and no module of another package imports past it
(docs/DESIGN.md, code layout). Read from the code's own import statements; tests and
benchmarks, which measure internals on purpose, are not siblings."""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

import pytest

from tests.support import ROOT

# The installed name of each package and its folder (pyproject's package-dir).
FACES = {"tally.api": "api", "tally.pipeline": "pipeline", "tally.trainer": "trainer",
         "tally.audit.core": "audit/core", "tally.audit.hook": "audit/hook",
         "tally.audit.ledger": "audit/ledger", "tally.audit.preflight": "audit/preflight",
         "tally.audit.commands": "audit/commands", "tally.audit.buckets": "audit/buckets",
         "tally.audit.render": "audit/render", "tally.audit.reconcile": "audit/reconcile",
         "tally.audit.posthoc": "audit/posthoc"}
PRODUCT = ("api", "audit", "pipeline", "trainer")


def _imports(tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) of each import statement."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
    return found


@functools.cache
def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def _defined(folder: Path) -> set[str]:
    """The names the modules of a package define at their top level."""
    names = set()
    for path in folder.rglob("*.py"):
        for node in _tree(path).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.ImportFrom):
                names |= {a.asname or a.name for a in node.names}
    return names


def _past_the_face(package: str, folder: str, face: set[str], root=ROOT) -> list[str]:
    """Where a module outside `folder` imports something of `package` not in its face."""
    bad = []
    for top in PRODUCT:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(folder + "/"):
                continue
            for module, names, line in _imports(_tree(path)):
                if module == package:
                    entries = names
                elif module.startswith(package + "."):
                    entries = [module[len(package) + 1:].split(".")[0]]
                else:
                    continue
                bad += [f"{rel}:{line} imports {package}.{e}" for e in entries
                        if e not in face]
    return bad


@pytest.mark.parametrize("package", sorted(FACES))
def test_siblings_import_a_package_only_through_its_face(package):
    folder = FACES[package]
    face = importlib.import_module(package).__dict__.get("__all__")
    assert isinstance(face, list) and face, f"{folder}/__init__.py declares no __all__"
    defined = _defined(ROOT / folder)
    for entry in face:  # each entry is a submodule or a name the package's modules define
        assert (ROOT / folder / f"{entry}.py").is_file() or \
            (ROOT / folder / entry / "__init__.py").is_file() or entry in defined, entry
    assert _past_the_face(package, folder, set(face)) == []


def test_an_import_past_the_face_is_found(tmp_path):
    """The check reads what it should: the ledger's per-record state and lookup index are the
    ledger's own; its queries are in its face, and the ledger's own modules are not siblings."""
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "routes.py").write_text(
        "from tally.audit.ledger import queries as q\n"
        "from tally.audit.ledger.state import RunState\n"
        "def f():\n    import tally.audit.ledger.lookup\n")
    (tmp_path / "audit" / "ledger").mkdir(parents=True)
    (tmp_path / "audit" / "ledger" / "live.py").write_text(
        "from tally.audit.ledger.state import RunState\n")
    face = set(importlib.import_module("tally.audit.ledger").__all__)
    assert _past_the_face("tally.audit.ledger", "audit/ledger", face, root=tmp_path) == [
        "api/routes.py:2 imports tally.audit.ledger.state",
        "api/routes.py:4 imports tally.audit.ledger.lookup"]
