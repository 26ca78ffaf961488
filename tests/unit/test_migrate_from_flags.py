"""``consumer topology migrate``'s ``--from-*`` flags: the old settings they give."""

from __future__ import annotations

import argparse
from datetime import timedelta

from consumer.cli.topology.migrate import add_migrate_parser, from_flags, old_settings
from consumer.config.settings import Settings


def _arguments(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_migrate_parser(parser.add_subparsers(dest="action"))
    return parser.parse_args(["migrate", *argv])


def test_an_old_ack_timeout_is_given_or_said_to_have_been_unset() -> None:
    # Given an install moving to a work queue with its own acknowledgement timeout
    settings = Settings(ack_timeout="1h")

    # Then `--from-ack-timeout none` says the old queue had none, and a duration gives it
    assert old_settings(settings, _arguments("--from-ack-timeout", "none")).ack_timeout is None
    old = old_settings(settings, _arguments("--from-ack-timeout", "45m"))
    assert old.ack_timeout == timedelta(minutes=45)
    # And without the flag the old plan has today's
    assert old_settings(settings, _arguments()).ack_timeout == timedelta(hours=1)
    assert from_flags(_arguments("--from-ack-timeout", "none")) == ["--from-ack-timeout"]
