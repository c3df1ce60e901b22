"""How a relay classifies a failed publish (see docs/failures.md).

An event the broker cannot carry is parked at once; a failure for want of a broker waits
without counting, at least ``OUTAGE_WAIT`` on its own, and is woken as soon as the broker
confirms anything again (the rounds probe for that once a second); a full or missing
destination, or an outage that spares the others of the round, waits out its own delay (all
but a full one count once they have waited ``max_attempts`` times while others are confirmed);
anything else counts an attempt, and ``max_attempts`` parks the event.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from mongo_outbox import metrics
from mongo_outbox._relay.store.base import Claim, PublishFailure
from mongo_outbox.errors import BrokerFullError, InvalidEventError, describe, unavailable
from mongo_outbox.events import Event, utc_now
from mongo_outbox.settings import RelaySettings
from mongo_outbox.status import RelayCounters

log = logging.getLogger("mongo_outbox.relay")

OUTAGE_WAIT = 30.0
"""Seconds at least before an event that waited for the whole broker is retried on its own."""


class Classifier:
    """Turns a failed publish into the relay's ``PublishFailure``: park, wait or retry, counted in
    ``stats`` and in the metrics of ``relay`` (its labels, or ``None``)."""

    def __init__(
        self, settings: RelaySettings, stats: RelayCounters, relay: dict[str, str] | None
    ) -> None:
        self.settings = settings
        self.stats = stats
        self.relay = relay

    def __call__(
        self, event: Event, error: BaseException, claim: Claim, confirmed: bool
    ) -> PublishFailure:
        """Classify a failed publish; ``confirmed``: the broker confirmed others this round."""
        text = describe(error)
        self.stats.last_error = text
        metrics.publish_failed(self.relay, error)
        name = type(error).__name__
        self.stats.errors_by_type[name] = self.stats.errors_by_type.get(name, 0) + 1
        limit = self.settings.max_attempts
        if isinstance(error, InvalidEventError):
            return self._park(event, claim, text)  # the broker cannot carry it: no retry helps
        if unavailable(error):
            full = isinstance(error, BrokerFullError)
            whole = not (full or getattr(error, "destination", None))
            if whole and not confirmed:
                # The broker as a whole: not the event's fault, and woken once it is back.
                return self._wait(event, text, claim.waits.get(event.id, 0), wake=True)
            misses = claim.misses.get(event.id, 0)
            # A missing destination, or a confirmation that never comes, for this event alone,
            # longer than the attempt budget, while the broker confirms others, is the event's
            # own (docs/failures.md): woken with the others, it was retried every round for
            # ever, holding its wave for a publish timeout each time. A full destination never
            # is: it drains as its consumers catch up.
            owns = not full and confirmed and limit is not None and misses >= limit
            if not owns:
                return self._wait(event, text, misses, wake=False)
        attempt = claim.attempts.get(event.id, 0) + 1
        if limit is not None and attempt >= limit:
            return self._park(event, claim, text)
        delay = self.settings.backoff.delay(attempt)
        log.warning(
            "publishing %s failed (attempt %d), retry in %.1fs: %s", event.id, attempt, delay, text
        )
        return PublishFailure(event, text, utc_now() + timedelta(seconds=delay), "retry")

    def _wait(self, event: Event, text: str, waits: int, *, wake: bool) -> PublishFailure:
        # One warning per round says so, not one per event.
        delay = self.settings.backoff.delay(waits + 1)
        if wake:
            # While the whole broker is away, the probe (one entry a second) finds out when it
            # is back, and the wake then makes every waiting entry due: their own retries only
            # matter if this relay stops meanwhile, so a short backoff must not retry them all
            # in a loop.
            delay = max(delay, OUTAGE_WAIT)
        return PublishFailure(event, text, utc_now() + timedelta(seconds=delay), "wait", wake)

    def _park(self, event: Event, claim: Claim, text: str) -> PublishFailure:
        attempt = claim.attempts.get(event.id, 0) + 1
        log.error("parking %s after %d attempts: %s", event.id, attempt, text)
        return PublishFailure(event, text, utc_now(), "park")
