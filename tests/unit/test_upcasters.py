"""Event versions and the upcaster registry, without a server: a chain upcasts as its steps do
one by one, a gap fails at registration, and a version no step reaches is refused, not
misread."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from mongo_outbox import (
    ConfigurationError,
    Event,
    IncompatibleEventError,
    InvalidEventError,
    OutboxError,
    Upcasters,
    UsageError,
)
from mongo_outbox.upcasters import version_of

Step = Callable[[dict[str, Any]], dict[str, Any]]


def make_step(version: int, kind: str, key: str) -> Step:
    """A step that changes the payload in place (as real steps do) in a way whose order
    shows: it appends its version to a trail, and then sets, drops or nests."""

    def step(payload: dict[str, Any]) -> dict[str, Any]:
        payload["trail"] = [*payload.get("trail", []), version]
        if kind == "set":
            payload[key] = version
        elif kind == "drop":
            payload.pop(key, None)
        else:
            payload = {"inner": payload, "trail": payload["trail"]}
        return payload

    return step


chains = st.tuples(
    st.integers(1, 5),  # the first version with a step
    st.lists(
        st.tuples(st.sampled_from(["set", "drop", "nest"]), st.sampled_from("abc")),
        min_size=1,
        max_size=6,
    ),
)


def steps_of(first: int, kinds: list[tuple[str, str]]) -> dict[int, Step]:
    return {first + i: make_step(first + i, kind, key) for i, (kind, key) in enumerate(kinds)}


@given(chains, st.data())
def test_upcasting_a_chain_gives_what_its_steps_give_one_by_one(
    chain: tuple[int, list[tuple[str, str]]], data: st.DataObject
) -> None:
    first, kinds = chain
    steps = steps_of(first, kinds)
    latest = first + len(kinds)
    upcasters = Upcasters().register("t", steps)
    assert upcasters.latest("t") == latest
    start = data.draw(st.integers(first, latest), label="start")
    target = data.draw(st.integers(start, latest), label="target")
    payload = data.draw(
        st.dictionaries(st.sampled_from("abcx"), st.integers(-(2**63), 2**63 - 1)), label="payload"
    )
    event = Event(type="t", payload=payload, version=start, headers={"h": "1"})
    before = copy.deepcopy(event.payload)

    expected = copy.deepcopy(payload)
    for version in range(start, target):
        expected = steps[version](expected)

    upcast = upcasters.upcast(event, target)
    assert (upcast.payload, upcast.version) == (expected, target)
    # Everything else is the event's, and the event itself is untouched (its record keeps it).
    assert upcast.model_dump(exclude={"payload", "version"}) == event.model_dump(
        exclude={"payload", "version"}
    )
    assert event.payload == before and event.version == start
    # Through the latest by default, in one go or in two legs.
    full = upcasters.upcast(event)
    assert full == upcasters.upcast(upcast)
    assert full.version == latest


@given(chains, st.data())
def test_a_chain_registered_in_pieces_upcasts_as_one_registered_at_once(
    chain: tuple[int, list[tuple[str, str]]], data: st.DataObject
) -> None:
    first, kinds = chain
    steps = steps_of(first, kinds)
    versions = sorted(steps)
    cuts = (
        sorted(data.draw(st.sets(st.integers(1, len(versions) - 1)), label="cuts"))
        if len(versions) > 1
        else []
    )
    pieces = [versions[a:b] for a, b in zip([0, *cuts], [*cuts, len(versions)], strict=True)]
    order = data.draw(st.permutations(pieces), label="order")
    pieced = Upcasters()
    registered: set[int] = set()
    for piece in order:
        union = sorted(registered | set(piece))
        contiguous = union == list(range(union[0], union[-1] + 1))
        if not contiguous:
            with pytest.raises(ConfigurationError, match="has a gap"):
                pieced.register("t", {v: steps[v] for v in piece})
            # A refused registration adds nothing: the registry still upcasts what it had.
            assert pieced.latest("t") == (max(registered) + 1 if registered else None)
            return
        pieced.register("t", {v: steps[v] for v in piece})
        registered |= set(piece)
    event = Event(type="t", payload={"a": 1}, version=first)
    assert pieced.upcast(event) == Upcasters().register("t", steps).upcast(event)


@given(st.sets(st.integers(1, 12), min_size=1))
def test_a_chain_with_a_gap_fails_at_registration(versions: set[int]) -> None:
    contiguous = sorted(versions) == list(range(min(versions), max(versions) + 1))
    steps = {v: make_step(v, "set", "a") for v in versions}
    if contiguous:
        assert Upcasters().register("t", steps).latest("t") == max(versions) + 1
    else:
        with pytest.raises(ConfigurationError, match="has a gap, no step from v"):
            Upcasters().register("t", steps)


def test_a_gap_is_named_and_a_step_cannot_be_registered_twice() -> None:
    upcasters = Upcasters().register("t", {1: dict, 2: dict})
    with pytest.raises(ConfigurationError, match=r"no step from v3, from v4") as gap:
        upcasters.register("t", {5: dict})
    assert gap.value.setting == "Upcasters.register('t')"
    with pytest.raises(ConfigurationError, match="from v2 is registered already"):
        upcasters.register("t", {2: dict, 3: dict})
    assert upcasters.latest("t") == 3  # neither refusal added a step
    upcasters.register("t", {3: dict})  # the chain goes on where it ended
    assert upcasters.latest("t") == 4
    for bad in ({}, {0: dict}, {True: dict}, {1: "not callable"}):
        with pytest.raises(ConfigurationError):
            Upcasters().register("t", bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        Upcasters().register("", {1: dict})


def test_an_event_newer_than_the_reader_is_refused_with_its_own_error() -> None:
    upcasters = Upcasters().register("order.placed", {1: dict, 2: dict})
    event = Event(type="order.placed", version=4, payload={"a": 1})
    with pytest.raises(IncompatibleEventError) as refused:
        upcasters.upcast(event)
    error = refused.value
    assert isinstance(error, OutboxError) and not isinstance(error, InvalidEventError)
    assert (error.event_id, error.event_type, error.version, error.supported) == (
        event.id,
        "order.placed",
        4,
        3,
    )
    assert error.newer and "newer than the version 3" in str(error)
    assert error.reader == "the Upcasters registry"
    with pytest.raises(IncompatibleEventError) as refused:
        upcasters.upcast(event, 2, reader="consumer billing")
    assert refused.value.reader == "consumer billing"


def test_an_event_older_than_the_first_step_is_refused_naming_the_missing_step() -> None:
    upcasters = Upcasters().register("t", {2: dict})
    with pytest.raises(IncompatibleEventError, match="no upcaster from v1") as refused:
        upcasters.upcast(Event(type="t", version=1))
    assert not refused.value.newer and refused.value.supported == 3


def test_a_type_without_steps_passes_through_and_a_step_sees_the_headers() -> None:
    def currency(payload: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        headers["changed"] = "no effect"  # a copy
        return payload | {"currency": headers.get("currency", "EUR")}

    upcasters = Upcasters().register("t", {1: currency})
    other = Event(type="other", version=7)
    assert upcasters.upcast(other) is other
    event = Event(type="t", payload={"cents": 5}, headers={"currency": "USD"})
    assert upcasters.upcast(event).payload == {"cents": 5, "currency": "USD"}
    assert event.headers == {"currency": "USD"}


def test_a_step_whose_headers_are_positional_only_is_refused_when_registered() -> None:
    # It was registered, then failed with a TypeError at every upcast: headers go by keyword.
    def positional(payload: dict[str, Any], headers: dict[str, str], /) -> dict[str, Any]:
        return payload

    with pytest.raises(ConfigurationError, match="headers as a positional-only parameter"):
        Upcasters().register("t", {1: positional})


async def async_step(payload: dict[str, Any], extra: int = 0) -> dict[str, Any]:
    return payload


async def async_generator_step(payload: dict[str, Any]) -> Any:
    yield payload


class AsyncCall:
    async def __call__(self, payload: dict[str, Any]) -> dict[str, Any]:
        return payload

    async def method(self, payload: dict[str, Any]) -> dict[str, Any]:
        return payload


class AsyncGeneratorCall:
    async def __call__(self, payload: dict[str, Any]) -> Any:
        yield payload


@pytest.mark.parametrize(
    "step",
    [
        async_step,
        functools.partial(async_step, extra=1),
        functools.partial(functools.partial(async_step), extra=1),
        AsyncCall(),
        functools.partial(AsyncCall()),
        AsyncCall().method,
        async_generator_step,
        AsyncGeneratorCall(),
    ],
    ids=[
        "async-def",
        "partial",
        "partial-of-partial",
        "async-call",
        "partial-of-async-call",
        "async-method",
        "async-generator",
        "async-generator-call",
    ],
)
def test_an_async_step_is_refused_when_registered(step: Any) -> None:
    # It was registered, and its coroutine stood for the payload: every old event retried,
    # then dead-lettered.
    upcasters = Upcasters()
    with pytest.raises(ConfigurationError, match="the step from v1 is async") as refused:
        upcasters.register("t", {1: step})
    assert refused.value.setting == "Upcasters.register('t')"
    assert upcasters.latest("t") is None  # nothing registered


def test_a_plain_step_that_returns_a_coroutine_fails_without_leaving_it_unawaited() -> None:
    # Registration cannot see it; the upcast refuses the coroutine, and closes it (else a
    # "never awaited" warning, an error under this suite's filterwarnings).
    upcasters = Upcasters().register("t", {1: lambda payload: async_step(payload)})
    with pytest.raises(InvalidEventError, match="returned a coroutine, not the payload dict"):
        upcasters.upcast(Event(type="t", payload={"a": 1}))


def test_steps_registered_from_two_threads_at_once_are_all_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    import mongo_outbox.upcasters as module

    upcasters = Upcasters()
    inside, go_on = threading.Event(), threading.Event()
    real = module._takes_headers

    def slow(step: Any) -> bool | None:
        # The first registration checks its step while the second one registers.
        if threading.current_thread().name == "first":
            inside.set()
            go_on.wait(5)
        return real(step)

    monkeypatch.setattr(module, "_takes_headers", slow)
    first = threading.Thread(target=upcasters.register, args=("t", {2: lambda p: p}), name="first")
    first.start()
    inside.wait(5)
    upcasters.register("t", {1: lambda p: p})
    go_on.set()
    first.join(5)
    # Both steps: v1 events upcast to v3 (one of them was lost, and v1 events refused).
    assert upcasters.latest("t") == 3
    assert upcasters.upcast(Event(type="t", version=1, payload={"a": 1})).version == 3


def test_a_step_that_returns_no_payload_is_an_invalid_event() -> None:
    upcasters = Upcasters().register("t", {1: lambda payload: None})
    with pytest.raises(InvalidEventError, match="upcaster of t from v1 returned a NoneType"):
        upcasters.upcast(Event(type="t"))
    broken = Upcasters().register("t", {1: lambda payload: {"n": float("nan")}})
    event = Event(type="t")
    with pytest.raises(InvalidEventError, match="upcasters of t from v1 to v2 made a payload") as e:
        broken.upcast(event)
    assert e.value.event_id == event.id


@pytest.mark.parametrize("to", ["2", 1.5, True, 0, -1])
def test_upcast_to_anything_but_a_version_is_refused(to: Any) -> None:
    upcasters = Upcasters().register("t", {1: lambda payload: payload})
    with pytest.raises(UsageError, match="a whole number from 1"):
        upcasters.upcast(Event(type="t"), to=to)


class PlacedV1(BaseModel):
    order: str
    euros: int


class PlacedV2(BaseModel):
    event_version: ClassVar[int] = 2
    order: str
    cents: int


class PlacedV3(BaseModel):
    event_version: ClassVar[int] = 3
    order: str
    cents: int
    currency: str


PLACED = Upcasters().register(
    "order.placed",
    {
        1: lambda p: {"order": p["order"], "cents": p["euros"] * 100},
        2: lambda p: p | {"currency": "EUR"},
    },
)


def test_event_of_stamps_the_version_the_model_declares() -> None:
    assert version_of(PlacedV1) == 1 and version_of(PlacedV3(order="o", cents=1, currency="x")) == 3
    event = Event.of(PlacedV3(order="o", cents=1, currency="EUR"), type="order.placed")
    assert event.version == 3
    assert Event.of(PlacedV1(order="o", euros=1), type="order.placed").version == 1
    assert Event.of(PlacedV3(order="o", cents=1, currency="EUR"), type="t", version=3).version == 3
    with pytest.raises(InvalidEventError, match="not the version 3 that PlacedV3 declares"):
        Event.of(PlacedV3(order="o", cents=1, currency="EUR"), type="t", version=2)
    assert Event(type="untyped", version=5).version == 5  # untyped events say it themselves


def test_a_model_declares_its_version_as_a_class_variable_only() -> None:
    class AsField(BaseModel):
        event_version: int = 2

    class Zero(BaseModel):
        event_version: ClassVar[int] = 0

    class Text(BaseModel):
        event_version: ClassVar[Any] = "2"

    with pytest.raises(ConfigurationError, match="must be a ClassVar"):
        Event.of(AsField(), type="t")
    for model in (Zero, Text):
        with pytest.raises(ConfigurationError, match="whole number from 1") as bad:
            version_of(model)
        assert bad.value.setting == f"{model.__name__}.event_version"


class EventsourcingStyle(BaseModel):
    """How the eventsourcing library declares a version, and its upcaster."""

    class_version: ClassVar[int] = 2
    order: str
    cents: int

    @staticmethod
    def upcast_v1_v2(state: dict[str, Any]) -> None:
        state["cents"] = state.pop("euros") * 100


class ClassVersionField(BaseModel):
    class_version: int = 2
    order: str


class BothVersions(BaseModel):
    event_version: ClassVar[int] = 2
    class_version: ClassVar[int] = 2


@pytest.mark.parametrize("model", [EventsourcingStyle, ClassVersionField, BothVersions])
def test_a_class_version_is_refused_with_a_pointer_to_event_version_and_upcasters(
    model: type[BaseModel],
) -> None:
    # It was stamped version 1 in silence (a field of that name travelled in the payload).
    for use in (
        lambda: Event.of(model.model_construct(order="o", cents=1), type="order.placed"),
        lambda: Event(type="order.placed", payload={"order": "o"}).payload_as(model),
        lambda: version_of(model),
    ):
        with pytest.raises(ConfigurationError, match="event_version: ClassVar") as refused:
            use()
        assert refused.value.setting == f"{model.__name__}.class_version"
        assert "Upcasters().register(" in str(refused.value)


def test_a_payload_field_may_be_sent_as_class_version_under_another_name() -> None:
    from pydantic import Field

    class Course(BaseModel):
        grade: int = Field(alias="class_version")

    event = Event.of(Course(class_version=3), type="course.created")
    assert (event.version, event.payload) == (1, {"class_version": 3})
    assert event.payload_as(Course) == Course(class_version=3)


def test_payload_as_upcasts_to_the_models_version_and_refuses_a_newer_event() -> None:
    old = Event(type="order.placed", payload={"order": "o", "euros": 3})
    assert old.payload_as(PlacedV3, PLACED) == PlacedV3(order="o", cents=300, currency="EUR")
    assert old.payload_as(PlacedV2, PLACED) == PlacedV2(order="o", cents=300)  # part of the way
    assert old.payload_as(PlacedV1) == PlacedV1(order="o", euros=3)
    with pytest.raises(IncompatibleEventError, match="the model PlacedV3 reads version 3"):
        old.payload_as(PlacedV3)  # no upcasters: never validated as if it were v3
    new = Event.of(PlacedV3(order="o", cents=1, currency="EUR"), type="order.placed")
    for model in (PlacedV1, PlacedV2):
        with pytest.raises(IncompatibleEventError, match="newer than") as refused:
            new.payload_as(model, PLACED)
        assert refused.value.newer
    with pytest.raises(InvalidEventError, match=r"\(order.placed, v3\) is not a PlacedV3"):
        Event(type="order.placed", version=3, payload={"order": "o"}).payload_as(PlacedV3)


def test_from_json_with_upcasters_reads_the_latest_version() -> None:
    old = Event(type="order.placed", payload={"order": "o", "euros": 3})
    body = old.model_dump_json()
    assert Event.from_json(body) == old
    read = Event.from_json(body, PLACED)
    assert read == PLACED.upcast(old) and read.version == 3
    newer = Event(type="order.placed", version=9).model_dump_json()
    with pytest.raises(IncompatibleEventError):
        Event.from_json(newer, PLACED)
