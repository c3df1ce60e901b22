"""The ``mongo-outbox`` command group: one command (or group) per module."""

from __future__ import annotations

import click

from mongo_outbox.cli.console import console
from mongo_outbox.cli.inbox import inbox
from mongo_outbox.cli.indexes import ensure_indexes
from mongo_outbox.cli.parked import parked
from mongo_outbox.cli.relay import relay
from mongo_outbox.cli.replay import replay_command
from mongo_outbox.cli.status import status


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="mongo-outbox")
def cli() -> None:
    """Run the mongo-outbox relay as a service, see the outbox's health, and recover
    dead-lettered events and messages.

    Every option has an environment twin: --uri is MONGO_OUTBOX_URI, --routing-key is
    MONGO_OUTBOX_ROUTING_KEY, and so on.
    """


for command in (relay, status, parked, inbox, replay_command, ensure_indexes, console):
    cli.add_command(command)
