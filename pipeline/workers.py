"""The worker processes a Beam job of Tally's starts on this machine, as quiet as the command.

The command's own process drops other libraries' log lines below ERROR (tally.audit.cli); its
workers are other processes and printed theirs: every Beam import logs "apitools not found,
and bigquery client libraries are not available" at WARNING (Tally reads no BigQuery), and an
SDK worker of `--mode multi_processing` about 20 INFO lines on its channels. What a worker
logs still reaches the runner through Beam's logging service, and its errors still print.

- `python -m tally.pipeline.workers`: Beam's SDK worker (tally.pipeline.runners, FnApiRunner
  multi_processing), quiet first.
- a local Dask cluster's workers preload this module (tally.pipeline.runners._dask_cluster).

Light on purpose: imported before apache_beam, whose import is what logs. Beam's cloud
filesystems are left out here as in the command (tally.pipeline.beam_filesystems): these
workers run its direct runner's and local Dask cluster's work.
"""

from __future__ import annotations

import logging
import sys

from tally.pipeline import beam_filesystems


def quiet() -> None:
    """Other libraries' log lines below ERROR stay off this process's stderr: a root handler
    at ERROR, in place before they log (a root logger without a handler gets a default one,
    at any level, at the first `logging.warning`)."""
    root = logging.getLogger()
    if any(getattr(h, "_tally_quiet", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.ERROR)
    handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
    handler._tally_quiet = True  # type: ignore[attr-defined]
    root.addHandler(handler)


def dask_setup(worker: object) -> None:
    """Dask's preload hook (the import already did the work)."""


quiet()
beam_filesystems.local_only()

if __name__ == "__main__":
    from apache_beam.runners.worker import sdk_worker_main

    sdk_worker_main.main(sys.argv)
