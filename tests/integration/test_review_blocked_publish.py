"""Found in review, now a regression test. The defect was: a retry publish waiting out a broker
alarm, whose connection then closes.

``Publisher._confirmed`` waits for ``connection.ready()`` with no bound while the broker blocks the
publishing connection. aiormq's "unblocked" event is only ever set again by a
``connection.unblocked`` frame on that same connection: if the connection closes while it is
blocked (the broker closes connections, a node restart, a network cut), ``ready()`` never returns.
The worker stays inside ``_settle_all`` (shielded) and inside ``IsolatedQueue.batch()``, so:

- its inbox is never served again;
- the isolated turn (``IsolatedQueue.turn``) waits for ``_batches == 0`` for ever, and while it
  has work every other worker waits in ``IsolatedQueue.batch()``: after the reconnect nothing is
  applied, nothing is settled, and ``/readyz`` still says 200.

On a throwaway RabbitMQ node of the test's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import uuid

import aiohttp

from tests.servers import ThrowawayRabbit
from tests.support import (
    Producer,
    ServiceProcess,
    TestEnv,
    behave,
    fetchval,
    wait_until,
)


def memory_alarm(rabbit: ThrowawayRabbit, *, on: bool) -> None:
    watermark = "0" if on else "0.4"
    subprocess.run(
        [*rabbit.ctl_command(), "set_vm_memory_high_watermark", watermark],
        check=True,
        capture_output=True,
        timeout=60,
    )


async def _metric(service: ServiceProcess, name: str, **labels: str) -> float:
    try:
        return await service.metric(name, **labels)
    except (aiohttp.ClientError, OSError):
        return -1


async def test_a_blocked_publish_whose_connection_closes_fails_and_the_service_goes_on(
    env: TestEnv, rabbit: ThrowawayRabbit
) -> None:
    env = dataclasses.replace(env, amqp_url=rabbit.url, topologies=[])
    env.overrides["exchange"] = f"{env.name}.events"
    settings = {"publish_timeout": "1s"}
    await env.apply_topology(**settings)
    flaky = ("test.behave", behave("flaky", fail_transient=1), uuid.uuid4())
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([flaky])

    # A memory alarm blocks the publish connection: the flaky event's retry copy waits.
    memory_alarm(rabbit, on=True)
    alarm_on = True
    try:
        service = await ServiceProcess(env, **settings).start().wait_ready()

        async def failed_once() -> bool:
            calls = await fetchval(env.database_url, "SELECT count(*) FROM handler_calls")
            return int(calls) >= 1 and await _metric(service, "consumer_in_flight") == 1

        await wait_until(failed_once, timeout=30, what="the flaky event's retry publish to wait")
        await asyncio.sleep(2.5)  # past two publish timeouts: it is in the blocked wait

        # The broker closes every connection (as in the chaos suite), then the alarm clears.
        rabbit.close_all_connections()
        memory_alarm(rabbit, on=False)
        alarm_on = False
        await service.wait_ready(timeout=30)

        # New events arrive after the reconnect.
        good = [("test.behave", behave(f"g{n}"), uuid.uuid4()) for n in range(20)]
        async with Producer(env.amqp_url, env.settings().exchange) as producer:
            await producer.send_many(good)

        async def applied() -> int:
            return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects"))

        deadline = asyncio.get_running_loop().time() + 30
        while asyncio.get_running_loop().time() < deadline and await applied() < 21:
            await asyncio.sleep(0.5)
        effects = await applied()
        in_flight = await _metric(service, "consumer_in_flight")
        ready = await service.is_ready()
        service.kill()
        print(f"effects={effects} in_flight={in_flight} ready={ready}")
        print(service.log_text()[-4000:])
        # Expected by the design: the 20 new events and the flaky one are applied and acked.
        assert effects == 21, (
            f"only {effects} of 21 effects after 30s; {in_flight} deliveries held unsettled "
            f"on the live channel; /readyz ready={ready}"
        )
    finally:
        if alarm_on:
            memory_alarm(rabbit, on=False)
