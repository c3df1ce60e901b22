"""Versions of an event's payload, and the upcasters that bring an old one up to date.

An event carries the ``version`` of its payload's shape (``Event.version``, 1 unless said
otherwise). A typed payload declares its own as a class attribute,
``event_version: ClassVar[int] = 3``, and ``Event.of`` stamps it. Old versions keep arriving
long after a producer moved on: redeliveries, replays, requeued dead letters, a slow consumer.
An ``Upcasters`` registry holds, for each event type, the steps from version ``n`` to ``n + 1``
of its payload; reading through it hands a handler only the version it was written for.

The registry is passed explicitly (``inbox_guard(upcasters=...)``, ``inbox_handler(...)``,
``payload_as``, ``from_json``); there is no module-level default. A global registry is filled
by import side effects, so which steps run would depend on which modules a process happened to
import, tests would leak steps into one another, and two consumers in one process could not
read one type name differently. The consumer helpers (``consume_*``) take a ``Guarded``, so the
guard's registry reaches them without another argument.

A chain must have no gap: registering steps that do not follow on from one another (or from
the steps registered before for the type) fails at once, not when an old event first arrives.
An event newer than the reader, or older than its first step, is an ``IncompatibleEventError``,
never a silent misread.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar, cast

from pydantic import BaseModel, ValidationError

from mongo_outbox._callables import is_async_callable
from mongo_outbox.errors import (
    ConfigurationError,
    IncompatibleEventError,
    InvalidEventError,
    UsageError,
)

__all__ = ["Step", "Upcasters", "version_of"]

Step = Callable[..., dict[str, Any]]
"""``step(payload) -> payload``: a version ``n`` payload (a copy the step may change) in, the
version ``n + 1`` payload out. A step that takes a ``headers`` keyword gets the event's headers
too (a copy: upcasting changes the payload and the version only)."""


class Versioned(Protocol):
    """What ``upcast`` reads of an ``Event``: named here, because ``events`` imports this
    module."""

    @property
    def id(self) -> str: ...
    @property
    def type(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def payload(self) -> dict[str, Any]: ...
    @property
    def headers(self) -> dict[str, str]: ...


E = TypeVar("E", bound=Versioned)


def version_of(model: type[BaseModel] | BaseModel) -> int:
    """The payload version a model declares as ``event_version: ClassVar[int]``, 1 when it
    declares none."""
    cls = model if isinstance(model, type) else type(model)
    if "class_version" in cls.model_fields or hasattr(cls, "class_version"):
        # The eventsourcing library's spelling: read as nothing, every event would be v1.
        raise ConfigurationError(
            f"{cls.__name__}.class_version declares a version the eventsourcing way, which "
            "mongo-outbox does not read (its events would be stamped version 1): declare "
            "event_version: ClassVar[int] instead, and register the steps from each older "
            "version (upcast_vX_vY methods are not read either) in an Upcasters registry: "
            "Upcasters().register(event_type, {1: v1_to_v2, ...}) (docs/evolving-events.md); "
            "a payload field of that name takes another attribute name and an alias",
            setting=f"{cls.__name__}.class_version",
        )
    setting = f"{cls.__name__}.event_version"
    if "event_version" in cls.model_fields:
        # A field would be sent in every payload and is not a class attribute to read here.
        raise ConfigurationError(
            f"{setting} must be a ClassVar[int], not a field of the payload", setting=setting
        )
    version = getattr(cls, "event_version", 1)
    if not _is_version(version):
        raise ConfigurationError(
            f"{setting} must be a whole number from 1, not {version!r}", setting=setting
        )
    return version


def _is_version(value: Any) -> bool:
    """A payload version: a whole number from 1 (``True`` is no version)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class Upcasters:
    """Steps that bring each event type's payload from one version to the next.

    ``register(type, {1: v1_to_v2, 2: v2_to_v3})`` adds a chain; ``upcast(event)`` brings an
    event to its type's latest version. A type with no steps registered is passed through as
    it is.
    """

    def __init__(self) -> None:
        self._steps: dict[str, dict[int, tuple[Step, bool]]] = {}
        self._lock = threading.Lock()

    def register(self, event_type: str, steps: Mapping[int, Step]) -> Upcasters:
        """Add the steps of ``event_type``: ``steps[n]`` turns a version ``n`` payload into a
        version ``n + 1`` one. The versions must follow on from one another and from the
        type's steps registered before; anything else (a gap, a version twice) raises
        ``ConfigurationError`` here and registers nothing. Returns the registry, for chaining."""
        setting = f"Upcasters.register({event_type!r})"
        if not isinstance(event_type, str) or not event_type:
            raise ConfigurationError(
                f"an event type must be a non-empty str, not {event_type!r}", setting=setting
            )
        if not isinstance(steps, Mapping) or not steps:
            raise ConfigurationError(
                f"{setting} needs a mapping of at least one version to its step", setting=setting
            )
        before = self._steps.get(event_type)
        known = before or {}
        added: dict[int, tuple[Step, bool]] = {}
        for version, step in steps.items():
            if not _is_version(version):
                raise ConfigurationError(
                    f"{setting}: a version must be a whole number from 1, not {version!r}",
                    setting=setting,
                )
            if not callable(step):
                raise ConfigurationError(
                    f"{setting}: the step from v{version} must be callable, not {step!r}",
                    setting=setting,
                )
            if _is_async(step):
                # Its coroutine would stand for the payload: every old event a failure.
                raise ConfigurationError(
                    f"{setting}: the step from v{version} is async; steps are plain functions "
                    "of the payload (do the I/O in the handler)",
                    setting=setting,
                )
            if version in known:
                raise ConfigurationError(
                    f"{setting}: a step from v{version} is registered already", setting=setting
                )
            takes = _takes_headers(step)
            if takes is None:
                raise ConfigurationError(
                    f"{setting}: the step from v{version} takes headers as a positional-only "
                    "parameter: it is passed as the keyword headers=",
                    setting=setting,
                )
            added[version] = (step, takes)
        chain = sorted(known.keys() | added.keys())
        gaps = [f"v{v}" for a, b in itertools.pairwise(chain) for v in range(a + 1, b)]
        if gaps:
            # An event of the missing version would stop there, however many steps follow.
            missing = ", ".join(f"from {gap}" for gap in gaps)
            raise ConfigurationError(
                f"{setting}: the chain v{chain[0]} -> v{chain[-1] + 1} has a gap, no step "
                f"{missing}",
                setting=setting,
            )
        with self._lock:
            if self._steps.get(event_type) is before:
                self._steps[event_type] = known | added
                return self
        # Another thread registered steps of this type meanwhile: check against them too.
        return self.register(event_type, steps)

    def latest(self, event_type: str) -> int | None:
        """The version ``event_type``'s steps lead to; ``None`` for a type without steps."""
        steps = self._steps.get(event_type)
        return max(steps) + 1 if steps else None

    def upcast(self, event: E, to: int | None = None, *, reader: str = "") -> E:
        """``event`` with its payload brought to version ``to`` (default: its type's latest),
        step by step; the event itself when it is there already, or when its type has no steps
        and no ``to`` is asked for. ``IncompatibleEventError`` if the event is newer than
        ``to``, or older than the type's first step; ``reader`` names who wanted ``to`` in its
        message (default: the registry)."""
        reader = reader or "the Upcasters registry"
        if to is not None and not _is_version(to):
            raise UsageError(f"upcast(to=...) takes a version, a whole number from 1, not {to!r}")
        target = self.latest(event.type) if to is None else to
        if target is None or event.version == target:
            return event
        if event.version > target:
            raise _newer(event, target, reader)
        steps = self._steps.get(event.type, {})
        payload: dict[str, Any] = copy.deepcopy(event.payload)
        for version in range(event.version, target):
            if version not in steps:
                raise _older(event, target, version, reader)
            step, wants_headers = steps[version]
            result = step(payload, headers=dict(event.headers)) if wants_headers else step(payload)
            if not isinstance(result, dict):
                if inspect.iscoroutine(result):
                    result.close()  # a plain function that returned one: never awaited
                raise InvalidEventError(
                    f"the upcaster of {event.type} from v{version} returned a "
                    f"{type(result).__name__}, not the payload dict",
                    event_id=event.id,
                )
            payload = result
        model = cast("type[BaseModel]", type(event))  # an Event: ``Versioned`` names no fields
        fields = {name: getattr(event, name) for name in model.model_fields}
        try:
            return type(event)(**fields | {"payload": payload, "version": target})
        except (InvalidEventError, ValidationError) as error:
            raise InvalidEventError(
                f"the upcasters of {event.type} from v{event.version} to v{target} made a payload "
                f"that is no event's: {error}",
                event_id=event.id,
            ) from error

    def __repr__(self) -> str:
        chains = ", ".join(f"{t}: v{min(s)}->v{max(s) + 1}" for t, s in sorted(self._steps.items()))
        return f"Upcasters({chains})"


def _newer(event: Versioned, supported: int, reader: str) -> IncompatibleEventError:
    return IncompatibleEventError(
        f"event {event.id} ({event.type}) is version {event.version}, newer than the "
        f"version {supported} {reader} reads: deploy a reader that knows it",
        event_id=event.id,
        event_type=event.type,
        version=event.version,
        supported=supported,
        reader=reader,
    )


def _older(event: Versioned, supported: int, missing: int, reader: str) -> IncompatibleEventError:
    return IncompatibleEventError(
        f"event {event.id} ({event.type}) is version {event.version}; {reader} reads "
        f"version {supported}, and no upcaster from v{missing} is registered: register one",
        event_id=event.id,
        event_type=event.type,
        version=event.version,
        supported=supported,
        reader=reader,
    )


def _is_async(step: Step) -> bool:
    """Whether ``step`` returns a coroutine or an async generator, never a payload: an
    ``async def`` function or method, a ``functools.partial`` of one, or an object whose
    ``__call__`` is one."""
    if is_async_callable(step):
        return True
    target: Any = step
    while isinstance(target, functools.partial):
        target = target.func
    if not (inspect.isroutine(target) or inspect.isclass(target)):
        target = getattr(target, "__call__", None)  # noqa: B004 - the method is inspected
    return inspect.isasyncgenfunction(target)


def _takes_headers(step: Step) -> bool | None:
    """Whether ``step`` takes the keyword ``headers``; None: it names it positional-only."""
    try:
        parameter = inspect.signature(step).parameters.get("headers")
    except (TypeError, ValueError):  # a builtin without a signature: the payload only
        return False
    if parameter is None:
        return False
    return None if parameter.kind is inspect.Parameter.POSITIONAL_ONLY else True
