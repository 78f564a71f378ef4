"""The commands of `tally`, each parser beside its handler: one module per command or family
(train and compare, diff and exposure), each with `add_parser(subparsers)` adding its
parser(s) with their handler as `func`. `tally.audit.cli` builds the parser from `COMMANDS`, in
the order `tally --help` lists them, and dispatches; `options` and `common` are what the
commands share (argparse types and option groups; console, logs, ledger errors, and the
signal handling, `SIGNALS`, the dispatcher installs around a command).

Importing these modules is cheap (argparse only): every handler imports its role's packages
when it runs, so that `tally --help` and the lean base install's commands start fast."""

from tally.audit.commands import (
    corpus,
    demo,
    ingest,
    ledger,
    manifest,
    posthoc,
    preflight,
    reconcile,
    replay,
    serve,
    train,
)
from tally.audit.commands.common import SIGNALS

COMMANDS = (ingest, ledger, corpus, manifest, reconcile, train, serve, preflight, posthoc, replay,
            demo)
__all__ = ["COMMANDS", "SIGNALS"]
