"""``mongo_outbox.brokers.BROKERS`` is where the public fronts find each broker's names: every
name it lists is public, every public broker name is in it, and each comes from its broker's
own package, imported only when asked for. The command line finds each broker's options there
too, so that adding a broker touches its package and the table only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import mongo_outbox.consumers
import mongo_outbox.publishers
from mongo_outbox.brokers import BROKERS, resolve
from mongo_outbox.brokers._command_line import CommandLineBroker
from mongo_outbox.cli.brokers import COMMAND_LINE

SHARED_PUBLISHERS = {"BatchPublisher", "Publisher", "WavePublisher", "redact_url", "url_secrets"}
SHARED_CONSUMERS = {"Rejected"}


def test_the_table_lists_exactly_the_fronts_broker_names() -> None:
    publishers = {name for broker in BROKERS.values() for name in broker.publishers}
    consumers = {name for broker in BROKERS.values() for name in broker.consumers}
    assert publishers == set(mongo_outbox.publishers.__all__) - SHARED_PUBLISHERS
    assert consumers == set(mongo_outbox.consumers.__all__) - SHARED_CONSUMERS


@pytest.mark.parametrize("name", sorted(BROKERS))
def test_each_broker_s_names_come_from_its_own_package(name: str) -> None:
    broker = BROKERS[name]
    for part, names in (("publisher", broker.publishers), ("consumer", broker.consumers)):
        for public in names:
            found = resolve(public, part)
            assert found.__module__ == f"mongo_outbox.brokers.{name}.{part}", public
            front = mongo_outbox.publishers if part == "publisher" else mongo_outbox.consumers
            assert getattr(front, public) is found


def test_a_name_no_broker_lists_is_no_attribute_of_the_fronts() -> None:
    with pytest.raises(AttributeError, match="KafkaPublisher"):
        mongo_outbox.publishers.KafkaPublisher  # noqa: B018
    with pytest.raises(AttributeError, match="consume_kafka"):
        mongo_outbox.consumers.consume_kafka  # noqa: B018


def test_importing_the_fronts_and_the_table_imports_no_broker_client() -> None:
    code = (
        "import sys, mongo_outbox, mongo_outbox.publishers, mongo_outbox.consumers\n"
        "import mongo_outbox.brokers, mongo_outbox.brokers.nats, mongo_outbox.brokers.rabbitmq\n"
        "import mongo_outbox.brokers.redis, mongo_outbox.brokers.faststream\n"
        "import mongo_outbox.brokers.memory, mongo_outbox.cli.brokers\n"
        "clients = {'aio_pika', 'aiormq', 'nats', 'redis', 'faststream'}\n"
        "assert not clients & set(sys.modules), sorted(clients & set(sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_the_command_line_takes_each_broker_s_own_options_from_the_table() -> None:
    assert list(COMMAND_LINE) == [name for name, b in BROKERS.items() if b.command_line]
    for name, broker in COMMAND_LINE.items():
        assert issubclass(broker, CommandLineBroker)
        assert broker.__module__ == f"mongo_outbox.brokers.{name}.cli"
        assert broker.__name__ == BROKERS[name].command_line
        assert broker.name == name


def test_the_command_line_imports_no_broker_package() -> None:
    cli = Path(mongo_outbox.publishers.__file__).parents[1] / "cli"
    for path in cli.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported = [node.module]
            elif isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            else:
                continue
            for module in imported:
                for broker in BROKERS:
                    assert not module.startswith(f"mongo_outbox.brokers.{broker}"), (path, module)
