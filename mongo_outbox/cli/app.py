"""The ``mongo-outbox`` command group: one command (or group) per module."""

from __future__ import annotations

import click

from mongo_outbox.cli.common import env
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
    parked events and dead-lettered messages.

    Every option has an environment twin: --uri is MONGO_OUTBOX_URI, --routing-key is
    MONGO_OUTBOX_ROUTING_KEY, and so on.
    """


for command in (relay, status, parked, inbox, replay_command, ensure_indexes, console):
    cli.add_command(command)


def _twin(command: click.Command) -> None:
    """Give every option of ``command`` and its subcommands its environment twin, derived in
    one place from the option's longest name (``--dry-run`` is ``MONGO_OUTBOX_DRY_RUN``), so a
    new option cannot be added without one. ``--help`` and ``--version`` act at once and have
    none."""
    for param in command.params:
        if isinstance(param, click.Option) and param.name not in ("help", "version"):
            flag = max(param.opts, key=len)
            param.envvar = env(flag)
            param.show_envvar = True
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _twin(sub)


_twin(cli)
