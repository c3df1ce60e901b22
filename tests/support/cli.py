"""Running the real ``mongo-outbox`` console script, as an operator would: a subprocess of
``python -m mongo_outbox`` with a clean environment (no ``MONGO_OUTBOX_*`` of the caller's)."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from mongo_outbox import Event, Outbox
from tests.support.waiting import until

COMMAND = [sys.executable, "-m", "mongo_outbox"]


def environment(**extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MONGO_OUTBOX_")}
    return clean | extra


@dataclass
class Ran:
    code: int
    out: str
    err: str

    @property
    def output(self) -> str:
        return self.out + self.err


async def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Ran:
    """Run ``mongo-outbox ARGS`` to its end."""
    process = await asyncio.create_subprocess_exec(
        *COMMAND,
        *args,
        env=env or environment(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return Ran(process.returncode, out.decode(), err.decode())


class Service:
    """``mongo-outbox ARGS`` running in the background (a relay), its output collected."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = env or environment()
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> Service:
        self.process = await asyncio.create_subprocess_exec(
            *COMMAND,
            *self.args,
            env=self.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return self

    async def stop(self, signal: int, timeout: float = 15) -> Ran:
        """Send ``signal`` and wait for the exit (killed, and failed, after ``timeout``)."""
        assert self.process is not None
        if self.process.returncode is None:
            self.process.send_signal(signal)
        try:
            out, err = await asyncio.wait_for(self.process.communicate(), timeout)
        except asyncio.TimeoutError:
            self.process.kill()
            await self.process.wait()
            raise AssertionError(f"{self.args[0]} did not exit in {timeout}s") from None
        assert self.process.returncode is not None
        return Ran(self.process.returncode, out.decode(), err.decode())

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()


async def lease_of(db: Any, name: str, checkpoints: str = "outbox_relays") -> dict[str, Any]:
    return dict(await db[checkpoints].find_one({"_id": name}) or {})


def held(doc: dict[str, Any]) -> bool:
    lease = doc.get("lease_until")
    return isinstance(lease, datetime) and lease > datetime.now(timezone.utc)


async def until_active(db: Any, name: str, service: Service, timeout: float = 20) -> None:
    """Wait until relay ``name`` holds its lease (failing early if its process ended)."""

    async def active() -> bool:
        assert service.process is not None
        if service.process.returncode is not None:
            ran = await service.stop(0)
            raise AssertionError(f"the relay exited {ran.code}: {ran.output}")
        return held(await lease_of(db, name))

    await until(active, timeout=timeout, every=0.1)


async def save_orders(outbox: Outbox, db: Any, n: int, start: int = 0) -> list[Event]:
    events: list[Event] = []
    for i in range(start, start + n):
        saved = await outbox.save_with_events(
            None, db.orders, {"_id": f"o-{i}"}, [Event(type="placed", payload={"n": i})]
        )
        events += saved.events
    return events


async def stream_ids(nats_client: Any, stream: str, expected: int) -> list[str]:
    js = nats_client.jetstream()

    async def arrived() -> bool:
        return bool((await js.stream_info(stream)).state.messages >= expected)

    await until(arrived, timeout=20, every=0.05)
    sub = await js.subscribe(f"{stream}.>", ordered_consumer=True)
    ids = [Event.from_json((await sub.next_msg(timeout=5)).data).id for _ in range(expected)]
    await sub.unsubscribe()
    return ids
