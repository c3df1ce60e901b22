"""The broker options of the commands that publish (``relay``, ``replay``): NATS JetStream
(``--nats URL --subject TEMPLATE``) or RabbitMQ (``--rabbitmq URL --exchange NAME --routing-key
TEMPLATE``), each with its environment twin. Each broker is a ``Broker`` subclass listed in
``COMMAND_LINE``: its options, how it renders a destination and how it connects; its publisher
comes from its package in ``mongo_outbox.brokers``.

A template is rendered against a sample event before anything connects, so a typo fails the
command at once instead of parking every event it publishes.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import click

from mongo_outbox.brokers import BROKERS
from mongo_outbox.cli.common import Failure, hide, one_line, option
from mongo_outbox.cloudevents import CloudEvents
from mongo_outbox.errors import ConfigurationError, InvalidEventError
from mongo_outbox.events import Event
from mongo_outbox.publishers import Publisher

log = logging.getLogger("mongo_outbox.cli")

F = TypeVar("F", bound=Callable[..., Any])

SUBJECT = "events.{aggregate_type}.{type}"
EXCHANGE = "events"
ROUTING_KEY = "{type}"
PROBE_TIMEOUT = 3.0
"""Seconds a broker has to answer the first connection before the command gives up."""


class Broker(abc.ABC):
    """The broker a publishing command was given, with its settings: what the command needs of
    it. Each broker the command line publishes to is one subclass, listed in ``COMMAND_LINE``."""

    name: ClassVar[str]
    """Its package in ``mongo_outbox.brokers``, and its URL option (``--nats``)."""
    url_help: ClassVar[str]
    options: ClassVar[tuple[tuple[str, dict[str, Any]], ...]]
    """Its own options beyond its URL, each a flag and its click settings."""
    naming_flag: ClassVar[str]
    """The option of the template the destination is rendered from."""
    url: str
    naming: str
    cloudevents: CloudEvents | None
    """Publish CloudEvents (``--cloudevents-source``), or the Event's own JSON."""

    @classmethod
    @abc.abstractmethod
    def given(cls, url: str, values: dict[str, Any]) -> Broker:
        """The broker at ``url``, from the values of its ``options`` (by parameter name)."""
        raise NotImplementedError

    @abc.abstractmethod
    def describe(self) -> str:
        raise NotImplementedError

    @abc.abstractmethod
    def render(self, sample: Event) -> str:
        """The destination ``naming`` gives ``sample``; ``InvalidEventError`` if it has none."""
        raise NotImplementedError

    @abc.abstractmethod
    async def open(self, sample: Event, waits: bool) -> Publisher:
        raise NotImplementedError

    def check(self, sample: Event) -> str:
        """Render the template for ``sample``; a one-line failure if it cannot be."""
        try:
            return self.render(sample)
        except ImportError:
            extra = BROKERS[self.name].extra
            raise Failure(f"--{self.name} needs pip install 'mongo-outbox[{extra}]'") from None
        except InvalidEventError as error:
            raise Failure(
                f"bad {self.naming_flag} {self.naming!r}: {one_line(error)} (a template takes "
                "the event's fields: {type}, {aggregate_type}, {aggregate_id}, {sequence}, {id}...)"
            ) from None

    async def connect(self, sample: Event, *, waits: bool = True) -> Publisher:
        """Connect (a one-line failure if the broker does not answer); ``waits``: whether the
        command's events wait for a destination that is missing (a relay) or fail (a replay)."""
        try:
            return await self.open(sample, waits)
        except (ConnectionError, OSError, TimeoutError) as error:
            raise Failure(f"broker unreachable: {one_line(error)}") from None


@dataclass(frozen=True)
class Nats(Broker):
    name: ClassVar[str] = "nats"
    url_help: ClassVar[str] = "Publish to NATS JetStream (servers comma-separated)."
    options: ClassVar[tuple[tuple[str, dict[str, Any]], ...]] = (
        ("--subject", {"metavar": "TEMPLATE", "help": f"NATS subject [default: {SUBJECT}]."}),
    )
    naming_flag: ClassVar[str] = "--subject"
    url: str
    naming: str
    cloudevents: CloudEvents | None = None

    @classmethod
    def given(cls, url: str, values: dict[str, Any]) -> Broker:
        return cls(url, values["subject"] or SUBJECT)

    def describe(self) -> str:
        return f"NATS {hide(self.url)}, subject {self.naming}{_as_cloudevents(self)}"

    def render(self, sample: Event) -> str:
        from mongo_outbox.brokers.nats.publisher import subject_of

        return subject_of(self.naming, sample)

    async def open(self, sample: Event, waits: bool) -> Publisher:
        """Warn when no JetStream stream takes the sample's subject: saying that its events
        wait for one (a relay, which ``waits``) or fail (a replay)."""
        from mongo_outbox.brokers.nats.publisher import NatsPublisher

        await _probe_nats(self.url)
        nats = await NatsPublisher.connect(
            self.url, subject=self.naming, cloudevents=self.cloudevents
        )
        try:
            await _warn_without_stream(nats, self.check(sample), waits)
        except BaseException:
            await nats.aclose()
            raise
        return nats


@dataclass(frozen=True)
class RabbitMQ(Broker):
    name: ClassVar[str] = "rabbitmq"
    url_help: ClassVar[str] = "Publish to RabbitMQ."
    options: ClassVar[tuple[tuple[str, dict[str, Any]], ...]] = (
        (
            "--exchange",
            {"metavar": "NAME", "help": f"RabbitMQ topic exchange [default: {EXCHANGE}]."},
        ),
        (
            "--routing-key",
            {"metavar": "TEMPLATE", "help": f"RabbitMQ routing key [default: {ROUTING_KEY}]."},
        ),
        (
            "--declare-exchange",
            {
                "is_flag": True,
                "help": "Declare --exchange (a durable topic exchange) if it does not exist; "
                f"without it, a named exchange must exist (the default, {EXCHANGE}, is always "
                "declared).",
            },
        ),
        (
            "--max-message-size",
            {
                "metavar": "BYTES",
                "type": click.IntRange(min=1),
                "help": "The broker's max_message_size in bytes: a longer message is refused "
                "before it is sent (relay parks it, replay counts it failed) [default: the "
                "broker version's default, RabbitMQ 4: 16777216 (16 MiB), 3: 134217728].",
            },
        ),
    )
    naming_flag: ClassVar[str] = "--routing-key"
    url: str
    naming: str
    exchange: str = EXCHANGE
    declare: bool = True
    """Declare the exchange (the default one, or --declare-exchange), or require it."""
    max_message_size: int | None = None
    cloudevents: CloudEvents | None = None

    @classmethod
    def given(cls, url: str, values: dict[str, Any]) -> Broker:
        # The default exchange is declared; one the user names must exist, unless they ask
        # for it to be declared: a misspelled name would otherwise be a new, unbound exchange.
        exchange = values["exchange"]
        declare = values["declare_exchange"] or exchange is None
        return cls(
            url,
            values["routing_key"] or ROUTING_KEY,
            exchange or EXCHANGE,
            declare,
            values["max_message_size"],
        )

    def describe(self) -> str:
        return (
            f"RabbitMQ {hide(self.url)}, exchange {self.exchange}, routing key {self.naming}"
            f"{_as_cloudevents(self)}"
        )

    def render(self, sample: Event) -> str:
        from mongo_outbox.brokers.rabbitmq.publisher import routing_key_of

        return routing_key_of(self.naming, sample)

    async def open(self, sample: Event, waits: bool) -> Publisher:
        from mongo_outbox.brokers.rabbitmq.publisher import RabbitMQPublisher

        try:
            return await RabbitMQPublisher.connect(
                self.url,
                exchange=self.exchange,
                routing_key=self.naming,
                declare=self.declare,
                max_message_size=self.max_message_size,
                cloudevents=self.cloudevents,
            )
        except ConfigurationError as error:
            raise Failure(
                f"{one_line(error)}: a misspelling? Create it, or pass --declare-exchange "
                "to have it declared as a durable topic exchange"
            ) from None


COMMAND_LINE: dict[str, type[Broker]] = {broker.name: broker for broker in (Nats, RabbitMQ)}
"""The brokers the publishing commands take, in the order ``--help`` lists them."""


def _as_cloudevents(broker: Broker) -> str:
    ce = broker.cloudevents
    return "" if ce is None else f", as CloudEvents ({ce.mode} mode, source {ce.source})"


# Options of every broker: how the events are written, not where they go.
_CLOUDEVENTS_OPTIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "--cloudevents-source",
        {
            "metavar": "URI",
            "help": "Publish CloudEvents 1.0 with this source, a URI reference naming the "
            "producer (docs/cloudevents.md) [default: the Event's own JSON].",
        },
    ),
    (
        "--cloudevents-mode",
        {
            "type": click.Choice(["binary", "structured"]),
            "help": "With --cloudevents-source: the attributes as headers and the payload as "
            "the body (binary), or one application/cloudevents+json document [default: binary].",
        },
    ),
)


def _cloudevents(source: str | None, mode: str | None) -> CloudEvents | None:
    if source is None:
        if mode is not None:
            raise Failure("--cloudevents-mode needs --cloudevents-source")
        return None
    try:
        return CloudEvents(source, "structured" if mode == "structured" else "binary")
    except ConfigurationError as error:
        # The option is what the user gave: named as they know it, not as the library's setting.
        raise Failure(str(error).replace("CloudEvents.source", "--cloudevents-source", 1)) from None


async def _probe_nats(url: str) -> None:
    """Fail at once when no NATS server answers: nats-py retries a refused first connection
    (the publisher's until its timeout, logging each), so the probe gives up once every server
    of the list has failed once."""
    import nats

    servers = [server.strip() for server in url.split(",")]
    errors: list[BaseException] = []
    every_server_failed = asyncio.Event()

    async def failed(error: Exception) -> None:
        errors.append(error)
        if len(errors) >= len(servers):
            every_server_failed.set()

    connecting = asyncio.ensure_future(
        nats.connect(servers, connect_timeout=PROBE_TIMEOUT, error_cb=failed)
    )
    given_up = asyncio.ensure_future(every_server_failed.wait())
    try:
        await asyncio.wait(
            {connecting, given_up}, timeout=2 * PROBE_TIMEOUT, return_when="FIRST_COMPLETED"
        )
    except BaseException:  # cancelled (a signal while it starts): leave no connection behind
        connecting.cancel()
        raise
    finally:
        given_up.cancel()
    if connecting.done() and not connecting.cancelled():
        error = connecting.exception()
        if error is None:
            await connecting.result().close()
            return
        errors.append(error)
    connecting.cancel()
    await asyncio.wait({connecting})
    reason = one_line(errors[-1]) if errors else f"no answer within {2 * PROBE_TIMEOUT:g}s"
    raise ConnectionError(f"NATS at {hide(url)}: {reason}")


async def _warn_without_stream(publisher: Any, subject: str, waits: bool) -> None:
    try:
        await publisher.js.find_stream_name_by_subject(subject)
    except Exception:  # noqa: BLE001 - nats-py's NotFoundError, or no answer: only a warning
        # The relay's events wait for a stream; a replay does not wait, and counts them failed.
        then = (
            "events wait, without counting attempts, until a stream does"
            if waits
            else "the replay fails the events no stream takes, and does not wait for one"
        )
        log.warning("no JetStream stream takes %s (a sample subject): %s", subject, then)


def broker_options(function: F) -> F:
    """Add the broker options to a command, which receives them as one ``broker: Broker``."""
    return _with_broker_options(function, optional=False)


def optional_broker_options(function: F) -> F:
    """``broker_options`` for a command that may run without a broker (``replay --dry-run``):
    it receives ``broker=None`` when none is named, and decides itself whether it needs one."""
    return _with_broker_options(function, optional=True)


def name_one_broker() -> Failure:
    named = " or ".join(f"--{name} URL" for name in COMMAND_LINE)
    return Failure(f"name one broker: {named}")


def _with_broker_options(function: F, *, optional: bool) -> F:
    @functools.wraps(function)
    def command(**given: Any) -> Any:
        urls = {name: given.pop(name) for name in COMMAND_LINE}
        cloudevents = _cloudevents(given.pop("cloudevents_source"), given.pop("cloudevents_mode"))
        values = {
            name: {_parameter(flag): given.pop(_parameter(flag)) for flag, _ in broker.options}
            for name, broker in COMMAND_LINE.items()
        }
        chosen = [name for name, url in urls.items() if url]
        if not chosen and optional:
            # A broker's own options without its URL (--subject, or their environment twins)
            # have nothing to apply to; the command refuses when it needs a broker.
            return function(broker=None, **given)
        if len(chosen) != 1:
            raise name_one_broker()
        broker = COMMAND_LINE[chosen[0]]
        for other in COMMAND_LINE.values():
            if other is not broker and any(values[other.name].values()):
                raise Failure(f"{_listed(other)} for --{other.name}; use {broker.naming_flag}")
        hide(urls[broker.name])
        chosen_broker = broker.given(urls[broker.name], values[broker.name])
        if cloudevents is not None:
            chosen_broker = dataclasses.replace(chosen_broker, cloudevents=cloudevents)  # type: ignore[type-var]
        return function(broker=chosen_broker, **given)

    # Applied last to first, so that --help lists them in COMMAND_LINE's order, then the
    # options of every broker.
    for flag, settings in reversed(_CLOUDEVENTS_OPTIONS):
        command = option(flag, **settings)(command)
    for broker in reversed(COMMAND_LINE.values()):
        for flag, settings in reversed(broker.options):
            command = option(flag, **settings)(command)
        command = option(f"--{broker.name}", metavar="URL", help=broker.url_help)(command)
    return command  # type: ignore[return-value]


def _parameter(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _listed(broker: type[Broker]) -> str:
    """``--a is``, ``--a and --b are``, ``--a, --b and --c are``: a broker's own options."""
    flags = [flag for flag, _ in broker.options]
    if len(flags) == 1:
        return f"{flags[0]} is"
    return f"{', '.join(flags[:-1])} and {flags[-1]} are"


def sample_event(collections: tuple[str, ...]) -> Event:
    """An event like the ones the relay publishes, to render templates with."""
    return Event(
        type="sample",
        aggregate_type=collections[0] if collections else "sample",
        aggregate_id="sample-id",
        sequence=1,
    )
