"""``TenantRelays`` runs any ``Relay``: the library's, or an object of one's own with the same
few members (``mongo_outbox.relay.Relay``), not only the classes it knows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from mongo_outbox import (
    ChangeStreamRelay,
    Outbox,
    PollingRelay,
    RelayGroup,
    RelayStatus,
    UsageError,
)
from mongo_outbox.publishers import MemoryPublisher
from mongo_outbox.relay import Relay
from mongo_outbox.status import State
from mongo_outbox.tenants import TenantRelays


@pytest.fixture
async def offline() -> AsyncIterator[AsyncMongoClient[Any]]:
    """A client that never connects: nothing here sends a command (see conftest.py)."""
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        "mongodb://127.0.0.1:9", connect=False, serverSelectionTimeoutMS=200
    )
    yield client
    await client.close()


class HandmadeRelay:
    """A relay that is none of the library's classes: it only has a Relay's members."""

    def __init__(self, outbox: Outbox, name: str) -> None:
        self.name = name
        self.outbox = outbox
        self.state: State = "starting"
        self.last_error: str | None = None
        self._stopping = asyncio.Event()
        self.running = asyncio.Event()

    async def run(self) -> None:
        self.state = "active"
        self.running.set()
        await self._stopping.wait()
        self.state = "stopped"

    def stop(self) -> None:
        self._stopping.set()

    async def status(self) -> RelayStatus:
        return RelayStatus(
            name=self.name,
            state=self.state,
            active=self.state == "active",
            last_checkpoint_at=None,
            pending=0,
            oldest_pending_age=timedelta(0),
            parked=0,
            publish_failures=0,
            recoveries=0,
            last_error=self.last_error,
        )


async def test_a_relay_of_ones_own_runs_stops_and_reports_like_the_librarys(
    offline: AsyncMongoClient[Any],
) -> None:
    mine = [HandmadeRelay(Outbox(offline[db]), f"mine-{db}") for db in ("shop", "billing")]
    assert all(isinstance(relay, Relay) for relay in mine)
    tenants = TenantRelays(mine)
    assert tenants.state == "starting"
    task = asyncio.ensure_future(tenants.run())
    await asyncio.wait_for(asyncio.gather(*(r.running.wait() for r in mine)), 5)
    assert tenants.state == "active"
    statuses = await tenants.status()
    assert {db: s.name for db, s in statuses.items()} == {
        "shop": "mine-shop",
        "billing": "mine-billing",
    }
    tenants.stop()
    await asyncio.wait_for(task, 5)
    assert tenants.state == "stopped" and [r.state for r in mine] == ["stopped", "stopped"]


async def test_the_librarys_three_relays_are_relays(offline: AsyncMongoClient[Any]) -> None:
    outbox = Outbox(offline.shop, partitions=2)
    publisher = MemoryPublisher()
    relays = [
        PollingRelay(outbox, publisher),
        ChangeStreamRelay(outbox, publisher, name="r"),
        RelayGroup(outbox, publisher),
    ]
    assert all(isinstance(relay, Relay) for relay in relays)
    assert TenantRelays(relays[:1]).relays == {"shop": relays[0]}


async def test_it_runs_beside_the_librarys_relays_and_only_theirs_take_turns(
    offline: AsyncMongoClient[Any],
) -> None:
    polling = PollingRelay(Outbox(offline.shop), MemoryPublisher())
    mine = HandmadeRelay(Outbox(offline.billing), "mine")
    tenants = TenantRelays([polling, mine])
    assert polling.turns is tenants.turns
    assert not hasattr(mine, "turns")


async def test_an_object_without_a_relays_members_is_refused(
    offline: AsyncMongoClient[Any],
) -> None:
    with pytest.raises(UsageError, match="not Outbox"):
        TenantRelays([Outbox(offline.shop)])  # type: ignore[list-item]
    half = HandmadeRelay(Outbox(offline.shop), "half")
    del half.outbox
    with pytest.raises(UsageError, match=r"mongo_outbox\.relay\.Relay\), not HandmadeRelay"):
        TenantRelays([half])


async def test_a_relay_of_another_tenant_relays_or_a_second_run_is_refused(
    offline: AsyncMongoClient[Any],
) -> None:
    # Shared, or run twice at once, one TenantRelays stopped the other's relay and left its
    # database unrelayed while the first reported itself active.
    shared = PollingRelay(Outbox(offline.shop), MemoryPublisher())
    first = TenantRelays([shared])
    with pytest.raises(UsageError, match="belongs to another TenantRelays"):
        TenantRelays([PollingRelay(Outbox(offline.billing), MemoryPublisher()), shared])
    assert shared.turns is first.turns
    mine = [HandmadeRelay(Outbox(offline[db]), f"mine-{db}") for db in ("shop", "billing")]
    tenants = TenantRelays(mine)
    task = asyncio.ensure_future(tenants.run())
    await asyncio.wait_for(asyncio.gather(*(r.running.wait() for r in mine)), 5)
    with pytest.raises(UsageError, match="already running"):
        await tenants.run()
    assert [relay.state for relay in mine] == ["active", "active"]  # untouched
    tenants.stop()
    await asyncio.wait_for(task, 5)


class FailsOnce(HandmadeRelay):
    """Fails its first run; runs as the others do after."""

    runs = 0

    async def run(self) -> None:
        self.runs += 1
        if self.runs == 1:
            self.state = "failed"
            raise RuntimeError("boom")
        await super().run()


async def test_a_tenant_relays_run_again_after_a_failure_runs_every_relay(
    offline: AsyncMongoClient[Any],
) -> None:
    # A supervisor loop runs it again: the relay that failed must not find a stop() left for
    # it (its next run returned at once, its database unrelayed, the process healthy).
    failing = FailsOnce(Outbox(offline.shop), "shop")
    other = HandmadeRelay(Outbox(offline.billing), "billing")
    tenants = TenantRelays([failing, other])
    with pytest.raises(RuntimeError, match="boom"):
        await asyncio.wait_for(tenants.run(), 5)
    assert not failing._stopping.is_set()
    other._stopping.clear()  # a HandmadeRelay's stop is not consumed by its run: reset it
    task = asyncio.ensure_future(tenants.run())
    await asyncio.wait_for(asyncio.gather(failing.running.wait(), other.running.wait()), 5)
    assert tenants.state == "active"
    tenants.stop()
    await asyncio.wait_for(task, 5)


async def test_a_relay_of_ones_own_given_to_two_tenant_relays_is_refused_at_build(
    offline: AsyncMongoClient[Any],
) -> None:
    # Only the library's relays (which take turns) were checked: a hand-made one went into both,
    # and the second's run stopped it inside the first, whose database was left unrelayed.
    shared = HandmadeRelay(Outbox(offline.shop), "shared")
    free = HandmadeRelay(Outbox(offline.billing), "free")
    first = TenantRelays([shared])
    with pytest.raises(UsageError, match="'shared' of database 'shop' belongs to another"):
        TenantRelays([free, shared])
    # The refused one took nothing: its other relay is free for a TenantRelays of its own.
    second = TenantRelays([free])
    assert first.relays == {"shop": shared} and second.relays == {"billing": free}
    del first  # gone, it no longer holds its relay
    assert TenantRelays([shared]).relays == {"shop": shared}


class Fails(HandmadeRelay):
    """Fails as soon as it runs."""

    async def run(self) -> None:
        self.state = "failed"
        raise RuntimeError(f"{self.name} broke")


async def test_when_the_last_relay_running_fails_run_raises_its_error(
    offline: AsyncMongoClient[Any],
) -> None:
    # With none left to stop, run() raised ValueError("Set of Tasks/Futures is empty") from
    # asyncio.wait instead of the relay's failure.
    alone = TenantRelays([Fails(Outbox(offline.shop), "shop")])
    with pytest.raises(RuntimeError, match="shop broke"):
        await asyncio.wait_for(alone.run(), 5)
    # The other one stopped on its own before: the failing one is again the last running.
    stopped = HandmadeRelay(Outbox(offline.shop), "stopped")
    failing = BlockedThenFails(Outbox(offline.billing), "billing")
    tenants = TenantRelays([stopped, failing])
    task = asyncio.ensure_future(tenants.run())
    await asyncio.wait_for(stopped.running.wait(), 5)
    stopped.stop()
    await asyncio.sleep(0.05)  # its task ends; the other goes on
    failing.fail.set()
    with pytest.raises(RuntimeError, match="billing broke"):
        await asyncio.wait_for(task, 5)


class BlockedThenFails(HandmadeRelay):
    """Runs until ``fail`` is set, then fails."""

    def __init__(self, outbox: Outbox, name: str) -> None:
        super().__init__(outbox, name)
        self.fail = asyncio.Event()

    async def run(self) -> None:
        self.state = "active"
        await self.fail.wait()
        self.state = "failed"
        raise RuntimeError(f"{self.name} broke")


async def test_a_supervisor_builds_a_new_tenant_relays_of_the_same_relays_once_one_ended(
    offline: AsyncMongoClient[Any],
) -> None:
    # The relays stayed the first one's for as long as it lived: a name still bound to it, or
    # its failure's traceback (which holds it in a cycle, until the garbage collector runs).
    # The supervisor's loop that builds a new one after a failure was refused.
    relays = [FailsOnce(Outbox(offline.shop), "shop"), HandmadeRelay(Outbox(offline.billing), "b")]
    first = TenantRelays(relays)
    with pytest.raises(RuntimeError, match="boom"):
        await asyncio.wait_for(first.run(), 5)
    relays[1]._stopping.clear()  # a HandmadeRelay's stop is not consumed by its run
    second = TenantRelays(relays)  # while `first` lives, as in a supervisor's loop
    task = asyncio.ensure_future(second.run())
    await asyncio.wait_for(asyncio.gather(*(relay.running.wait() for relay in relays)), 5)
    # The first, still alive, can neither run them nor stop them while the second has them.
    with pytest.raises(UsageError, match="belongs to another TenantRelays"):
        await first.run()
    first.stop()
    assert second.state == "active" and not relays[1]._stopping.is_set()
    second.stop()
    await asyncio.wait_for(task, 5)
    # Ended, the second lets them go in turn: the first runs them again.
    for relay in relays:
        relay._stopping.clear()
        relay.running.clear()
    again = asyncio.ensure_future(first.run())
    await asyncio.wait_for(asyncio.gather(*(relay.running.wait() for relay in relays)), 5)
    assert first.state == "active"
    first.stop()
    await asyncio.wait_for(again, 5)
