"""The API's response models: the OpenAPI schema of every answer, with an example each.

The answers themselves are computed as plain dicts (tally.audit.ledger.queries,
tally.audit.posthoc.answers,
tally.api.alerts) and cached as encoded JSON per ledger version; these models describe them and are
not applied on the way out, so they must be exact: `extra="forbid"` publishes
`additionalProperties: false`, and the schema fuzz test (tests/test_api_schema.py) checks every
answer against them. Findings and reconcile reports are records other parts of the project
extend; their models accept more members than they name.

A content hash is returned as a string, `0x` and 16 lowercase hex digits: a 64-bit integer is
more than a JSON number holds exactly in JavaScript (2674320391848518065 reads as
...518000)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

HEX_HASH = r"^0x[0-9a-f]{16}$"
REPLAYED = ("written by `tally replay` from the loader's contract, not recorded while the run "
            "trained: what the loader feeds, not what the run consumed")
STEP_CURSOR = ("the first step of the next page of buckets: pass as `cursor` (with the same "
               "`bucket`); null on the last page")
Severity = Literal["FAIL", "WARN", "INFO", "UNKNOWN"]
Verdict = Literal["PASS", "WARN", "FAIL"]


def _exact(example: dict[str, Any] | list | None = None) -> ConfigDict:
    extra: dict[str, Any] = {} if example is None else {"examples": [example]}
    return ConfigDict(extra="forbid", json_schema_extra=extra or None)


class Strict(BaseModel):
    model_config = _exact()


# ---- coverage (tally.audit.core.exposure.Coverage, with the API's context)
# -------------------------

class Histogram(Strict):
    """Records seen 0, 1, 2 and 3+ times (the 0 bin is null when N is unknown)."""

    zero: int | None = Field(alias="0")
    one: int = Field(alias="1")
    two: int = Field(alias="2")
    three_plus: int = Field(alias="3+")


class HistogramFraction(Strict):
    zero: float = Field(alias="0")
    one: float = Field(alias="1")
    two: float = Field(alias="2")
    three_plus: float = Field(alias="3+")


class Ideal(Strict):
    """What a perfect loader gives after C exposures of N records."""

    min: int = Field(description="floor(C/N): every record seen at least this often")
    max: int = Field(description="ceil(C/N): and at most this often")
    coverage: float = Field(description="min(1, C/N)")
    never_seen: int


class CoverageNumbers(Strict):
    """Coverage of the N train records (tally.audit.core.exposure.Coverage). The members after
    `histogram` need N; the excess and missing exposures need the latest step."""

    train_records: int | None = Field(description="N; null when unknown")
    exposures: int
    seen: int
    coverage: float | None = Field(description="seen / N")
    never_seen: int | None
    histogram: Histogram
    never_seen_fraction: float | None = None
    histogram_fraction: HistogramFraction | None = None
    ideal: Ideal | None = None
    behind_ideal: float | None = Field(None, description="ideal coverage minus coverage")
    excess_exposures: int | None = Field(None, description="exposures beyond ceil(C/N)")
    missing_exposures: int | None = Field(None, description="exposures missing below floor(C/N)")


class Outside(Strict):
    records: int = Field(description="consumed record keys >= N (held out or unknown)")
    exposures: int


_COVERAGE_EXAMPLE = {
    "step": 29, "latest_step": 29, "universe": "manifest", "train_records": 150,
    "exposures": 360, "seen": 136, "coverage": 0.9067, "never_seen": 14,
    "histogram": {"0": 14, "1": 37, "2": 38, "3+": 61}, "never_seen_fraction": 0.0933,
    "histogram_fraction": {"0": 0.0933, "1": 0.2467, "2": 0.2533, "3+": 0.4067},
    "ideal": {"min": 2, "max": 3, "coverage": 1.0, "never_seen": 0}, "behind_ideal": 0.0933,
    "excess_exposures": 64, "missing_exposures": 65, "outside": {"records": 0, "exposures": 0}}


class CoverageAnswer(CoverageNumbers):
    """Coverage as of a step, against the universe of N train records."""

    model_config = _exact(_COVERAGE_EXAMPLE)

    step: int | None = Field(description="as of this step (null: nothing consumed yet)")
    latest_step: int | None
    universe: str = Field(description="where N comes from: manifest, records option, writer "
                                      "metadata, or unknown")
    outside: Outside


# ---- findings (tally.audit.core.exposure.Finding)
# ----------------------------------------------------

class Finding(BaseModel):
    """What a check found: how bad, a stable code, the likely cause, the numbers behind it."""

    model_config = ConfigDict(extra="allow")

    severity: Severity
    code: str = Field(examples=["with_replacement"])
    message: str
    numbers: dict[str, Any]
    evidence: dict[str, list[dict[str, Any]]] | None = Field(
        default=None, description="what the finding points at, where a check can name it: "
        "steps, hosts and records, a few of each, each with the API path that shows it")


class LiveFindings(Strict):
    """The newest live reconcile of the run (`--findings-every`): its verdict and findings."""

    verdict: Verdict | None = Field(description="null: no live reconcile has finished yet")
    findings: list[Finding]
    integrity: dict[str, Any] | None = Field(description="integrity against the manifest")
    as_of_step: int | None
    first_bad_step: int | None = Field(description="the first step at which some record had "
                                       "been exposed more often than a perfect loader allows "
                                       "(null for a run measured against its domains' own "
                                       "ideals)")
    generated_at: str | None


# ---- runs ------------------------------------------------------------------------------------

class RunListItem(Strict):
    model_config = _exact({"run_id": "exp1", "manifest_fingerprint": "5f1c0a9e2b7d4c31",
                           "attempts": 1, "host_count": 2, "last_step": 29,
                           "records_seen": 136, "exposures": 360, "replayed": False})

    run_id: str
    manifest_fingerprint: str | None
    attempts: int
    host_count: int | None
    last_step: int | None = Field(description="latest effective step")
    records_seen: int
    exposures: int
    replayed: bool = Field(description=REPLAYED)


class Alert(Strict):
    name: str = Field(examples=["epoch_duplicates"])
    value: float | None = Field(description="the number compared (null: cannot be computed)")
    threshold: float
    firing: bool
    what: str


class Attempt(Strict):
    attempt: int
    resumed_from_step: int | None
    host_count: int
    rolled_back_from_step: int | None
    replayed: bool = Field(description="this attempt's files were written by `tally replay` "
                                       "(their writer_version), not by the run")


class NonFiniteLosses(Strict):
    count: int
    first_step: int | None


class QuarantinedFile(Strict):
    path: str
    reason: str


class Quarantined(Strict):
    count: int
    first: list[QuarantinedFile] = Field(description="the first few, by path")


class IntegrityExample(Strict):
    record_key: int
    step: int
    host: int


class IntegrityAtIngest(Strict):
    """A run's integrity against the manifest as its files were ingested
    (tally.audit.ledger.integrity): over every row ingested, rolled-back steps included."""

    manifest_fingerprint: str
    files: int = Field(description="the run's segment files in the ledger")
    files_checked: int = Field(description="of them, checked against this manifest")
    segments: int
    hash_checked: int = Field(description="whole-record starts compared by content hash")
    hash_mismatches: int
    unknown_segments: int
    unknown_keys: int = Field(description="distinct keys outside the manifest")
    heldout_consumed_records: int = Field(description="distinct held-out records trained on")
    heldout_exposures: int
    keys_at_least: bool = Field(description="distinct key counts are lower bounds (a file had "
                                            "more than Tally keeps a file)")
    skipped: str | None = Field(description="why the run's files were not checked")
    hashes_skipped: str | None = Field(description="why their hashes were not compared")
    examples: dict[Literal["mismatch", "unknown", "heldout"], list[IntegrityExample]]


class RunSummary(Strict):
    model_config = _exact({
        "run_id": "exp1", "status": "alert",
        "alerts": [{"name": "epoch_duplicates", "value": 117, "threshold": 0, "firing": True,
                    "what": "exposures of a record beyond its first within one epoch"}],
        "last_step": 29, "segment_files": 10, "records_seen": 136, "exposures": 360,
        "epoch_duplicates": 117, "epoch_duplicate_records": 72, "multi_host_records": 68,
        "rows_ingested": 480, "last_ingested_at": "2026-11-30T20:13:39.361079+00:00",
        "replayed": False, "replayed_files": 0,
        "attempts": [{"attempt": 0, "resumed_from_step": None, "host_count": 2,
                      "rolled_back_from_step": None, "replayed": False}],
        "non_finite_losses": {"count": 0, "first_step": None}, "finished": False,
        "finished_step": None, "state": "running", "coverage": _COVERAGE_EXAMPLE,
        "ingest_lag_seconds": 0.0, "ingest_state": "live",
        "quarantined_files": {"count": 0, "first": []}, "findings": None,
        "integrity_at_ingest": {
            "manifest_fingerprint": "9f3c2a61d0b4e7a8", "files": 10, "files_checked": 10,
            "segments": 480, "hash_checked": 360, "hash_mismatches": 0, "unknown_segments": 0,
            "unknown_keys": 0, "heldout_consumed_records": 0, "heldout_exposures": 0,
            "keys_at_least": False, "skipped": None, "hashes_skipped": None,
            "examples": {"mismatch": [], "unknown": [], "heldout": []}}})

    run_id: str
    status: Literal["ok", "alert"]
    alerts: list[Alert]
    last_step: int | None
    segment_files: int
    records_seen: int
    exposures: int
    epoch_duplicates: int
    epoch_duplicate_records: int
    multi_host_records: int
    rows_ingested: int
    last_ingested_at: str | None = Field(description="ISO 8601, UTC, with its zone")
    replayed: bool = Field(description=REPLAYED + " (every segment file of the run)")
    replayed_files: int = Field(description="segment files written by `tally replay`, of "
                                            "`segment_files` (some, not all: a mixed run)")
    attempts: list[Attempt]
    non_finite_losses: NonFiniteLosses
    finished: bool
    finished_step: int | None
    state: Literal["running", "finished"]
    coverage: CoverageAnswer
    ingest_lag_seconds: float
    ingest_state: Literal["catching up", "live"] | None = Field(
        description="'catching up' while the service ingests the files it found at start (no "
                    "ingest_lag alert meanwhile), then 'live'; null when it ingests no spool")
    quarantined_files: Quarantined
    findings: LiveFindings | None = Field(
        description="live findings; null unless the service reconciles (--spool, --manifest)")
    integrity_at_ingest: IntegrityAtIngest | None = Field(
        description="integrity against the manifest, checked as each file is ingested; null "
                    "unless the service ingests with a manifest (--spool, --manifest)")


# ---- per step, per host ----------------------------------------------------------------------

class Steps(Strict):
    """Per bucket of steps (`step`: its first step, `last_step`: its last consumed one)."""

    model_config = _exact({
        "bucket": 10, "step": [0, 10, 20], "last_step": [9, 19, 29],
        "segments": [160, 160, 160], "tokens": [4191, 3784, 4061],
        "exposures": [120, 120, 120], "new_unique": [80, 38, 18], "repeats": [40, 82, 102],
        "cumulative_unique": [80, 118, 136], "cumulative_exposures": [120, 240, 360],
        "coverage": [0.5333, 0.7867, 0.9067], "ideal_coverage": [0.8, 1.0, 1.0],
        "next_cursor": None})

    bucket: int = Field(description="steps per bucket")
    step: list[int]
    last_step: list[int]
    segments: list[int]
    tokens: list[int]
    exposures: list[int]
    new_unique: list[int]
    repeats: list[int]
    cumulative_unique: list[int]
    cumulative_exposures: list[int]
    coverage: list[float] | None = Field(description="null when N is unknown")
    ideal_coverage: list[float] | None
    next_cursor: int | None = Field(description=STEP_CURSOR)


class HostStats(Strict):
    host: int
    segments: int
    tokens: int
    exposures: int
    first_step: int | None
    last_step: int | None
    unique: int = Field(description="distinct records the host saw (exact at any host count)")
    overlap_with_others: int = Field(description="of those, records another host saw too")


class Hosts(Strict):
    model_config = _exact({
        "count": 2, "overlap_tracked_hosts": 2,
        "per_host": [{"host": 0, "segments": 240, "tokens": 6127, "exposures": 180,
                      "first_step": 0, "last_step": 29, "unique": 102,
                      "overlap_with_others": 68},
                     {"host": 1, "segments": 240, "tokens": 5909, "exposures": 180,
                      "first_step": 0, "last_step": 29, "unique": 102,
                      "overlap_with_others": 68}],
        "overlap_matrix": [[102, 68], [68, 102]], "overlap_pairs": 68})

    count: int = Field(description="the run's host count (the most any attempt declared)")
    overlap_tracked_hosts: int = Field(description="hosts whose overlap is counted: all of them "
                                                   "(kept for clients of the 64-host limit)")
    per_host: list[HostStats] = Field(description="each host that sent rows, ascending (host "
                                                  "numbers may be sparse)")
    overlap_matrix: list[list[int]] = Field(description="records both hosts saw, rows and "
                                                        "columns in per_host's order; the "
                                                        "diagonal: records the host saw")
    overlap_pairs: int


class HostSteps(Strict):
    model_config = _exact({"host": 0, "bucket": 10, "step": [0, 10, 20],
                           "last_step": [9, 19, 29], "segments": [80, 80, 80],
                           "tokens": [2138, 1954, 2035], "exposures": [60, 60, 60],
                           "next_cursor": None})

    host: int
    bucket: int
    step: list[int]
    last_step: list[int]
    segments: list[int]
    tokens: list[int]
    exposures: list[int]
    next_cursor: int | None = Field(description=STEP_CURSOR)


# ---- records ---------------------------------------------------------------------------------

class Consumption(Strict):
    record_key: int
    step: int
    host: int
    attempt: int
    epoch: int = Field(description="-1 when unknown")
    row: int
    offset: int = Field(description="0: the segment starts the record (an exposure)")
    n_tokens: int
    content_hash: str = Field(pattern=HEX_HASH, examples=["0x1715a2c3e6f4b869"])
    rolled_back: bool


class RecordLookup(Strict):
    """Every consumption of a record (or of the records with one content hash), a page at a
    time; the totals count every page."""

    model_config = _exact({
        "record_keys": [5], "exposures": 2, "exposures_by_epoch": {"0": 1, "2": 1},
        "segments_total": 3,
        "segments": [{"record_key": 5, "step": 0, "host": 1, "attempt": 0, "epoch": 0,
                      "row": 2, "offset": 0, "n_tokens": 14,
                      "content_hash": "0x1715a2c3e6f4b869", "rolled_back": False},
                     {"record_key": 5, "step": 24, "host": 0, "attempt": 0, "epoch": 2,
                      "row": 3, "offset": 0, "n_tokens": 26,
                      "content_hash": "0x1715a2c3e6f4b869", "rolled_back": False}],
        "next_cursor": "5.24.0.0.3.0.312"})

    record_keys: list[int]
    exposures: int = Field(description="effective exposures, over every page")
    exposures_by_epoch: dict[str, int]
    segments_total: int = Field(description="consumptions over every page, rolled back "
                                            "included")
    segments: list[Consumption] = Field(description="this page, in (record_key, step, host, "
                                                    "attempt, row, offset) order")
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null on "
                                                "the last one")
    never_consumed: bool | None = Field(
        None, description="true for a train record (of the run's manifest) the run never "
                          "consumed: a 200 with no segments; absent otherwise")


# ---- domains, metrics, loss ------------------------------------------------------------------

class DomainShare(Strict):
    model_config = _exact({"domain": "code", "records": 50, "exposures": 119, "seen": 45,
                           "never_seen": 5, "coverage": 0.9, "planned_share": 0.3333,
                           "actual_share": 0.3306})

    domain: str
    records: int
    exposures: int
    seen: int
    never_seen: int
    coverage: float
    planned_share: float = Field(description="the domain's share of the train split")
    actual_share: float = Field(description="its share of the exposures")


class Milestone(Strict):
    step: int
    heldout_loss: float | None
    ppl: dict[str, float | None] = Field(description="per-domain perplexity")
    train_loss: float | None


class Series(Strict):
    step: list[int]
    value: list[float | None]


class Metrics(Strict):
    model_config = _exact({
        "names": ["heldout_loss", "ppl/web", "train_loss"],
        "milestones": [{"step": 9, "heldout_loss": 5.455, "ppl": {"web": 91.0},
                        "train_loss": 4.9105}],
        "train_loss": {"step": [0, 10, 20], "value": [4.9555, 4.8555, 4.7555]}})

    names: list[str]
    milestones: list[Milestone]
    train_loss: Series


class Report(BaseModel):
    """A reconcile report (report.json, report_version 1; docs/DESIGN.md): its verdict,
    findings, coverage, hosts, domains, integrity, restarts, loss and first bad step."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"report_version": 1, "run_id": "exp1", "verdict": "PASS", "findings": [],
         "first_bad_step": None}]})

    run_id: str
    verdict: Verdict | None = None
    findings: list[Finding] | None = None


class LossAnswer(BaseModel):
    """The loss section of the newest reconcile report (tally.audit.reconcile.loss), and as of
    when."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"as_of_step": 29, "generated_at": "2026-11-30T20:13:39+00:00", "windows": [],
         "test": None, "milestones": []}]})

    as_of_step: int | None
    generated_at: str | None


# ---- two runs, documents ---------------------------------------------------------------------

class DiffSeries(Strict):
    last_step: list[int]
    coverage: list[float] | None
    ideal_coverage: list[float] | None


class DiffSide(Strict):
    run_id: str
    source: str
    run_manifest_fingerprint: str | None
    replayed: bool = Field(description=REPLAYED)
    replayed_files: int = Field(description="segment files written by `tally replay`")
    last_step: int | None
    first_step: int | None
    steps: int
    exposures: int
    unknown_keys: int
    unknown_exposures: int
    coverage: CoverageNumbers
    series: DiffSeries


class DiffManifest(Strict):
    fingerprint: str | None
    records: int | None
    train_records: int | None


class Jaccard(Strict):
    mean: float | None
    min: float | None
    at_first_divergent_step: float | None


class DiffRecords(Strict):
    compared: int
    only_a: int
    only_b: int
    same: int
    more_often_a: int
    more_often_b: int
    neither: int


class DiffWindows(Strict):
    steps: int
    count: int
    same_multiset: int
    other_order: int


class DiffStepsSeries(Strict):
    bucket: int
    step: list[int]
    compared: list[int]
    identical: list[int]
    jaccard: list[float]


_DIFF_SIDE = {
    "run_id": "exp1", "source": "ledger", "run_manifest_fingerprint": "5f1c0a9e2b7d4c31",
    "replayed": False, "replayed_files": 0, "last_step": 29, "first_step": 0, "steps": 30,
    "exposures": 360, "unknown_keys": 0, "unknown_exposures": 0,
    "coverage": {k: v for k, v in _COVERAGE_EXAMPLE.items()
                 if k not in ("step", "latest_step", "universe", "outside")},
    "series": {"last_step": [9, 19, 29], "coverage": [0.5333, 0.7867, 0.9067],
               "ideal_coverage": [0.8, 1.0, 1.0]}}


class Diff(Strict):
    """Two runs side by side, in diff.json's shape (tally.audit.posthoc.answers.diff)."""

    model_config = _exact({
        "a": _DIFF_SIDE, "b": {**_DIFF_SIDE, "run_id": "exp2"},
        "manifest": {"fingerprint": "5f1c0a9e2b7d4c31", "records": 160, "train_records": 150},
        "status": "identical", "steps_compared": 30, "identical_steps": 30,
        "first_divergent_step": None, "compared_through_step": 29, "exact": True,
        "steps_only_a": 0, "steps_only_b": 0, "steps_same_records_other_tokens": 0,
        "jaccard": {"mean": 1.0, "min": 1.0, "at_first_divergent_step": None},
        "records": {"compared": 160, "only_a": 0, "only_b": 0, "same": 136,
                    "more_often_a": 0, "more_often_b": 0, "neither": 24},
        "records_only_a": 0, "records_only_b": 0, "exposure_difference_histogram": {"0": 160},
        "epochs": [], "epochs_known": False,
        "windows": {"steps": 2, "count": 15, "same_multiset": 15, "other_order": 0},
        "steps_series": {"bucket": 10, "step": [0, 10, 20], "compared": [10, 10, 10],
                         "identical": [10, 10, 10], "jaccard": [1.0, 1.0, 1.0]},
        "findings": [{"severity": "INFO", "code": "identical", "numbers": {"steps": 30},
                      "message": "both runs consumed the same records, segments and tokens at "
                                 "each of the 30 steps compared: the same data in the same "
                                 "order"}],
        "verdict": "PASS"})

    a: DiffSide
    b: DiffSide
    manifest: DiffManifest
    status: Literal["identical", "same_data_other_order", "different"]
    steps_compared: int
    identical_steps: int
    first_divergent_step: int | None
    compared_through_step: int
    exact: bool = Field(description="false: compared through `compared_through_step` only")
    steps_only_a: int
    steps_only_b: int
    steps_same_records_other_tokens: int
    jaccard: Jaccard
    records: DiffRecords
    records_only_a: int
    records_only_b: int
    exposure_difference_histogram: dict[str, int] = Field(
        description="exposures in A minus exposures in B -> records")
    epochs: list[dict[str, Any]]
    epochs_known: bool
    windows: DiffWindows
    steps_series: DiffStepsSeries
    findings: list[Finding]
    verdict: Verdict


class MatchedRecord(Strict):
    record_key: int
    split: str
    domain: str
    exposures: int
    first_step: int | None
    last_step: int | None
    hosts: list[int] | None
    epochs: list[int] | None


class DocumentExposure(Strict):
    content_hash: str = Field(pattern=r"^(0x[0-9a-f]{16}|[0-9]{20})$",
                              description="the posted hash, as 0x and 16 hex digits; a posted "
                                          "number beyond 64 bits (no record has one) is echoed "
                                          "as given")
    exposures: int
    records: list[MatchedRecord] = Field(description="the manifest records with this hash")


class ExposureAnswer(Strict):
    model_config = _exact({
        "run_id": "exp1", "documents": 1, "matched": 1, "consumed": 1, "consumed_2plus": 0,
        "records_consumed": 1, "exposures": 1, "first_step": 3, "last_step": 3,
        "headline": "of the 1 documents, 1 are in the corpus and 1 of them were consumed, 0 "
                    "of them twice or more",
        "replayed": False, "manifest_fingerprint": "5f1c0a9e2b7d4c31",
        "results": [{"content_hash": "0x0000000000000001", "exposures": 1,
                     "records": [{"record_key": 0, "split": "train", "domain": "code",
                                  "exposures": 1, "first_step": 3, "last_step": 3,
                                  "hosts": [1], "epochs": [0]}]}]})

    run_id: str
    documents: int
    matched: int
    consumed: int
    consumed_2plus: int
    records_consumed: int
    exposures: int
    first_step: int | None
    last_step: int | None
    headline: str
    replayed: bool = Field(description=REPLAYED)
    manifest_fingerprint: str | None
    results: list[DocumentExposure] = Field(description="one per posted hash, in order")


# ---- pre-flight ------------------------------------------------------------------------------

class PreflightAnswer(Strict):
    model_config = _exact({
        "id": 1, "exit_code": 1, "run_id": "exp1", "status": "unsafe",
        "headline": "preflight run exp1: UNSAFE to resume step 6 on 1 host(s) (was 2)",
        "findings": [{"severity": "FAIL", "code": "repeats", "numbers": {"records": 48},
                      "message": "the resumed loader would repeat 48 records"}],
        "numbers": {"checkpoint_step": 6, "old_hosts": 2, "new_hosts": 1}})

    id: int = Field(description="the verdict's id in the ledger")
    exit_code: int = Field(description="0 safe, 1 unsafe, 2 cannot tell")
    run_id: str
    status: Literal["safe", "unsafe", "unknown"]
    headline: str
    findings: list[Finding]
    numbers: dict[str, Any]


class PreflightRecord(Strict):
    model_config = _exact({
        "id": 1, "checked_at": "2026-11-30T20:13:39.361079+00:00", "checkpoint_step": 6,
        "old_hosts": 2, "new_hosts": 1, "status": "unsafe", "forced": False,
        "requested_by": "api",
        "headline": "preflight run exp1: UNSAFE to resume step 6 on 1 host(s) (was 2)"})

    id: int
    checked_at: str = Field(description="ISO 8601, UTC, with its zone")
    checkpoint_step: int | None
    old_hosts: int | None
    new_hosts: int | None
    status: Literal["safe", "unsafe", "unknown"]
    forced: bool
    requested_by: str
    headline: str


# ---- the service -----------------------------------------------------------------------------

class IngestHealth(Strict):
    alive: bool
    rounds: int
    files: int
    rows: int
    quarantined: int
    last_error: str | None
    lag_seconds: float = Field(description="seconds since the service first saw the oldest "
                                           "file still waiting for ingest")
    catching_up: bool = Field(description="still ingesting the files found at start")
    overran: float | None = Field(description="seconds of a round beyond max_round_seconds")
    max_round_seconds: float
    integrity_error: str | None = Field(
        description="why integrity is not checked at ingest (the manifest could not be read); "
                    "null when it is, or the service has no manifest")


class Universe(Strict):
    train_records: int | None
    source: str


class ThresholdSettings(Strict):
    epoch_duplicates: int | None
    host_overlap: int | None
    ingest_lag_seconds: float | None
    coverage_behind: float | None
    non_finite_losses: int | None


class WebhookHealth(Strict):
    configured: bool
    alive: bool = Field(description="false once the sender thread died: the service is "
                                    "degraded, no alert is delivered again")
    error: str | None = Field(description="why the sender died; null while it runs")
    sent: int = Field(description="bodies delivered")
    failures: int = Field(description="failed tries (each is retried)")
    pending: int = Field(description="runs whose latest alert change is not delivered yet")


class Health(Strict):
    model_config = _exact({
        "status": "ok", "ledger": "ledger.duckdb", "files_in_ledger": 20, "ingesting": True,
        "quarantined_files": {},
        "ingest": {"alive": True, "rounds": 12, "files": 20, "rows": 480, "quarantined": 0,
                   "last_error": None, "lag_seconds": 0.0, "catching_up": False,
                   "overran": None, "max_round_seconds": 60.0, "integrity_error": None},
        "universe": {"train_records": 150, "source": "manifest"},
        "thresholds": {"epoch_duplicates": 0, "host_overlap": 0, "ingest_lag_seconds": 300.0,
                       "coverage_behind": 0.02, "non_finite_losses": 0},
        "webhook": {"configured": False, "alive": True, "error": None, "sent": 0,
                    "failures": 0, "pending": 0}})

    status: Literal["ok", "degraded"]
    ledger: str
    files_in_ledger: int
    ingesting: bool
    quarantined_files: dict[str, int] = Field(description="quarantined files per run id")
    ingest: IngestHealth | None
    universe: Universe
    thresholds: ThresholdSettings
    webhook: WebhookHealth
