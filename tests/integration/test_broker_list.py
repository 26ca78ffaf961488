"""The one-shot commands take ``CONSUMER_AMQP_URL`` as the service does: a cluster's nodes,
comma-separated, tried in turn (here a first node that is down, then the shared broker)."""

from __future__ import annotations

import json
import uuid

from tests.support import TestEnv, drain_queue, run_cli

DOWN = "amqp://guest:guest@127.0.0.1:1/"
"""A node nothing listens on."""


def with_a_dead_first_node(env: TestEnv) -> dict[str, str]:
    return env.env(amqp_url=f"{DOWN},{env.amqp_url}")


async def test_topology_apply_publish_and_dlq_list_go_past_a_node_that_is_down(
    env: TestEnv,
) -> None:
    # Given a node list whose first node is down
    environment = with_a_dead_first_node(env)

    # When the topology is applied, an event published and the dead letters listed with it
    applied = run_cli("consumer", "topology", "apply", env=environment)
    env.topologies.append(env.topology())
    event_id = uuid.uuid4()
    published = run_cli(
        "consumer",
        *("publish", "--type", "test.behave", "--payload", '{"key": "listed"}'),
        *("--event-id", str(event_id)),
        env=environment,
    )
    listed = run_cli("consumer", "dlq", "list", "--json", env=environment)

    # Then each reached the second node: the queue is there, with the event in it
    assert applied.returncode == 0, applied.stderr
    assert f"created queue {env.names.work}" in applied.stdout
    assert published.returncode == 0, published.stderr
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.strip() == ""  # the dead-letter queue is there, and empty
    messages = await drain_queue(env.amqp_url, env.names.work)
    assert [json.loads(message.body)["event_id"] for message in messages] == [str(event_id)]


async def test_every_node_down_names_the_nodes_without_their_passwords(env: TestEnv) -> None:
    # Given a list of nodes that are all down, one with a password
    environment = env.env(amqp_url=f"{DOWN},amqp://app:hunter2@127.0.0.1:2/")

    # When the topology is applied
    result = run_cli("consumer", "topology", "apply", env=environment)

    # Then it fails in one line that names where it could not connect, and no password
    assert result.returncode != 0
    assert "hunter2" not in result.stdout + result.stderr
    assert "127.0.0.1:2" in result.stderr, result.stderr
