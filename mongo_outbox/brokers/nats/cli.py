"""NATS JetStream on the publishing commands: ``--nats URL --subject TEMPLATE``.

A first connection that no server answers fails at once (nats-py would retry it until its
timeout), and a subject that no stream takes is warned about before the first publish.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from mongo_outbox.brokers._command_line import CommandLineBroker, Options
from mongo_outbox.brokers._publishing import Publisher, redact_url
from mongo_outbox.cloudevents import CloudEvents
from mongo_outbox.events import Event

__all__ = ["PROBE_TIMEOUT", "SUBJECT", "Nats"]

log = logging.getLogger(__name__)

SUBJECT = "events.{aggregate_type}.{type}"
PROBE_TIMEOUT = 3.0
"""Seconds a server has to answer the first connection before the command gives up."""


@dataclass(frozen=True)
class Nats(CommandLineBroker):
    name: ClassVar[str] = "nats"
    url_help: ClassVar[str] = "Publish to NATS JetStream (servers comma-separated)."
    options: ClassVar[Options] = (
        ("--subject", {"metavar": "TEMPLATE", "help": f"NATS subject [default: {SUBJECT}]."}),
    )
    naming_flag: ClassVar[str] = "--subject"
    url: str
    naming: str
    cloudevents: CloudEvents | None = None

    @classmethod
    def given(
        cls, url: str, values: dict[str, Any], cloudevents: CloudEvents | None
    ) -> CommandLineBroker:
        return cls(url, values["subject"] or SUBJECT, cloudevents)

    def describe(self) -> str:
        return f"NATS {redact_url(self.url)}, subject {self.naming}"

    def render(self, sample: Event) -> str:
        from mongo_outbox.brokers.nats.publisher import subject_of

        return subject_of(self.naming, sample)

    async def open(self, sample: Event, waits: bool) -> Publisher:
        """Warn when no JetStream stream takes the sample's subject: saying that its events
        wait for one (a relay, which ``waits``) or fail (a replay)."""
        from mongo_outbox.brokers.nats.publisher import NatsPublisher

        await _probe(self.url)
        nats = await NatsPublisher.connect(
            self.url, subject=self.naming, cloudevents=self.cloudevents
        )
        try:
            await _warn_without_stream(nats, self.render(sample), waits)
        except BaseException:
            await nats.aclose()
            raise
        return nats


async def _probe(url: str) -> None:
    """Fail at once when no NATS server answers: nats-py retries a refused first connection
    (the publisher's until its timeout, logging each), so the probe gives up once every server
    of the list has failed once."""
    import nats

    servers = [server.strip() for server in url.split(",")]
    errors: list[BaseException] = []
    every_server_failed = asyncio.Event()

    async def failed(error: Exception) -> None:
        errors.append(error)
        if len(errors) >= len(servers):
            every_server_failed.set()

    connecting = asyncio.ensure_future(
        nats.connect(servers, connect_timeout=PROBE_TIMEOUT, error_cb=failed)
    )
    given_up = asyncio.ensure_future(every_server_failed.wait())
    try:
        await asyncio.wait(
            {connecting, given_up}, timeout=2 * PROBE_TIMEOUT, return_when="FIRST_COMPLETED"
        )
    except BaseException:  # cancelled (a signal while it starts): leave no connection behind
        connecting.cancel()
        raise
    finally:
        given_up.cancel()
    if connecting.done() and not connecting.cancelled():
        error = connecting.exception()
        if error is None:
            await connecting.result().close()
            return
        errors.append(error)
    connecting.cancel()
    await asyncio.wait({connecting})
    reason = (
        str(errors[-1]) or type(errors[-1]).__name__
        if errors
        else f"no answer within {2 * PROBE_TIMEOUT:g}s"
    )
    raise ConnectionError(f"NATS at {redact_url(url)}: {reason}")


async def _warn_without_stream(publisher: Any, subject: str, waits: bool) -> None:
    try:
        await publisher.js.find_stream_name_by_subject(subject)
    except Exception:  # noqa: BLE001 - nats-py's NotFoundError, or no answer: only a warning
        # The relay's events wait for a stream; a replay does not wait, and counts them failed.
        then = (
            "events wait, without counting attempts, until a stream does"
            if waits
            else "the replay fails the events no stream takes, and does not wait for one"
        )
        log.warning("no JetStream stream takes %s (a sample subject): %s", subject, then)
