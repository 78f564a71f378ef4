"""Where a report came from: the Tally version that wrote it, the command line that asked for it
and each input's path and fingerprint, so that a report.json or diff.json found on a ticket
can be traced and remade. One home for report.json's and diff.json's `provenance` block."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tally.audit.extras import version


def command_line(argv: list[str] | None = None) -> list[str]:
    """The command as typed: `tally ...` whether it ran as the `tally` script or as
    `python -m tally.audit.cli` (whose argv[0] is the module's file)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return []
    head = Path(argv[0])
    if head.name in ("tally", "cli.py", "__main__.py") or head.name.startswith("tally"):
        argv[0] = "tally"
    return argv


def files_fingerprint(files: Iterable[tuple[str, int]]) -> str:
    """A fingerprint of a set of input files: each file's name and row count (or size), in name
    order. Two reports over the same spool files agree; a file added, removed or rewritten
    with other rows changes it."""
    h = hashlib.sha256()
    for name, n in sorted(files):
        h.update(f"{name}\0{n}\n".encode())
    return h.hexdigest()[:16]


def plan_fingerprint(files: Iterable[Any]) -> str:
    """`files_fingerprint` of a plan's input files (tally.audit.buckets.plan.InputFile): a spool's
    file names relative to the spool with their sizes, a ledger export's with its rows."""
    out = []
    for f in files:
        size = getattr(f, "bytes", None)  # as listed: a stat a file was 0.11 s a round at
        try:                              # 13,000 files in the live reconcile
            size = os.stat(f.path).st_size if size is None else size
        except OSError:
            size = f.rows
        # A spool file by its path in the spool (run/attempt=A/host=H/name: every host has
        # files of the same names), a ledger export's by its name.
        name = f.spool_file.rel if f.spool_file is not None else os.path.basename(f.path)
        out.append((name, int(size) if f.spool_file is not None else int(f.rows)))
    return files_fingerprint(out)


def provenance(inputs: list[dict[str, Any]], argv: list[str] | None = None) -> dict[str, Any]:
    """The `provenance` block: {tally_version, command_line, inputs: [{role, kind, path,
    fingerprint}]}."""
    return {"tally_version": version(), "command_line": command_line(argv),
            "inputs": [{k: (str(v) if k == "path" and v is not None else v)
                        for k, v in i.items()} for i in inputs]}


def provenance_html(p: dict[str, Any] | None) -> str:
    """The block as a small footer paragraph (report.html, diff.html)."""
    import html
    import shlex

    if not p:
        return ""
    ins = "; ".join(f"{html.escape(str(i.get('role', i.get('kind', ''))))} "
                    f"<code>{html.escape(str(i['path']))}</code> "
                    f"(fingerprint <code>{html.escape(str(i.get('fingerprint')))}</code>)"
                    for i in p.get("inputs", []))
    return (f'<p class="provenance" data-provenance><small>Tally {html.escape(p["tally_version"])}'
            f'; command <code>{html.escape(shlex.join(p.get("command_line", [])))}</code>; '
            f"inputs: {ins}.</small></p>")
