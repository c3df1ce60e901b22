"""The ``mongo-outbox`` command line: run a relay as a service, see the outbox's health, and
recover parked events and dead-lettered messages without writing Python.

It is the one part of mongo-outbox that configures logging handlers (the library never does),
and it needs the ``cli`` extra: ``pip install 'mongo-outbox[cli]'``. One module per command
group: ``relay``, ``status``, ``recovery`` (parked events, inbox failures, indexes) and
``replay``; ``common`` holds what they share.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line with ``argv`` (default: the process's arguments) and exit."""
    try:
        import click
    except ImportError:
        sys.stderr.write(
            "mongo-outbox: the command line needs click: pip install 'mongo-outbox[cli]'\n"
        )
        sys.exit(2)
    try:
        # Imports take a moment: a Ctrl-C meanwhile ends quietly too.
        from mongo_outbox.cli.app import cli
        from mongo_outbox.cli.common import scrub
    except KeyboardInterrupt:
        sys.exit(130)

    try:
        code = cli.main(args=argv, prog_name="mongo-outbox", standalone_mode=False)
    except click.UsageError as error:
        where = f" (see '{error.ctx.command_path} --help')" if error.ctx else ""
        sys.stderr.write(f"mongo-outbox: {scrub(error.format_message())}{where}\n")
        sys.exit(error.exit_code)
    except click.ClickException as error:
        sys.stderr.write(f"mongo-outbox: {scrub(error.format_message())}\n")
        sys.exit(error.exit_code)
    except click.Abort:
        sys.exit(130)
    except Exception:  # noqa: BLE001 - a bug: its traceback, but never a credential
        sys.stderr.write(scrub(traceback.format_exc()))
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
