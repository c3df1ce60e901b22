"""Every option of every ``mongo-outbox`` command has its environment twin, named by one rule
(``MONGO_OUTBOX_`` and the option's name in capitals), and the twin is really read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import click
import pytest

from mongo_outbox.cli.app import cli
from mongo_outbox.cli.common import env


def commands(group: click.Group = cli, path: str = "") -> Iterator[tuple[str, click.Command]]:
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from commands(command, f"{path}{name} ")
        else:
            yield f"{path}{name}", command


def options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option)]


def sample(option: click.Option) -> tuple[str, Any]:
    """A value for the option's twin, and what the option then holds."""
    if option.is_flag:
        return "1", True
    if isinstance(option.type, click.Choice):
        choice = str(option.type.choices[-1])
        return choice, choice
    if isinstance(option.type, (click.types.IntParamType, click.IntRange)):
        return "7", 7
    if isinstance(option.type, click.types.FloatParamType):
        return "7.5", 7.5
    if isinstance(option.type, click.Path):  # a str, or the path_type it converts to
        return "from-env", option.type("from-env")
    return "from-env", "from-env"


ALL = list(commands())


def test_the_walk_sees_every_command() -> None:
    names = {name for name, _ in ALL}
    assert names == {
        "console",
        "ensure-indexes",
        "inbox failed",
        "inbox requeue",
        "parked list",
        "parked requeue",
        "parked show",
        "relay",
        "replay",
        "status",
    }


@pytest.mark.parametrize(("name", "command"), ALL, ids=[name for name, _ in ALL])
def test_every_option_has_its_twin_and_the_twin_is_read(
    name: str, command: click.Command, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected: dict[str, Any] = {}
    for option in options(command):
        flag = max(option.opts, key=len)
        assert option.envvar == env(flag), f"{name} {flag}"
        assert option.show_envvar, f"{name} {flag}"
        text, value = sample(option)
        monkeypatch.setenv(env(flag), text)
        expected[str(option.name)] = (value,) if option.multiple else value
    arguments = ["an-id" for p in command.params if isinstance(p, click.Argument) and p.required]
    context = command.make_context(name, arguments)
    assert {k: context.params[k] for k in expected} == expected


def test_a_flag_on_the_command_line_wins_over_its_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONGO_OUTBOX_LIMIT", "3")
    command = dict(ALL)["inbox failed"]
    context = command.make_context("inbox failed", ["--uri=mongodb://h/db", "--limit=5"])
    assert context.params["limit"] == 5
