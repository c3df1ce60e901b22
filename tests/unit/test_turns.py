"""Turns: the rounds of several tenants in one process take turns in rotation, each a short
one while others are active (``mongo_outbox/_relay/turns.py``). Pure asyncio, no server."""

from __future__ import annotations

import asyncio

import pytest

from mongo_outbox._relay.turns import Turns


async def test_a_busy_tenant_yields_to_each_waiting_tenant_in_rotation() -> None:
    turns = Turns()
    order: list[str] = []

    async def rounds(tenant: str, count: int) -> None:
        for _ in range(count):
            async with turns.turn(tenant):
                order.append(tenant)
                await asyncio.sleep(0)  # a round awaits MongoDB and the broker

    await asyncio.gather(rounds("a", 6), rounds("b", 2), rounds("c", 2))
    assert order == ["a", "b", "c", "a", "b", "c", "a", "a", "a", "a"]
    assert list(turns.history) == order


async def test_a_tenant_alone_takes_turn_after_turn_with_full_rounds() -> None:
    turns = Turns()
    for _ in range(3):
        async with turns.turn("a"):
            assert turns.share("a", 100) == 100


async def test_while_others_are_active_a_round_claims_a_smaller_share() -> None:
    turns = Turns()
    for tenant in ("a", "b", "c"):
        async with turns.turn(tenant):
            pass  # empty polls: nobody is active
    assert turns.share("a", 100) == 100
    for tenant in ("a", "b", "c"):
        turns.worked(tenant)
    assert turns.share("a", 100) == 100 // 9  # three active: 1/n² each
    assert turns.share("a", 5) == 1  # never nothing


async def test_a_waiter_cancelled_passes_its_turn_on() -> None:
    turns = Turns()
    entered = asyncio.Event()
    release = asyncio.Event()

    async def hold() -> None:
        async with turns.turn("a"):
            entered.set()
            await release.wait()

    holder = asyncio.create_task(hold())
    await entered.wait()
    cancelled = asyncio.create_task(turns.turn("b").__aenter__())
    after: list[str] = []

    async def later() -> None:
        async with turns.turn("c"):
            after.append("c")

    waiting = asyncio.create_task(later())
    await asyncio.sleep(0)
    cancelled.cancel()
    release.set()
    await holder
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await asyncio.wait_for(waiting, 5)
    assert after == ["c"]
