"""Where a report came from: the Tally version that wrote it, the command line that asked for it
and each input's path and fingerprint, so that a report.json or diff.json found on a ticket
can be traced and remade. One home for report.json's and diff.json's `provenance` block."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import xxhash

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


def file_print(name: str, n: int) -> int:
    """One input file's part of a files fingerprint: xxh3_128 of its name and row count (or
    size). A fingerprint sums its files' parts, so that it is the same in any order and can be
    made as files come: the live reconcile adds a round's new files instead of sorting and
    hashing every file's name again (0.5 us a file a round, ~0.9 s at the seed's ~1.8M
    segment files)."""
    return xxhash.xxh3_128_intdigest(f"{name}\0{n}".encode())


def fingerprint(printed: int) -> str:
    """A files fingerprint from its files' parts summed (`file_print`)."""
    return f"{printed % 2**128:032x}"[:16]


def files_fingerprint(files: Iterable[tuple[str, int]]) -> str:
    """A fingerprint of a set of input files: each file's name and row count (or size). Two
    reports over the same spool files agree; a file added, removed or rewritten with other
    rows changes it."""
    return fingerprint(sum(file_print(name, n) for name, n in files))


def input_print(f: Any) -> int:
    """`file_print` of a plan's input file (tally.audit.buckets.plan.InputFile): a spool file
    by its path in the spool (run/attempt=A/host=H/name: every host has files of the same
    names) and its size, a ledger export's by its name and rows."""
    if f.spool_file is None:
        return file_print(os.path.basename(f.path), int(f.rows))
    size = f.bytes  # as listed: a stat a file was 0.11 s a round at 13,000 files in the
    try:            # live reconcile
        size = os.stat(f.path).st_size if size is None else size
    except OSError:
        size = f.rows
    return file_print(f.spool_file.rel, int(size))


def plan_fingerprint(files: Iterable[Any], printed: int | None = None) -> str:
    """`files_fingerprint` of a plan's input files, or of their parts summed already
    (`printed`, as `spool_inputs` gathers them)."""
    return fingerprint(sum(input_print(f) for f in files) if printed is None else printed)


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
