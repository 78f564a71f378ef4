"""Beam's cloud filesystems left unloaded in the processes that run Tally's jobs on this machine.

`import apache_beam` loads a filesystem for each cloud store whose client library is installed
(Azure Blob Storage, Google Cloud Storage, S3, HDFS), and MosaicML Streaming, litdata and
OLMo-core bring those libraries with them. Measured here in the `test` extra's environment, 3 runs
each way: the Beam import alone 1.51-2.35 CPU s with them, 1.14-1.32 s without; a small
reconcile's whole process (README's tour) 2.10-2.18 -> 1.80-1.87 CPU s. Every reconcile, diff
and manifest command pays that import, and so does each of its worker processes. Tally's jobs
never open a path through Beam's filesystems: they read spools, ledgers and corpora with pyarrow
and DuckDB, and on the direct runner or Dask nothing is staged.

So a process whose jobs run on the direct runner or on Dask (the command's, and the worker
processes it starts: tally.pipeline.workers) marks those modules as absent before Beam is
imported; Beam's filesystem registry skips a module that is missing, as it does for a library
that is not installed. A job given to another runner by name (Dataflow, Flink, Spark stage
through cloud storage) keeps them all. Light on purpose: imported before apache_beam.
"""

from __future__ import annotations

import sys

# apache_beam/io/filesystems.py imports each in its own `try ... except ModuleNotFoundError`.
CLOUD_FILESYSTEMS = ("apache_beam.io.azure.blobstoragefilesystem",
                     "apache_beam.io.gcp.gcsfilesystem",
                     "apache_beam.io.aws.s3filesystem",
                     "apache_beam.io.hadoopfilesystem")
LOCAL_RUNNERS = ("direct", "dask")


def local_only() -> None:
    """Leave Beam's cloud filesystems out of this process (once Beam is imported, nothing)."""
    if "apache_beam" in sys.modules:
        return
    for name in CLOUD_FILESYSTEMS:
        sys.modules.setdefault(name, None)  # an import of a None entry: ModuleNotFoundError
