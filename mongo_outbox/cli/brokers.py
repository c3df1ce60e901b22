"""The broker options of the commands that publish (``relay``, ``replay``): one broker's URL
(``--nats URL``, ``--rabbitmq URL``) and that broker's own options (``--subject TEMPLATE``,
``--exchange NAME``...), each with its environment twin. Each broker declares its own part in
its package, ``mongo_outbox/brokers/<name>/cli.py`` (its options, how it renders a destination
and how it connects), and its ``BROKERS`` entry names it (``command_line``): ``COMMAND_LINE``
collects them from the table, so this module imports no broker. What is left here is the
command line's: which broker was named, the options every broker shares (CloudEvents), and
failures told in one line.

A template is rendered against a sample event before anything connects, so a typo fails the
command at once instead of parking every event it publishes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from mongo_outbox.brokers import BROKERS
from mongo_outbox.brokers._command_line import CommandLineBroker
from mongo_outbox.cli.common import Failure, hide, one_line, option
from mongo_outbox.cloudevents import CloudEvents
from mongo_outbox.errors import ConfigurationError, InvalidEventError
from mongo_outbox.events import Event
from mongo_outbox.publishers import Publisher

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Broker:
    """The broker a publishing command was given: its own part of the command line with the
    values given (``chosen``, from ``brokers/<name>/cli.py``), and what the command needs of it,
    with failures told in one line."""

    chosen: CommandLineBroker

    def describe(self) -> str:
        return f"{self.chosen.describe()}{_as_cloudevents(self.chosen.cloudevents)}"

    def check(self, sample: Event) -> str:
        """Render the template for ``sample``; a one-line failure if it cannot be."""
        chosen = self.chosen
        try:
            return chosen.render(sample)
        except ImportError:
            extra = BROKERS[chosen.name].extra
            raise Failure(f"--{chosen.name} needs pip install 'mongo-outbox[{extra}]'") from None
        except InvalidEventError as error:
            raise Failure(
                f"bad {chosen.naming_flag} {chosen.naming!r}: {one_line(error)} (a template "
                "takes the event's fields: {type}, {aggregate_type}, {aggregate_id}, {sequence}, "
                "{id}...)"
            ) from None

    async def connect(self, sample: Event, *, waits: bool = True) -> Publisher:
        """Connect (a one-line failure if the broker does not answer or refuses); ``waits``:
        whether the command's events wait for a destination that is missing (a relay) or fail
        (a replay)."""
        try:
            return await self.chosen.open(sample, waits)
        except (ConnectionError, OSError, TimeoutError) as error:
            raise Failure(f"broker unreachable: {one_line(error)}") from None
        except ConfigurationError as error:
            raise Failure(one_line(error)) from None


COMMAND_LINE: dict[str, type[CommandLineBroker]] = {
    name: getattr(broker.module("cli"), broker.command_line)
    for name, broker in BROKERS.items()
    if broker.command_line
}
"""The brokers the publishing commands take, in ``BROKERS``' order (which ``--help`` keeps)."""


def _as_cloudevents(ce: CloudEvents | None) -> str:
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
        named = [name for name, url in urls.items() if url]
        if not named and optional:
            # A broker's own options without its URL (--subject, or their environment twins)
            # have nothing to apply to; the command refuses when it needs a broker.
            return function(broker=None, **given)
        if len(named) != 1:
            raise name_one_broker()
        broker = COMMAND_LINE[named[0]]
        for other in COMMAND_LINE.values():
            if other is not broker and any(values[other.name].values()):
                raise Failure(f"{_listed(other)} for --{other.name}; use {broker.naming_flag}")
        hide(urls[broker.name])  # its credentials are secrets before anything can show them
        chosen = broker.given(urls[broker.name], values[broker.name], cloudevents)
        return function(broker=Broker(chosen), **given)

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


def _listed(broker: type[CommandLineBroker]) -> str:
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
