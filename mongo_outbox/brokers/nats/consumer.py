"""Run a guarded handler on NATS JetStream messages through nats-py, and settle them.

A message to retry is nak'ed with the backoff delay, so the broker holds it, not the process.
The consumer's ``max_deliver`` bounds its deliveries (``metadata.num_delivered``): the delivery
that reaches it is the last, and a failure there is dead-lettered by the guard. While a message
is in the process (waiting its turn, handled, or held for a retry) ``consume_nats`` tells the
server it is in progress every third of the consumer's ``ack_wait``, so that a slow handler or a
long wait does not make JetStream deliver it a second time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from mongo_outbox.brokers._consuming import (
    Dispatcher,
    Rejected,
    being_cancelled,
    check_source,
    delivery_limit_of,
    ready,
    settle,
)
from mongo_outbox.errors import ConfigurationError, describe
from mongo_outbox.inbox import Guarded, Outcome
from mongo_outbox.settings import check_count

try:
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the NATS consumer needs the nats extra: pip install 'mongo-outbox[nats]'"
    ) from error

log = logging.getLogger(__name__)

_FETCH_WAIT = 0.5  # seconds a fetch waits for messages: how soon the loop notices a stop
_GIVE_BACK_AFTER = 2 * _FETCH_WAIT  # a message given back is delivered again after this
_ACK_WAIT = 30.0  # JetStream's default, for a consumer whose config does not say


class _Delivery:
    def __init__(self, message: Msg, max_deliver: int | None) -> None:
        self.message = message
        self.headers: Mapping[str, Any] = message.headers or {}
        self.message_id: object = self.headers.get("Nats-Msg-Id")
        self.body = message.data
        self.last = bool(max_deliver) and message.metadata.num_delivered >= (max_deliver or 0)
        self.settled = False

    async def ack(self) -> None:
        self.settled = True
        await self.message.ack()

    async def reject(self) -> None:
        self.settled = True
        await self.message.term()

    async def retry_after(self, delay: float, stop: asyncio.Event) -> None:
        self.settled = True
        await self.message.nak(delay=delay)

    async def give_back(self) -> None:
        # Not at once: a pull request of this consumer's last fetch may still be open on the
        # server (a fetch that timed out leaves it there until it expires), and the server would
        # hand the message straight back to it, to a subscription about to close, where it would
        # wait out ack_wait. The pull went out on this connection before the nak, so it has
        # expired once _FETCH_WAIT has passed since the server read the nak; twice that keeps the
        # two server timers from racing.
        self.settled = True
        await self.message.nak(delay=_GIVE_BACK_AFTER)

    async def keep_alive(self) -> None:
        # Never after a settle: JetStream takes a +WPI after a delayed nak as work going on, and
        # would deliver the message again after ack_wait rather than the delay. The check and
        # the +WPI's place in the connection's buffer come with no await between them, so one
        # that passed the check goes out before the settle.
        if not self.settled:
            await self.message.in_progress()

    def messaging(self) -> dict[str, str]:
        return {"messaging.system": "nats", "messaging.destination.name": self.message.subject}


async def handle_nats_message(
    message: Msg,
    guarded: Guarded,
    *,
    source: str | None = None,
    rejected: Rejected | None = None,
    stop: asyncio.Event | None = None,
    max_deliver: int | None = None,
) -> Outcome | None:
    """Handle one JetStream message (from a pull or push subscription) and settle it.

    ``max_deliver`` is the consumer's (``None`` or ``-1``: unlimited): on the last delivery a
    failure is dead-lettered, and a retry that is not the message's fault (another consumer
    holds it, MongoDB is unreachable) is done in the process until ``stop`` is set.
    """
    check_source(source, "handle_nats_message.source")
    limit = _max_deliver(max_deliver, "handle_nats_message.max_deliver")
    return await settle(
        _Delivery(message, limit),
        guarded,
        source=source,
        rejected=rejected,
        stop=stop or asyncio.Event(),
    )


async def consume_nats(
    js: JetStreamContext,
    subject: str,
    durable: str,
    guarded: Guarded,
    *,
    stream: str | None = None,
    ordered: bool = False,
    batch: int = 32,
    max_in_flight: int | None = None,
    source: str | None = None,
    rejected: Rejected | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Pull from a durable JetStream consumer until ``stop`` is set or the task is cancelled.

    Up to ``max_in_flight`` messages (default: ``batch``) are in the process at once; each fetch
    asks for at most ``batch`` of them, and the next fetch does not wait for the slowest
    message of the last. ``ordered=True`` handles the messages of one aggregate one at a time,
    in the order they arrived, and retries in the process so that none overtakes a message
    being retried. On stop, handlers that are running finish and settle; messages held for a
    retry or waiting their turn are nak'ed, for delivery again a second later.
    """
    for setting, value in (("consume_nats.subject", subject), ("consume_nats.durable", durable)):
        if not isinstance(value, str) or not value:
            raise ConfigurationError(
                f"{setting} must be a non-empty str, not {value!r}", setting=setting
            )
    batch = check_count(batch, "consume_nats.batch")
    limit = (
        batch if max_in_flight is None else check_count(max_in_flight, "consume_nats.max_in_flight")
    )
    check_source(source, "consume_nats.source")
    stop = stop or asyncio.Event()
    await ready(guarded)
    subscription = await js.pull_subscribe(subject, durable=durable, stream=stream)
    try:
        config = (await subscription.consumer_info()).config
        max_deliver = _max_deliver(config.max_deliver, "max_deliver")
        dispatcher = Dispatcher(guarded, source=source, rejected=rejected, ordered=ordered)
        ticker = asyncio.create_task(_keep_alive(dispatcher, (config.ack_wait or _ACK_WAIT) / 3))
        try:
            while not stop.is_set():
                await dispatcher.room(limit, stop)
                if stop.is_set():
                    break
                wanted = min(batch, limit - len(dispatcher.in_flight))
                try:
                    messages = await subscription.fetch(wanted, timeout=_FETCH_WAIT)
                except asyncio.TimeoutError:
                    # nats.errors.TimeoutError, or (nats-py 2.16) a bare one when the deadline
                    # runs out between its two pull requests.
                    continue
                for message in messages:
                    dispatcher.dispatch(_Delivery(message, max_deliver))
        finally:
            try:
                await dispatcher.drain(cancelled=being_cancelled())
            finally:
                # Even if the drain was cancelled: a keep-alive left running would hold its
                # messages from every other consumer for as long as the process lives.
                ticker.cancel()
    finally:
        await subscription.unsubscribe()


async def _keep_alive(dispatcher: Dispatcher, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        for delivery in list(dispatcher.in_flight.values()):
            if isinstance(delivery, _Delivery):
                try:
                    await delivery.keep_alive()
                except Exception as error:  # noqa: BLE001 - the next tick, or a redelivery
                    log.warning(
                        "in-progress for %s failed: %s", delivery.message_id, describe(error)
                    )


def _max_deliver(value: int | None, setting: str) -> int | None:
    # JetStream spells "unlimited" -1 (and leaves it out of a config that does not set it).
    if value is None or value == -1:
        return None
    return delivery_limit_of(value, setting) or None
