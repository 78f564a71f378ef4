"""The record-key bucket jobs' shared floor: what reconcile (tally.audit.reconcile) and the
post-hoc diff (tally.audit.posthoc.diff) both build on, and neither owns.

- `plan`: what a job reads (a run's spool files or a ledger export: `Inputs`, `spool_inputs`,
  `ledger_inputs`), how it cuts the work (`chunks`, record-key buckets sized to the memory
  budget), decided once (`make_plan` with its `PlanOptions`, giving a `Plan`).
- `exchange`: consumption rows cut into key buckets and exchanged through bucket files.
- `partials`: the typed partial results and their merge rules (`Partial`, `Mergeable`,
  `merge_all`, `Spans`).
- `host_steps`: what each host consumed step by step (per file; merged by the report).
- `stages`: the Beam stages both jobs share (`ReadConsumption`, `manifest_bucket`, partials
  saved and loaded, per-record parts published).
- `left_out`: the input files a job left out, counted and said alike by every job.

Arrows: core, hook, ledger (the export), pipeline; never reconcile or posthoc.
"""

__all__ = ["exchange", "host_steps", "left_out", "partials", "plan", "stages"]
