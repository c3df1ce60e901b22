"""A command listener that cancels a task as a given command starts: a write interrupted at
exactly that point, through the real driver and server."""

from __future__ import annotations

import asyncio
from typing import Any

from pymongo import monitoring


class CancelsAtCommand(monitoring.CommandListener):
    """Cancels ``task`` (once) as a ``name`` command starts whose text holds ``naming``."""

    def __init__(self, name: str, naming: str = "") -> None:
        self.name = name
        self.naming = naming
        self.task: asyncio.Task[Any] | None = None

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if self.task and event.command_name == self.name and self.naming in str(event.command):
            self.task.cancel()
            self.task = None

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass
