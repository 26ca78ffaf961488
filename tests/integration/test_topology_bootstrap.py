"""``python -m topology apply``: idempotent, a dry run that touches nothing, conflicts reported."""

from __future__ import annotations

from typing import Any

import aio_pika

from tests.support import ServiceProcess, TestEnv, queue_exists, run_cli


async def test_apply_twice_is_a_no_op(env: TestEnv) -> None:
    first = run_cli("topology", "apply", env=env.env())
    env.topologies.append(env.topology())
    assert first.returncode == 0, first.stderr
    assert f"created queue {env.names.work}" in first.stdout

    second = run_cli("topology", "apply", env=env.env())
    assert second.returncode == 0, second.stderr
    assert "created" not in second.stdout
    assert f"exists  queue {env.names.work}" in second.stdout

    check = run_cli("topology", "check", env=env.env())
    assert check.returncode == 0, check.stdout + check.stderr
    assert "topology is in place" in check.stdout


async def test_dry_run_prints_the_plan_without_touching_the_broker(env: TestEnv) -> None:
    # An address nothing listens on: the dry run must not even connect.
    result = run_cli(
        "topology", "apply", "--dry-run", env=env.env(amqp_url="amqp://guest:guest@127.0.0.1:1/")
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"queue {env.names.work} (quorum;" in "\n".join(lines)
    assert any(line.startswith(f"queue {env.names.service}.retry.200ms") for line in lines)
    assert f"bind {env.names.ingress} -> {env.names.work} with routing key 'test.behave'" in lines
    assert not await queue_exists(env.amqp_url, env.names.work)


async def test_a_conflicting_queue_is_reported_not_changed(env: TestEnv) -> None:
    # Given a work queue someone declared by hand with other arguments
    env.topologies.append(env.topology())
    connection = await aio_pika.connect(env.amqp_url)
    channel = await connection.channel()
    by_hand: dict[str, Any] = {"x-queue-type": "quorum", "x-delivery-limit": 9}
    await channel.declare_queue(env.names.work, durable=True, arguments=by_hand)

    # When the bootstrap runs
    result = run_cli("topology", "apply", env=env.env())

    # Then it stops, names the queue and every differing argument, and changes nothing
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    message = result.stderr
    assert f"queue {env.names.work}: x-delivery-limit is 9, the plan wants 20" in message
    for argument in ("x-dead-letter-exchange", "x-dead-letter-strategy", "x-overflow"):
        assert f"queue {env.names.work}: {argument} is none" in message
    assert "nothing was changed" in message
    assert not await queue_exists(env.amqp_url, env.names.dead)
    channel = await connection.channel()
    await channel.declare_queue(env.names.work, durable=True, arguments=by_hand)  # still as it was
    await connection.close()


async def test_the_consumer_refuses_to_start_without_its_topology(env: TestEnv) -> None:
    service = ServiceProcess(env).start()
    code = await service.wait_exit(timeout=30)
    assert code == 1
    assert "run `consumer topology apply` first" in service.log_text()
