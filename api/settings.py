"""How a `tally serve` service runs, as one typed object: what it ingests and reads beside its
ledger, who may call it, what it alerts on, and its time boxes. The command line builds it from
its flags, the app (tally.api.app.create_app) and the service it assembles read it whole.

Checked when made, before anything is opened or created: a `ServeSettings` that exists is one
the service can start with, and a wrong value is a TallyError saying which (one line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tally.api.alerts import Thresholds, check_webhook
from tally.audit.core.errors import TallyError
from tally.pipeline.manifest_file import ManifestDomains


@dataclass(frozen=True)
class ServeSettings:
    """The service's settings (paths may be given as text; they are kept as `Path`s).
    `domains`: the manifest's, loaded once when the settings are checked (None without one)."""

    spool: Path | None = None  # ingest it while serving
    manifest: Path | None = None  # domains, and the coverage denominator
    records: int | None = None  # the coverage denominator when there is no manifest
    reports: Path | None = None  # where `tally reconcile -o DIR` writes (made later, maybe)
    token: str | None = None  # bearer token every request needs (None: open)
    thresholds: Thresholds = field(default_factory=Thresholds)
    webhook: str | None = None  # URL the alert changes are POSTed to
    interval: float = 1.0  # seconds between spool scans
    checkpoints: tuple[str, ...] = ()  # where the pre-flight endpoint may read checkpoints
    preflight_seconds: float = 120.0  # time box of one pre-flight request
    max_round_seconds: float = 60.0  # an ingest round longer turns /healthz degraded
    findings_every: float | None = None  # a live reconcile round this often (None, 0: never)
    metrics_hosts: int | None = None  # per-host /metrics series for this many hosts (None: all)
    domains: ManifestDomains | None = field(init=False, default=None, repr=False,
                                            compare=False)

    def __post_init__(self) -> None:
        check_webhook(self.webhook)
        spool, manifest, reports = self.spool, self.manifest, self.reports  # as given
        if spool is not None and not Path(spool).is_dir():
            raise TallyError(f"spool {spool} is not a directory")
        if self.records is not None and self.records < 1:
            raise TallyError("--records must be >= 1")
        if reports is not None and Path(reports).exists() and not Path(reports).is_dir():
            raise TallyError(f"reports {reports} is not a directory")  # it may be made later
        for c in self.checkpoints or ():
            if not Path(c).is_dir():
                raise TallyError(f"--checkpoints {c} is not a directory")
        # Frozen: the normal forms and the loaded domains are set here, once, the way a frozen
        # dataclass allows.
        normal = {"spool": spool, "manifest": manifest, "reports": reports}
        for name, value in normal.items():
            object.__setattr__(self, name, None if value is None else Path(value))
        object.__setattr__(self, "checkpoints", tuple(self.checkpoints or ()))
        if manifest is not None:
            object.__setattr__(self, "domains", ManifestDomains.load(manifest))
