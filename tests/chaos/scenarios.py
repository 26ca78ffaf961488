"""The scenarios (one fault each, then all together) and the two profiles that size them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tests.chaos.faults import (
    CloseConnections,
    Fault,
    FreezePostgres,
    Kill,
    RestartPostgres,
    RestartRabbit,
    Terminate,
)

# What every consumer of every scenario runs with, on top of tests.support.TestEnv's test settings
# (retry ladder 200ms,400ms,800ms; shutdown grace 10s; reconnect backoff capped at 1s).
CONSUMER_SETTINGS = {"handler_timeout": "1s"}


@dataclass(frozen=True)
class Profile:
    name: str
    events: int
    """Publications per scenario (duplicates and poison included)."""
    rate: float
    """Publications a second: about what the consumers apply, so faults land on a live stream."""
    kills: int
    terms: int
    closes: int
    rabbit_restarts: int
    postgres_restarts: int
    freezes: int
    all_together_rounds: int
    freeze_s: float = 4.0
    settle_timeout: float = 60.0
    """After publishing, how long the consumers get to finish."""
    budget: float = 220.0
    """The whole run, servers included: scenarios not started by then are skipped (a failure)."""


PROFILES = {
    "short": Profile(
        name="short",
        events=2_000,
        rate=700,
        kills=3,
        terms=2,
        closes=2,
        rabbit_restarts=1,
        postgres_restarts=2,
        freezes=1,
        all_together_rounds=1,
        settle_timeout=60,
        budget=230,
    ),
    "long": Profile(
        name="long",
        events=50_000,
        rate=500,
        kills=8,
        terms=4,
        closes=6,
        rabbit_restarts=3,
        postgres_restarts=4,
        freezes=3,
        all_together_rounds=3,
        settle_timeout=300,
        budget=3 * 3600,
    ),
}


@dataclass(frozen=True)
class Scenario:
    slug: str
    title: str
    consumers: int = 1
    faults: Sequence[Fault] = ()
    settings: dict[str, str] = field(default_factory=dict)

    @property
    def cuts_broker_links(self) -> bool:
        return any(fault.cuts_broker_links for fault in self.faults)

    def schedule(self) -> list[tuple[float, Fault]]:
        """Each fault with the share of the effects that must be applied before it strikes:
        spread between 10% and 85%, so every one lands while events flow."""
        count = len(self.faults)
        if count == 1:
            return [(0.4, self.faults[0])]
        return [(0.10 + 0.75 * n / (count - 1), fault) for n, fault in enumerate(self.faults)]


def scenarios_for(profile: Profile) -> list[Scenario]:
    p = profile
    one_round: list[Fault] = [
        Kill(0),
        CloseConnections(),
        Terminate(1),
        FreezePostgres(p.freeze_s),
        RestartRabbit(),
        RestartPostgres(),
        Kill(2),
    ]
    together = one_round * p.all_together_rounds
    together[-1] = Kill(2, restart=False)
    return [
        Scenario("baseline", "none (baseline)"),
        Scenario("sigkill", f"SIGKILL + restart x{p.kills}", faults=[Kill()] * p.kills),
        Scenario("sigterm", f"SIGTERM + restart x{p.terms}", faults=[Terminate()] * p.terms),
        Scenario(
            "close-connections",
            f"broker closes all connections x{p.closes}",
            faults=[CloseConnections()] * p.closes,
        ),
        Scenario(
            "rabbit-restart",
            f"RabbitMQ restart x{p.rabbit_restarts}",
            faults=[RestartRabbit()] * p.rabbit_restarts,
        ),
        Scenario(
            "postgres-restart",
            f"PostgreSQL restart x{p.postgres_restarts}",
            faults=[RestartPostgres()] * p.postgres_restarts,
        ),
        Scenario(
            "postgres-freeze",
            f"PostgreSQL SIGSTOP {p.freeze_s:g}s (> 1s handler timeout) x{p.freezes}",
            faults=[FreezePostgres(p.freeze_s)] * p.freezes,
        ),
        Scenario(
            "competing",
            "3 competing consumers, one SIGKILLed (left dead)",
            consumers=3,
            faults=[Kill(1, restart=False)],
        ),
        Scenario(
            "all-together",
            f"all of the above, 3 consumers, {len(together)} faults",
            consumers=3,
            faults=together,
        ),
    ]
