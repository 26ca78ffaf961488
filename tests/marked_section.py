"""A generated part of a documentation page: the text between two marker comments, read and
written in place (the code map, the settings table)."""

from __future__ import annotations

from pathlib import Path


def between(text: str, begin: str, end: str) -> str:
    """What ``text`` holds between the markers ``begin`` and ``end``, blank lines trimmed."""
    start = text.index(begin) + len(begin)
    return text[start : text.index(end)].strip("\n") + "\n"


def write_between(page: Path, begin: str, end: str, body: str) -> None:
    """``page`` with what stands between the markers replaced by ``body``."""
    text = page.read_text()
    start = text.index(begin) + len(begin)
    page.write_text(text[:start] + "\n\n" + body + "\n" + text[text.index(end) :])
