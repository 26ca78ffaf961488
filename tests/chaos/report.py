"""The figures: a Markdown table per run, printed and saved with the details as JSON."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.chaos.verify import Figures, Resources, Verdict


@dataclass
class FaultRecord:
    label: str
    share: float
    """The share of the effects that was to be applied before it struck."""
    applied_at: int
    """Effects applied when it struck."""
    on_time: bool
    """False when that share was not reached in time and it struck anyway."""
    seconds: float
    """Until the consumers were ready again."""


@dataclass
class ScenarioResult:
    slug: str
    title: str
    consumers: int
    seconds: float = 0.0
    faults: list[FaultRecord] = field(default_factory=list)
    verdict: Verdict | None = None
    metrics: str = ""
    skipped: str | None = None
    error: str | None = None
    """The scenario could not be run to the end (a setup failure, a time-out)."""

    @property
    def ok(self) -> bool:
        return (
            self.skipped is None and self.error is None and bool(self.verdict and self.verdict.ok)
        )


@dataclass
class RunReport:
    profile: str
    command: str
    started_at: datetime
    environment: dict[str, str]
    settings: dict[str, str]
    results: list[ScenarioResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(result.ok for result in self.results)

    def table(self) -> str:
        head = (
            "| fault | events sent | applied | dead-lettered | lost | duplicated effects "
            "| innocent dead letters | extra dead copies | restarts after self-exit "
            "| producer re-sends | time | invariants |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
        )
        rows = []
        total = Figures()
        for result in self.results:
            if result.verdict is None:
                why = result.skipped or result.error or "?"
                rows.append(f"| {result.title} |" + " - |" * 10 + f" not run: {why} |")
                continue
            f = result.verdict.figures
            for name in (
                "sent",
                "resent",
                "to_apply",
                "applied",
                "dead_expected",
                "dead_lettered",
                "lost",
                "duplicated",
                "innocent_dead",
                "extra_dead",
                "restarts",
                "stranded",
                "recovered",
            ):
                setattr(total, name, getattr(total, name) + getattr(f, name))
            rows.append(_row(result.title, f, f"{result.seconds:.0f}s", _status(result)))
        rows.append(
            _row(
                "**total**",
                total,
                f"{self.seconds:.0f}s",
                "**all hold**" if self.ok else "**FAILED**",
            )
        )
        return head + "\n".join(rows) + "\n"

    def markdown(self) -> str:
        lines = [
            f"# Chaos run, {self.profile} profile, {self.started_at:%Y-%m-%d %H:%M} UTC",
            "",
            f"Command: `{self.command}`",
            "",
            self.table(),
            "`applied` is of the events that must apply; `dead-lettered` counts the copies in "
            "`<name>.dead`, one expected per confirmed publication of a permanent or poison "
            "event (a duplicate published twice is dead-lettered twice). `lost`: events that must "
            "apply with no effect, plus confirmed dead-bound publications missing from the "
            "dead-letter queue; on a cluster, counted after the runbook's step for messages "
            "RabbitMQ held in its at-least-once dead-lettering once the queues were quiet "
            "(deploy/runbooks/DeadLetteringStuck.md), `stranded` being what it held before. "
            "`duplicated effects`: effects beyond the first of an event. "
            "`innocent dead letters`: dead copies of events that must apply (always a "
            "violation). `extra dead copies`: a second dead copy of one message id (the "
            "publish-confirm-then-ack window; no effect). `restarts after self-exit`: consumers "
            "that exited by themselves where the scenario expects it (a handler that blocks the "
            "loop or crashes the process), started again as a supervisor would. `producer "
            "re-sends`: publishes the faults left unconfirmed, sent again with a new message id.",
            "",
            "Settings: " + ", ".join(f"`{k}={v}`" for k, v in self.settings.items()),
            "",
            "Environment: " + ", ".join(f"{k} {v}" for k, v in self.environment.items()),
            "",
            "## Scenarios",
        ]
        for result in self.results:
            lines += ["", f"### {result.title} (`{result.slug}`)", ""]
            if result.skipped or result.error:
                lines.append(f"- not run to the end: {result.skipped or result.error}")
            for fault in result.faults:
                late = "" if fault.on_time else " (share not reached in time)"
                lines.append(
                    f"- {fault.label} at {fault.share:.0%} of the effects{late}: "
                    f"{fault.applied_at} applied; ready again after {fault.seconds:.1f}s"
                )
            if result.metrics:
                lines.append(f"- metrics: {result.metrics}")
            if result.verdict is not None:
                f = result.verdict.figures
                lines.append(
                    f"- {f.to_apply} events to apply, {f.dead_expected} dead copies expected, "
                    f"{f.handler_calls} handler calls"
                )
                if result.verdict.resources is not None:
                    lines.append(f"- resources: {result.verdict.resources.describe()}")
                lines += [f"- note: {note}" for note in result.verdict.notes]
                lines += [f"- **VIOLATED**: {v}" for v in result.verdict.violations]
        return "\n".join(lines) + "\n"

    def as_json(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "command": self.command,
            "started_at": self.started_at.isoformat(),
            "seconds": round(self.seconds, 1),
            "ok": self.ok,
            "environment": self.environment,
            "settings": self.settings,
            "results": [
                {
                    "slug": r.slug,
                    "title": r.title,
                    "consumers": r.consumers,
                    "seconds": round(r.seconds, 1),
                    "ok": r.ok,
                    "skipped": r.skipped,
                    "error": r.error,
                    "metrics": r.metrics,
                    "faults": [dataclasses.asdict(fault) for fault in r.faults],
                    "figures": dataclasses.asdict(r.verdict.figures) if r.verdict else None,
                    "violations": r.verdict.violations if r.verdict else [],
                    "notes": r.verdict.notes if r.verdict else [],
                    "details": r.verdict.details if r.verdict else {},
                    "resources": _resources(r.verdict.resources if r.verdict else None),
                }
                for r in self.results
            ],
        }

    def save(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        stem = directory / f"chaos-{self.profile}-{self.started_at:%Y%m%dT%H%M%SZ}"
        stem.with_suffix(".md").write_text(self.markdown())
        stem.with_suffix(".json").write_text(json.dumps(self.as_json(), indent=2) + "\n")
        return stem.with_suffix(".md")


def _resources(resources: Resources | None) -> dict[str, Any] | None:
    """The measured figures, with the ratios the invariant is on."""
    if resources is None:
        return None
    return {
        **dataclasses.asdict(resources),
        "wall_ratio": resources.wall_ratio,
        "cpu_ratio": resources.cpu_ratio,
    }


def _row(title: str, f: Figures, seconds: str, status: str) -> str:
    return (
        f"| {title} | {f.sent:,} | {f.applied:,} of {f.to_apply:,} | {f.dead_lettered:,} of "
        f"{f.dead_expected:,} | {_lost(f)} | {f.duplicated} | {f.innocent_dead} | "
        f"{f.extra_dead} | {f.restarts} | {f.resent} | {seconds} | {status} |"
    )


def _lost(f: Figures) -> str:
    """Lost after the runbook's step, and what RabbitMQ had stranded before it (if anything)."""
    if not f.stranded:
        return str(f.lost)
    return f"{f.lost} (stranded {f.stranded:,}, {f.recovered:,} recovered by the runbook's step)"


def _status(result: ScenarioResult) -> str:
    if result.ok:
        return "hold"
    assert result.verdict is not None
    problems = len(result.verdict.violations) + (1 if result.error else 0)
    return f"**{problems} violated**"
