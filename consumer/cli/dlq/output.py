"""What the dead-letter tools print: rows, one letter in full, counts, and the progress bar.

Most of what a dead letter says was written by a producer: it is escaped before it reaches a
terminal (:func:`shown`) and marked as the producer's. ``consumer-*`` headers are shown as the
service's only on a letter the service published itself; on one the broker dead-lettered they are
shown apart, unverified (:mod:`consumer.cli.dlq.letters` says why).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any, TextIO

from tqdm import tqdm

from consumer.cli.dlq.letters import DeadMessage
from consumer.safe_text import one_line

__all__ = ["Counts", "letter_json", "letter_row", "progress_bar", "show_letter", "shown"]


def shown(value: object, limit: int = 200) -> str:
    """``value`` fit for a terminal: control characters and bidirectional overrides escaped (a
    producer wrote most of what a dead letter says), on one line, at most ``limit`` characters."""
    if value is None:
        return "?"
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8", errors="backslashreplace")
    return one_line(str(value), limit)


def letter_json(letter: DeadMessage) -> str:
    return json.dumps(letter.summary())


def letter_row(letter: DeadMessage) -> str:
    row = letter.summary()
    return (
        f"{shown(row['id'], 64):<36}  {shown(row['type'], 64):<24}  "
        f"{shown(row['reason'], 32):<18}  attempts={_count(row['attempts'])}  "
        f"at={row['dead_lettered_at'] or '?'}  "
        f"{shown(row['error_class'] or '', 80)} {shown(row['error'] or '', 80)}"
    )


class Counts:
    """Letters counted by reason and by type as they stream past: two small counters, whatever
    the number of letters."""

    def __init__(self) -> None:
        self.by_reason: Counter[str] = Counter()
        self.by_type: Counter[str] = Counter()
        self.total = 0

    def add(self, letter: DeadMessage) -> None:
        self.total += 1
        self.by_reason[letter.reason] += 1
        self.by_type[letter.type or "?"] += 1

    def lines(self, read: int) -> list[str]:
        reasons = ", ".join(f"{shown(k, 32)}={v}" for k, v in self.by_reason.most_common())
        types = ", ".join(f"{shown(k, 64)}={v}" for k, v in self.by_type.most_common())
        return [
            f"{self.total} dead letters (of {read} in the queue)",
            "by reason: " + (reasons or "-"),
            "by type:   " + (types or "-"),
        ]


def show_letter(letter: DeadMessage, out: TextIO = sys.stdout) -> None:
    """One letter in full; whatever the producer wrote is marked so, and escaped."""

    def say(text: str) -> None:
        print(text, file=out)

    def headers(title: str, chosen: dict[str, Any]) -> None:
        say(title)
        for key, value in sorted(chosen.items()):
            say(f"  {shown(key, 64)}: {shown(value, 500)}")

    broker = "" if letter.by_service else "  (the broker's x-death)"
    say(f"id:              {shown(letter.id)}  (from the producer)")
    say(f"type:            {shown(letter.type)}  (from the producer)")
    say(f"reason:          {shown(letter.reason)}{broker}")
    say(f"attempts:        {_count(letter.attempts)}")
    say(f"dead-lettered:   {letter.dead_lettered_at or '?'}{broker}")
    say(f"original:        {shown(letter.original_exchange)} {shown(letter.original_routing_key)}")
    if letter.by_service:
        error = f"{shown(letter.error_class or '')} {shown(letter.error_message or '', 500)}"
        say(f"error:           {error.rstrip()}")
        say("dead-lettered by: the service")
    else:
        say(
            "dead-lettered by: the broker (x-death): its consumer-* headers are not the "
            "service's word"
        )
    if letter.poison_detail:
        say(f"parse error:     {shown(letter.poison_detail, 500)}")
    say(f"browsed:         {letter.deliveries} times")
    unverified = letter.unverified
    theirs = {k: v for k, v in letter.headers.items() if not k.startswith(_SET_BY_US)}
    ours = {
        k: v for k, v in letter.headers.items() if k.startswith(_SET_BY_US) and k not in unverified
    }
    if letter.by_service:
        headers("headers set by the service and the broker:", ours)
    else:
        headers("headers set by the broker (x-*; a producer can write some of them too):", ours)
    if unverified:
        headers("consumer-* headers, unverified (a producer's, or the retry ladder's):", unverified)
    headers("headers set by the producer:", theirs)
    say("body (from the producer):")
    say("  " + shown(letter.body, 4000))


_SET_BY_US = ("consumer-", "x-")


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def progress_bar(total: int, what: str) -> Any:
    """A bar on stderr, only when stderr is a terminal: a pipe or a log file gets the summary
    alone, not a stream of carriage returns."""
    return tqdm(
        total=total,
        desc=what,
        unit=" letters",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        mininterval=0.5,
        leave=True,
    )
