"""What a broker gives the publishing commands (``mongo-outbox relay``, ``replay``): its options,
and, given their values, where an event goes and a publisher that sends it there.

Each broker that the command line publishes to has one ``CommandLineBroker`` in its package,
``brokers/<name>/cli.py``, named by its ``BROKERS`` entry (``command_line``): the command line
collects them from the table and imports no broker of its own. It keeps the rest: which broker
was named, the options every broker shares (CloudEvents), and failures told in one line. A
broker's ``cli`` module is imported by the command line only; like the rest of its package, it
imports its client inside the functions that need it.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from mongo_outbox.brokers._publishing import Publisher
from mongo_outbox.cloudevents import CloudEvents
from mongo_outbox.events import Event

__all__ = ["CommandLineBroker", "Options"]

Options = tuple[tuple[str, dict[str, Any]], ...]
"""Command-line options, each a flag and its click settings."""


class CommandLineBroker(abc.ABC):
    """A broker as the publishing commands were given it, with its settings.

    Its class says what the command line offers for it: ``name`` (its package in
    ``mongo_outbox.brokers``, and its URL option ``--<name>``), ``url_help``, ``options`` (its
    own, beyond its URL) and ``naming_flag`` (the option of the template its destination is
    rendered from). An instance holds what was given: ``url``, ``naming`` (the template) and
    ``cloudevents`` (publish CloudEvents, or the Event's own JSON).
    """

    name: ClassVar[str]
    url_help: ClassVar[str]
    options: ClassVar[Options]
    naming_flag: ClassVar[str]
    url: str
    naming: str
    cloudevents: CloudEvents | None

    @classmethod
    @abc.abstractmethod
    def given(
        cls, url: str, values: dict[str, Any], cloudevents: CloudEvents | None
    ) -> CommandLineBroker:
        """The broker at ``url``, from the values of its ``options`` (by parameter name)."""
        ...

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the command's log: the broker, its URL without credentials, where to."""
        ...

    @abc.abstractmethod
    def render(self, sample: Event) -> str:
        """The destination ``naming`` gives ``sample``; ``InvalidEventError`` if it has none,
        ``ImportError`` when the broker's extra is missing."""
        ...

    @abc.abstractmethod
    async def open(self, sample: Event, waits: bool) -> Publisher:
        """Connect its publisher: ``ConnectionError``, ``OSError`` or ``TimeoutError`` when the
        broker does not answer, an ``OutboxError`` saying what to mend otherwise. ``waits``:
        whether the command's events wait for a destination that is missing (a relay) or fail
        (a replay)."""
        ...
