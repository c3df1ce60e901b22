"""One package per broker, and the table that lists them.

Everything about a broker lives in its package (``nats``, ``rabbitmq``, ``redis``,
``faststream``, ``memory``):

- ``publisher``: the adapter a relay publishes through;
- ``consumer``: the helpers that run an ``inbox_guard``-ed handler on its messages;
- ``errors``: the one classification of its client's errors (an outage, a full broker, the
  event's own fault), used by every path to that broker: its own publisher and FastStream's;
- ``cli``, where the publishing commands take it: its options on the command line.

``memory`` is the in-process one, for tests and demos: a publisher only, needing no extra.

Users import from the public fronts: ``mongo_outbox.publishers``, ``mongo_outbox.consumers``
and ``mongo_outbox.faststream``, which find a name in ``BROKERS`` and import its module only
then, so that each broker's client stays an optional extra: importing this table imports none.
Adding a broker means one package here and one entry in ``BROKERS``; for the command line to
publish to it as well, a ``cli`` module in that package (its options, a ``CommandLineBroker`` of
``_command_line``) named by the entry's ``command_line``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mongo_outbox._moved import MOVED

__all__ = ["BROKERS", "BrokerPackage", "front", "resolve"]


@dataclass(frozen=True)
class BrokerPackage:
    """One broker's entry in the table.

    Parameters:
        name: its package, ``mongo_outbox.brokers.<name>``.
        extra: the extra that installs its client: ``pip install 'mongo-outbox[<extra>]'``
            (``""``: it needs none).
        publishers: what its ``publisher`` module gives ``mongo_outbox.publishers``.
        consumers: what its ``consumer`` module gives ``mongo_outbox.consumers``.
        command_line: the ``CommandLineBroker`` of its ``cli`` module, when the publishing
            commands take it (``mongo-outbox relay --<name> URL``).
    """

    name: str
    extra: str
    publishers: tuple[str, ...] = ()
    consumers: tuple[str, ...] = ()
    command_line: str | None = None

    def module(self, part: str) -> Any:
        """Its ``publisher``, ``consumer``, ``errors`` or ``cli`` module, imported now (with its
        client: ``ImportError`` naming the extra when the client is missing)."""
        return importlib.import_module(f"{__name__}.{self.name}.{part}")


BROKERS: dict[str, BrokerPackage] = {
    broker.name: broker
    for broker in (
        BrokerPackage(
            "nats",
            extra="nats",
            publishers=("NatsPublisher",),
            consumers=("consume_nats", "handle_nats_message"),
            command_line="Nats",
        ),
        BrokerPackage(
            "rabbitmq",
            extra="rabbitmq",
            publishers=("RabbitMQPublisher",),
            consumers=("consume_rabbitmq", "handle_rabbitmq_message"),
            command_line="RabbitMQ",
        ),
        BrokerPackage(
            "redis",
            extra="redis",
            publishers=("RedisStreamsPublisher",),
            consumers=("consume_redis",),
        ),
        # Its consumer side (inbox_handler) is public as mongo_outbox.faststream.
        BrokerPackage("faststream", extra="faststream", publishers=("FastStreamPublisher",)),
        BrokerPackage("memory", extra="", publishers=("MemoryPublisher",)),
    )
}


def resolve(name: str, part: str) -> Any:
    """The object called ``name`` in the ``part`` module (``publisher`` or ``consumer``) of the
    broker that lists it; ``AttributeError`` when no broker does."""
    for broker in BROKERS.values():
        if name in (broker.publishers if part == "publisher" else broker.consumers):
            return getattr(broker.module(part), name)
    raise AttributeError(name)


def front(module: str, part: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` of a public front (``module``): the names of the brokers'
    ``part`` modules, each imported when first asked for, so that a broker's client stays an
    optional extra."""

    def attribute(name: str) -> Any:
        if f"{module}.{name}" in MOVED:
            # An old submodule, as a package's attribute once its import ran (it warns).
            return importlib.import_module(f"{module}.{name}")
        try:
            return resolve(name, part)
        except AttributeError:
            raise AttributeError(f"module {module!r} has no attribute {name!r}") from None

    return attribute
