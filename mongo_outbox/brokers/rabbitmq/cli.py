"""RabbitMQ on the publishing commands: ``--rabbitmq URL --exchange NAME --routing-key
TEMPLATE``, with ``--declare-exchange`` and ``--max-message-size``.

The default exchange is declared; one the user names must exist unless they ask for it to be
declared, since a misspelled name would otherwise be a new exchange bound to no queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import click

from mongo_outbox.brokers._command_line import CommandLineBroker, Options
from mongo_outbox.brokers._publishing import Publisher, redact_url
from mongo_outbox.cloudevents import CloudEvents
from mongo_outbox.errors import ConfigurationError
from mongo_outbox.events import Event

__all__ = ["EXCHANGE", "ROUTING_KEY", "RabbitMQ"]

EXCHANGE = "events"
ROUTING_KEY = "{type}"


@dataclass(frozen=True)
class RabbitMQ(CommandLineBroker):
    name: ClassVar[str] = "rabbitmq"
    url_help: ClassVar[str] = "Publish to RabbitMQ."
    options: ClassVar[Options] = (
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
    def given(
        cls, url: str, values: dict[str, Any], cloudevents: CloudEvents | None
    ) -> CommandLineBroker:
        exchange = values["exchange"]
        return cls(
            url,
            values["routing_key"] or ROUTING_KEY,
            exchange or EXCHANGE,
            declare=values["declare_exchange"] or exchange is None,
            max_message_size=values["max_message_size"],
            cloudevents=cloudevents,
        )

    def describe(self) -> str:
        return (
            f"RabbitMQ {redact_url(self.url)}, exchange {self.exchange}, routing key {self.naming}"
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
            # Its connect refuses a named exchange that does not exist: say how to mend it.
            raise ConfigurationError(
                f"{error}: a misspelling? Create it, or pass --declare-exchange to have it "
                "declared as a durable topic exchange",
                setting=error.setting,
            ) from None
