"""``python -m tests.chaos --profile short|long``: run the chaos suite, print and save the table."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.chaos.runner import RESULTS, run
from tests.chaos.scenarios import PROFILES, scenarios_for

INTERRUPTED = 130


def _parser() -> argparse.ArgumentParser:
    slugs = [scenario.slug for scenario in scenarios_for(PROFILES["short"])]
    named_only = sorted(PROFILES["short"].named_only)
    long_named_only = sorted(PROFILES["long"].named_only)
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos",
        description="Real consumers under real faults on throwaway servers; exactly-once checked "
        "from the database and the queues. Exit code 0 only if every invariant holds.",
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="short")
    parser.add_argument(
        "--scenario",
        action="append",
        choices=slugs,
        default=[],
        help="only these (repeatable); the short profile runs "
        f"{', '.join(named_only)} and the long one {', '.join(long_named_only)} only when named",
    )
    parser.add_argument("--events", type=int, help="publications per scenario (the profile's)")
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a consumer setting for every scenario, e.g. batch_size=20 (CONSUMER_BATCH_SIZE)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the consumers' logs of passing scenarios"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    settings: dict[str, str] = {}
    for item in arguments.setting:
        key, sep, value = item.partition("=")
        if not sep:
            _parser().error(f"--setting {item!r}: use NAME=VALUE")
        settings[key.strip().lower().removeprefix("consumer_")] = value
    command = shlex.join(["python", "-m", "tests.chaos", *(sys.argv[1:] if argv is None else argv)])

    async def main_task() -> int:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            report = await run(
                PROFILES[arguments.profile],
                command=command,
                results_dir=arguments.results_dir,
                only=arguments.scenario,
                settings=settings,
                events=arguments.events,
                seed=arguments.seed,
                keep_logs=arguments.keep_logs,
            )
        except asyncio.CancelledError:
            print("interrupted: processes and throwaway servers removed", file=sys.stderr)
            return INTERRUPTED
        print(report.markdown())
        return 0 if report.ok else 1

    try:
        return asyncio.run(main_task())
    except KeyboardInterrupt:
        print("interrupted: processes and throwaway servers removed", file=sys.stderr)
        return INTERRUPTED
