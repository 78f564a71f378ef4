"""What many test files share, in one place each (docs/DESIGN.md, "Testing"):

- `cli`: the `tally` command line, run as a user runs it (a child process) or in this process.
- `processes`: Python snippets in a child process, and resource limits for one.
- `batches`: deterministic batches for the real LedgerWriter.
- `spool`: a run's spool read back whole, in (step, host, row) order.
- `manifest`: small manifests of keyed records, written through tally.pipeline.manifest_file.
- `corpus`: synthetic token corpora (and their manifests), built once per test session.
- `api`: a real uvicorn server on 127.0.0.1, spool steps through the real writer, polling.
- `browser`: headless Chromium over the DevTools protocol.
- `text_corpus`: documents, a tokenizer and an independent reference of the text hashes.
- `olmo_stack`: a user's Grain stack as MaxText's OLMo pipeline builds it (`--loader`).
- `loader_workers`: a script: the keyed loader with Grain worker processes.
- `layers`: the order test files start in (the longest first).

The oracles the benchmarks share (the SQL references, the Dask cluster) live in bench/reference.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: the working directory of commands
