"""A pre-flight verdict: safe, unsafe or cannot tell, with its findings and numbers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tally.audit.core.exposure import Findings
from tally.audit.core.words import listed

STATUSES = {"safe": 0, "unsafe": 1, "unknown": 2}  # status -> exit code


@dataclass
class PreflightVerdict:
    run_id: str
    status: str  # safe | unsafe | unknown
    findings: Findings = field(default_factory=Findings)
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "safe"

    @property
    def exit_code(self) -> int:
        return STATUSES[self.status]

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "status": self.status, "headline": self.headline(),
                "findings": self.findings.to_list(), "numbers": self.numbers}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def headline(self) -> str:
        n = self.numbers
        where = (f"resume step {n['checkpoint_step']} on {n['new_hosts']} host(s) "
                 f"(was {n['old_hosts']})" if "new_hosts" in n else "resume")
        word = {"safe": "SAFE", "unsafe": "UNSAFE", "unknown": "CANNOT TELL"}[self.status]
        line = f"preflight run {self.run_id}: {word} to {where}"
        bad = [f"repeat {n['repeats']:,} records" if n.get("repeats") else "",
               f"skip {n['skipped']:,} records" if n.get("skipped") else "",
               f"plan {n['duplicates']:,} records twice" if n.get("duplicates") else ""]
        bad = [b for b in bad if b]
        if bad and n.get("first_bad_step") is not None:
            line += (f": would {listed(bad)} between steps {n['first_bad_step']} and "
                     f"{n['last_bad_step']}")
        return line

    def summary(self) -> str:
        lines = [self.headline()]
        lines += [f"  {f.severity} {f.code}: {f.message}" for f in self.findings]
        n = self.numbers
        if "horizon_steps" in n and n.get("plan") == "loader":
            end = ("reaching the next multiple of the corpus" if n["reached_multiple"]
                   else "short of the next multiple of the corpus")
            if n.get("epoch_end_step") is not None:  # judged where the epoch ends
                end = f"judged where its epoch ends, at step {n['epoch_end_step']}"
            lines.append(
                f"  plan of {n['loader']}: {n['new_hosts']} host(s) x {n['horizon_steps']} "
                f"steps from step {n['checkpoint_step']} ({end}), {n['planned']:,} records "
                f"after {n['consumed_exposures']:,} exposures of {n['records_per_epoch']:,} "
                f"records; global batch {n['old_global_batch']} -> {n['new_global_batch']}; "
                f"{n['seconds']:.1f} s")
        elif "horizon_steps" in n:
            end = (f"to the end of epoch {n['epoch']}" if n["reached_epoch_end"]
                   else "not reaching the end of the epoch")
            lines.append(
                f"  plan: {n['new_hosts']} host(s) x {n['horizon_steps']} steps from step "
                f"{n['checkpoint_step']} ({end}), {n['planned']:,} record starts; "
                f"{n['consumed_in_epoch']:,} of {n['records_per_epoch']:,} records consumed in "
                f"epoch {n['epoch']}; global batch {n['old_global_batch']} -> "
                f"{n['new_global_batch']}; {n['seconds']:.1f} s")
        return "\n".join(lines)
