"""``mongo-outbox replay``: republish events the relay already published that the outbox still
keeps (collection mode, within its retention), under their own ids and in order per aggregate.

On NATS, JetStream drops a message whose ``Nats-Msg-Id`` it stored within the stream's
duplicate window (two minutes by default): only older events reach a stream that had them.
"""

from __future__ import annotations

import logging
from datetime import datetime

import click

from mongo_outbox.admin import OutboxAdmin, Replayed
from mongo_outbox.cli.brokers import (
    Broker,
    name_one_broker,
    optional_broker_options,
    sample_event,
)
from mongo_outbox.cli.common import (
    Failure,
    Target,
    connected,
    moment,
    run,
    say,
    table,
    target_options,
)
from mongo_outbox.cli.progress import progress
from mongo_outbox.publishers import Publisher

log = logging.getLogger("mongo_outbox.cli")


@click.command("replay")
@target_options
@optional_broker_options
@click.option("--since", required=True, help="Events that occurred since: ISO time, or 2h, 7d.")
@click.option("--until", help="... and before this time.")
@click.option("--type", "types", multiple=True, help="Only events of this type (repeatable).")
@click.option("--aggregate", "aggregates", multiple=True, help="Only this aggregate id.")
@click.option(
    "--dry-run", is_flag=True, help="Count what would be sent, by type and version; send nothing."
)
def replay_command(
    target: Target,
    broker: Broker | None,
    since: str,
    until: str | None,
    types: tuple[str, ...],
    aggregates: tuple[str, ...],
    dry_run: bool,
) -> None:
    """Republish already-published events, under their own ids, in order per aggregate (for a
    new consumer, say). Consumers' inboxes skip what they already handled. Collection mode
    only; --dry-run needs no broker."""
    if broker is None and not dry_run:
        raise name_one_broker()
    start = moment(since, "--since")
    end = moment(until, "--until") if until else None
    if end is not None and end <= start:
        raise Failure(
            f"--until {until} ({end.isoformat()}) is not after --since {since} "
            f"({start.isoformat()}): no event occurred in between"
        )
    if broker is not None:  # a dry run given a broker checks its template all the same
        broker.check(sample_event(target.collections))
    result, where = run(_replay(target, broker, start, end, types, _ids(aggregates), dry_run))
    if not result.found:
        _say_why_none(where, start, end, types, aggregates)
    if dry_run:
        say(f"would republish {result.found} events of {result.aggregates} aggregates")
        # The versions consumers will read: each needs a reader (or an upcaster) for them.
        rows = [[t, f"v{v}", n] for (t, v), n in sorted(result.versions.items())]
        if rows:
            say(table(["TYPE", "VERSION", "EVENTS"], rows))
        return
    assert broker is not None  # refused above without one unless a dry run
    say(
        f"republished {result.published} of {result.found} events of {result.aggregates} "
        f"aggregates to {broker.describe()}"
    )
    if result.failed:
        first_id, first_error = result.failed[0]
        raise Failure(
            f"{len(result.failed)} events failed ({first_id}: {first_error}) and "
            f"{result.skipped} later events of their aggregates were not sent"
        )


def _say_why_none(
    where: str,
    since: datetime,
    until: datetime | None,
    types: tuple[str, ...],
    aggregates: tuple[str, ...],
) -> None:
    # "0 of 0" alone reads as done: a misspelled type or a window past the retention is not.
    chosen = [f"occurred since {since.isoformat()}"]
    if until is not None:
        chosen.append(f"before {until.isoformat()}")
    if types:
        chosen.append(f"of type {', '.join(types)}")
    if aggregates:
        chosen.append(f"of aggregate {', '.join(aggregates)}")
    log.warning(
        "no published event %s keeps %s: a type and an aggregate id match exactly, published "
        "events are kept only for the outbox's retention (and a misspelled --db has none)",
        where,
        ", ".join(chosen),
    )


def _ids(aggregates: tuple[str, ...]) -> list[str | int]:
    # An aggregate id is stored as a str or an int (from an integer _id): match both spellings.
    ids: list[str | int] = list(aggregates)
    ids += [int(a) for a in aggregates if a.lstrip("-").isdigit()]
    return ids


async def _replay(
    target: Target,
    broker: Broker | None,
    since: datetime,
    until: datetime | None,
    types: tuple[str, ...],
    aggregates: list[str | int],
    dry_run: bool,
) -> tuple[Replayed, str]:
    async with connected(target) as conn:

        async def connect() -> Publisher:
            assert broker is not None  # only called when not a dry run
            return await broker.connect(sample_event(target.collections), waits=False)

        async with progress("replay", "events") as shown:
            replayed = await OutboxAdmin(conn.outbox).replay(
                None if dry_run else connect,
                since=since,
                until=until,
                types=types,
                aggregates=aggregates,
                progress=shown.add,
            )
        return replayed, f"{conn.outbox.db.name}.{conn.outbox.collection.name}"
