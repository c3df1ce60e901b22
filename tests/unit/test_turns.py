"""Turns: the rounds of several tenants in one process take turns in rotation, each a short
one while others are active (``mongo_outbox/_relay/turns.py``). Pure asyncio, no server."""

from __future__ import annotations

import asyncio

import pytest

from mongo_outbox._relay.turns import Turns


class Clock:
    """A fake monotonic clock: a turn lasts what the test says it does."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_busy_tenant_yields_to_each_waiting_tenant_in_rotation() -> None:
    turns = Turns(clock=Clock())  # every turn takes no time: the rotation alone decides
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
    assert turns.share("a", 100, timed=False) == 100
    for tenant in ("a", "b", "c"):
        turns.worked(tenant)
    assert turns.share("a", 100, timed=False) == 100 // 9  # three active: 1/n² each
    assert turns.share("a", 5, timed=False) == 1  # never nothing


async def test_a_tenant_waiting_for_a_turn_counts_as_active() -> None:
    turns = Turns()
    entered = asyncio.Event()
    release = asyncio.Event()

    async def hold() -> None:
        async with turns.turn("a"):
            entered.set()
            await release.wait()

    holder = asyncio.create_task(hold())
    await entered.wait()
    waiter = asyncio.create_task(turns.turn("b").__aenter__())
    await asyncio.sleep(0)
    # b never claimed anything yet, but it waits now: a's next round is shared.
    assert turns.share("a", 100, timed=False) == 100 // 4
    release.set()
    await holder
    await waiter


async def test_beside_others_rounds_start_at_one_and_grow_while_their_turns_are_short() -> None:
    clock = Clock()
    turns = Turns(budget=0.25, clock=clock)
    for tenant in ("a", "b"):  # as TenantRelays puts them in the rotation
        turns.join(tenant)

    async def round_of(seconds: float, full: bool = True) -> int:
        turns.worked("b")  # b sends events all along
        size = turns.share("a", 100)
        async with turns.turn("a"):
            clock.now += seconds
        turns.sized("a", size, full)
        return size

    assert [await round_of(0.01) for _ in range(4)] == [1, 2, 4, 8]
    assert await round_of(0.01, full=False) == 16  # found fewer: says nothing of a full one
    assert await round_of(1.0) == 16  # too long: halved
    assert [await round_of(0.2) for _ in range(2)] == [8, 8]  # within budget, not well within
    alone = Turns(clock=clock)
    assert alone.share("a", 100) == 100  # a tenant alone takes full rounds


async def test_on_a_server_slower_than_the_budget_rounds_grow_while_entries_add_little() -> None:
    clock = Clock()
    turns = Turns(budget=0.25, clock=clock)
    for tenant in ("a", "b"):
        turns.join(tenant)

    async def round_of(fixed: float, per_entry: float) -> int:
        turns.worked("b")
        size = turns.share("a", 100)
        async with turns.turn("a"):
            clock.now += fixed + per_entry * size
        turns.sized("a", size, full=True)
        return size

    # Any command takes 0.5 s: a round grows while its entries add under half of that.
    assert [await round_of(0.5, 0.05) for _ in range(5)] == [1, 2, 4, 8, 8]
    slow = Turns(budget=0.25, clock=clock)
    for tenant in ("a", "b"):
        slow.join(tenant)
    turns = slow
    # Entries cost it all (0.2 s each): two fit in twice the shortest turn, no more.
    assert [await round_of(0.0, 0.2) for _ in range(4)] == [1, 2, 2, 2]


async def test_while_the_others_are_idle_a_round_may_take_longer_turns() -> None:
    clock = Clock()
    turns = Turns(budget=0.25, clock=clock)
    for tenant in ("a", "b"):
        turns.join(tenant)

    async def round_of(seconds: float) -> int:
        size = turns.share("a", 100)
        async with turns.turn("a"):
            clock.now += seconds
        turns.sized("a", size, full=True)
        return size

    # Four times the budget: 0.6 s turns hold steady, 2 s ones halve the size.
    assert [await round_of(0.01) for _ in range(3)] == [4, 8, 16]
    assert [await round_of(0.6) for _ in range(2)] == [32, 32]
    assert await round_of(2.0) == 32
    assert await round_of(0.6) == 16
    turns.worked("b")  # b has events again: back to the budget's own size
    assert turns.share("a", 100) == 4


async def test_a_tenant_of_short_turns_goes_ahead_of_one_that_used_more_time() -> None:
    clock = Clock()
    turns = Turns(budget=0.25, clock=clock)
    order: list[str] = []

    async def rounds(tenant: str, count: int, seconds: float) -> None:
        for _ in range(count):
            async with turns.turn(tenant):
                order.append(tenant)
                await asyncio.sleep(0)
                clock.now += seconds

    await asyncio.gather(rounds("a", 4, 1.0), rounds("b", 4, 0.01), rounds("c", 4, 0.01))
    # In plain rotation b and c would each wait for one of a's 1 s turns per turn of theirs:
    # a (1 s) has used more than b and c (10 ms each) until they are done.
    assert order[:2] == ["a", "b"] and order[-3:] == ["a", "a", "a"], order
    assert order.index("a", 1) > max(i for i, t in enumerate(order) if t != "a"), order


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
