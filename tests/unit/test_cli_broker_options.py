"""The broker options of the publishing commands come from the brokers' own packages, collected
through ``BROKERS`` (``COMMAND_LINE``): one broker is named, another broker's options are refused
with the ones to use instead, and the command receives the broker with its defaults filled in."""

from __future__ import annotations

from typing import Any

import click
import pytest
from click.testing import CliRunner

from mongo_outbox.brokers.nats.cli import Nats
from mongo_outbox.brokers.rabbitmq.cli import RabbitMQ
from mongo_outbox.cli.brokers import (
    COMMAND_LINE,
    Broker,
    broker_options,
    optional_broker_options,
)
from mongo_outbox.cloudevents import CloudEvents


@click.command()
@broker_options
def publish(broker: Broker) -> None:
    click.echo(repr(broker))


def run(*args: str) -> Any:
    return CliRunner().invoke(publish, list(args), env={})


def test_the_options_are_listed_broker_by_broker_in_the_table_s_order() -> None:
    flags = [p.opts[0] for p in publish.params]
    assert flags == [
        "--nats",
        "--subject",
        "--rabbitmq",
        "--exchange",
        "--routing-key",
        "--declare-exchange",
        "--max-message-size",
        "--cloudevents-source",
        "--cloudevents-mode",
    ]
    assert list(COMMAND_LINE) == ["nats", "rabbitmq"]


@pytest.mark.parametrize("args", [(), ("--nats", "nats://a", "--rabbitmq", "amqp://b")])
def test_exactly_one_broker_is_named(args: tuple[str, ...]) -> None:
    ran = run(*args)
    assert ran.exit_code == 1
    assert "name one broker: --nats URL or --rabbitmq URL" in ran.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--nats", "nats://a", "--exchange", "e"),
            "--exchange, --routing-key, --declare-exchange and --max-message-size are for "
            "--rabbitmq; use --subject",
        ),
        (
            ("--nats", "nats://a", "--declare-exchange"),
            "--exchange, --routing-key, --declare-exchange and --max-message-size are for "
            "--rabbitmq; use --subject",
        ),
        (
            ("--nats", "nats://a", "--max-message-size", "10"),
            "--exchange, --routing-key, --declare-exchange and --max-message-size are for "
            "--rabbitmq; use --subject",
        ),
        (
            ("--rabbitmq", "amqp://b", "--subject", "s"),
            "--subject is for --nats; use --routing-key",
        ),
    ],
)
def test_another_broker_s_options_are_refused(args: tuple[str, ...], message: str) -> None:
    ran = run(*args)
    assert ran.exit_code == 1 and message in ran.output


def test_the_command_gets_the_named_broker_with_its_defaults() -> None:
    assert run("--nats", "nats://a").output.strip() == repr(
        Broker(Nats("nats://a", "events.{aggregate_type}.{type}"))
    )
    assert run("--rabbitmq", "amqp://b").output.strip() == repr(
        Broker(RabbitMQ("amqp://b", "{type}", "events", declare=True))
    )


def test_a_named_rabbitmq_exchange_must_exist_unless_it_is_to_be_declared() -> None:
    named = run("--rabbitmq", "amqp://b", "--exchange", "orders", "--routing-key", "o.{type}")
    assert named.output.strip() == repr(
        Broker(RabbitMQ("amqp://b", "o.{type}", "orders", declare=False))
    )
    declared = run("--rabbitmq", "amqp://b", "--exchange", "orders", "--declare-exchange")
    assert declared.output.strip() == repr(
        Broker(RabbitMQ("amqp://b", "{type}", "orders", declare=True))
    )


def test_max_message_size_is_a_positive_number_of_bytes() -> None:
    sized = run("--rabbitmq", "amqp://b", "--max-message-size", "1048576")
    assert sized.output.strip() == repr(
        Broker(RabbitMQ("amqp://b", "{type}", "events", declare=True, max_message_size=1048576))
    )
    for bad in ("0", "-5", "16MiB"):
        refused = run("--rabbitmq", "amqp://b", "--max-message-size", bad)
        assert refused.exit_code == 2 and "--max-message-size" in refused.output


@click.command()
@optional_broker_options
def maybe_publish(broker: Broker | None) -> None:
    click.echo(repr(broker))


def test_a_command_that_may_run_without_a_broker_gets_none_and_one_broker_at_most() -> None:
    # replay --dry-run: nothing is sent, so no broker is needed (or checked).
    assert CliRunner().invoke(maybe_publish, [], env={}).output.strip() == "None"
    alone = CliRunner().invoke(maybe_publish, ["--subject", "s.{type}"], env={})
    assert alone.exit_code == 0 and alone.output.strip() == "None"
    named = CliRunner().invoke(maybe_publish, ["--nats", "nats://a"], env={})
    assert named.exit_code == 0 and named.output.startswith("Broker(chosen=Nats(")
    two = CliRunner().invoke(maybe_publish, ["--nats", "nats://a", "--rabbitmq", "amqp://b"])
    assert two.exit_code == 1 and "name one broker" in two.output


def test_either_broker_publishes_cloudevents_when_given_a_source() -> None:
    binary = run("--nats", "nats://a", "--cloudevents-source", "/orders")
    assert binary.output.strip() == repr(
        Broker(Nats("nats://a", "events.{aggregate_type}.{type}", CloudEvents("/orders")))
    )
    structured = run(
        "--rabbitmq",
        "amqp://b",
        "--cloudevents-source",
        "urn:x",
        "--cloudevents-mode",
        "structured",
    )
    assert structured.output.strip() == repr(
        Broker(
            RabbitMQ("amqp://b", "{type}", "events", cloudevents=CloudEvents("urn:x", "structured"))
        )
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--cloudevents-mode", "binary"), "--cloudevents-mode needs --cloudevents-source"),
        (
            ("--cloudevents-source", "not a uri"),
            "--cloudevents-source 'not a uri' is not a URI reference (RFC 3986)",
        ),
    ],
)
def test_cloudevents_options_that_cannot_apply_are_refused(
    args: tuple[str, ...], message: str
) -> None:
    ran = run("--nats", "nats://a", *args)
    assert ran.exit_code == 1 and message in ran.output
    assert run("--nats", "nats://a", "--cloudevents-mode", "json").exit_code == 2
