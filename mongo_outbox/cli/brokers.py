"""The broker options of the commands that publish (``relay``, ``replay``): NATS JetStream
(``--nats URL --subject TEMPLATE``) or RabbitMQ (``--rabbitmq URL --exchange NAME --routing-key
TEMPLATE``), each with its environment twin.

A template is rendered against a sample event before anything connects, so a typo fails the
command at once instead of parking every event it publishes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from mongo_outbox.cli.common import Failure, hide, one_line, option
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


@dataclass(frozen=True)
class Broker:
    kind: str  # "nats" | "rabbitmq"
    url: str
    naming: str
    exchange: str = EXCHANGE
    declare: bool = True
    """RabbitMQ: declare the exchange (the default one, or --declare-exchange), or require it."""

    @property
    def flag(self) -> str:
        return "--subject" if self.kind == "nats" else "--routing-key"

    def describe(self) -> str:
        if self.kind == "nats":
            return f"NATS {hide(self.url)}, subject {self.naming}"
        return f"RabbitMQ {hide(self.url)}, exchange {self.exchange}, routing key {self.naming}"

    def check(self, sample: Event) -> str:
        """Render the template for ``sample``; a one-line failure if it cannot be."""
        try:
            if self.kind == "nats":
                from mongo_outbox.publishers.nats import subject_of

                return subject_of(self.naming, sample)
            from mongo_outbox.publishers.rabbitmq import routing_key_of

            return routing_key_of(self.naming, sample)
        except ImportError:
            raise Failure(f"--{self.kind} needs pip install 'mongo-outbox[{self.kind}]'") from None
        except InvalidEventError as error:
            raise Failure(
                f"bad {self.flag} {self.naming!r}: {one_line(error)} (a template takes the "
                "event's fields: {type}, {aggregate_type}, {aggregate_id}, {sequence}, {id}...)"
            ) from None

    async def connect(self, sample: Event, *, waits: bool = True) -> Publisher:
        """Connect (a one-line failure if the broker does not answer), and warn when no
        JetStream stream takes the sample's subject: saying that its events wait for one
        (a relay, which ``waits``) or fail (a replay)."""
        try:
            if self.kind == "nats":
                from mongo_outbox.publishers.nats import NatsPublisher

                await _probe_nats(self.url)
                nats = await NatsPublisher.connect(self.url, subject=self.naming)
                await _warn_without_stream(nats, self.check(sample), waits)
                return nats
            from mongo_outbox.publishers.rabbitmq import RabbitMQPublisher

            try:
                return await RabbitMQPublisher.connect(
                    self.url, exchange=self.exchange, routing_key=self.naming, declare=self.declare
                )
            except ConfigurationError as error:
                raise Failure(
                    f"{one_line(error)}: a misspelling? Create it, or pass --declare-exchange "
                    "to have it declared as a durable topic exchange"
                ) from None
        except (ConnectionError, OSError, TimeoutError) as error:
            raise Failure(f"broker unreachable: {one_line(error)}") from None


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

    @functools.wraps(function)
    def command(
        nats: str | None,
        subject: str | None,
        rabbitmq: str | None,
        exchange: str | None,
        routing_key: str | None,
        declare_exchange: bool,
        **rest: Any,
    ) -> Any:
        if bool(nats) == bool(rabbitmq):
            raise Failure("name one broker: --nats URL or --rabbitmq URL")
        if nats:
            if exchange or routing_key or declare_exchange:
                raise Failure(
                    "--exchange, --routing-key and --declare-exchange are for --rabbitmq; "
                    "use --subject"
                )
            hide(nats)
            return function(broker=Broker("nats", nats, subject or SUBJECT), **rest)
        assert rabbitmq is not None
        if subject:
            raise Failure("--subject is for --nats; use --routing-key")
        hide(rabbitmq)
        # The default exchange is declared; one the user names must exist, unless they ask
        # for it to be declared: a misspelled name would otherwise be a new, unbound exchange.
        declare = declare_exchange or exchange is None
        naming = routing_key or ROUTING_KEY
        broker = Broker("rabbitmq", rabbitmq, naming, exchange or EXCHANGE, declare)
        return function(broker=broker, **rest)

    options = [
        option(
            "--nats", metavar="URL", help="Publish to NATS JetStream (servers comma-separated)."
        ),
        option("--subject", metavar="TEMPLATE", help=f"NATS subject [default: {SUBJECT}]."),
        option("--rabbitmq", metavar="URL", help="Publish to RabbitMQ."),
        option(
            "--exchange", metavar="NAME", help=f"RabbitMQ topic exchange [default: {EXCHANGE}]."
        ),
        option(
            "--routing-key",
            metavar="TEMPLATE",
            help=f"RabbitMQ routing key [default: {ROUTING_KEY}].",
        ),
        option(
            "--declare-exchange",
            is_flag=True,
            help=f"Declare --exchange (a durable topic exchange) if it does not exist; without "
            f"it, a named exchange must exist (the default, {EXCHANGE}, is always declared).",
        ),
    ]
    for add in reversed(options):
        command = add(command)
    return command  # type: ignore[return-value]


def sample_event(collections: tuple[str, ...]) -> Event:
    """An event like the ones the relay publishes, to render templates with."""
    return Event(
        type="sample",
        aggregate_type=collections[0] if collections else "sample",
        aggregate_id="sample-id",
        sequence=1,
    )
