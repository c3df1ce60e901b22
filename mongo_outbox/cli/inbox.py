"""``mongo-outbox inbox failed|requeue``: messages a consumer dead-lettered, through
``Inbox.failed()`` and ``Inbox.requeue()``.

A requeue makes the next delivery of a message run its handler again; the broker settled the
message when it was dead-lettered, so something must deliver it again: ``mongo-outbox replay``
from the outbox, or the dead letter's own copy.
"""

from __future__ import annotations

from typing import Any

import click

from mongo_outbox.admin import OutboxAdmin
from mongo_outbox.cli.common import (
    Connection,
    Failure,
    Target,
    connected,
    moment,
    option,
    run,
    say,
    selection,
    table,
    target_options,
    to_json,
)
from mongo_outbox.inbox import Inbox

_COLLECTION = option(
    "--inbox-collection", default="inbox", show_default=True, help="The inbox collection."
)


@click.group()
def inbox() -> None:
    """Messages that consumers dead-lettered."""


@inbox.command("failed")
@target_options
@_COLLECTION
@click.option("--consumer", help="Only this consumer [default: every consumer].")
@click.option("--type", "event_type", help="Only messages of this event type.")
@click.option("--since", help="Only those that failed since: an ISO time, or 90s, 15m, 2h, 7d.")
@click.option("--limit", type=int, help="At most this many per consumer, the latest first.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
def failed(
    target: Target,
    inbox_collection: str,
    consumer: str | None,
    event_type: str | None,
    since: str | None,
    limit: int | None,
    as_json: bool,
) -> None:
    """List dead-lettered messages with their last error, the latest first."""
    filters: dict[str, Any] = {"event_type": event_type, "limit": limit}
    filters["since"] = moment(since, "--since") if since else None
    records, who = run(_failed(target, inbox_collection, consumer, filters))
    if as_json:
        say(to_json(records))
        return
    if not records:
        say(f"no failed messages{who}")
        return
    rows = [
        [
            r.get("consumer"),
            r.get("message_id"),
            r.get("event_type"),
            _version(r),
            r.get("failed_at"),
            r.get("attempts"),
            " ".join(str(r.get("last_error") or "").split())[:60],
        ]
        for r in records
    ]
    headings = ["CONSUMER", "MESSAGE ID", "TYPE", "VERSION", "FAILED AT", "ATTEMPTS", "LAST ERROR"]
    say(table(headings, rows, ""))


def _version(record: dict[str, Any]) -> str:
    # The event as it arrived: a dead letter for want of an upcaster shows the version it needs.
    event = record.get("event")
    version = event.get("version") if isinstance(event, dict) else None
    return f"v{version}" if version is not None else "?"


async def _failed(
    target: Target, collection: str, consumer: str | None, filters: dict[str, Any]
) -> tuple[list[dict[str, Any]], str]:
    """The failed records, and for a consumer that has none, which ones do (a misspelling?)."""
    async with connected(target) as conn:
        consumers = (
            [consumer]
            if consumer
            else list(await OutboxAdmin(conn.outbox, inbox=collection).inbox_failures())
        )
        records: list[dict[str, Any]] = []
        for name in consumers:
            box = Inbox(conn.db, consumer=name, collection=collection)
            records += await box.failed(**filters)
        who = await _who(conn, collection, consumer) if consumer and not records else ""
        return [{k: v for k, v in r.items() if k != "_id"} for r in records], who


@inbox.command("requeue")
@target_options
@_COLLECTION
@click.option("--consumer", required=True, help="The consumer whose messages to requeue.")
@click.argument("message_ids", nargs=-1)
@click.option("--type", "event_type", help="Every failed message of this event type.")
@click.option("--all", "everything", is_flag=True, help="Every failed message of the consumer.")
def requeue(
    target: Target,
    inbox_collection: str,
    consumer: str,
    message_ids: tuple[str, ...],
    event_type: str | None,
    everything: bool,
) -> None:
    """Make dead-lettered messages run their handler again at their next delivery: by id, by
    type, or all of the consumer's."""
    selection(bool(message_ids), bool(event_type), everything, "MESSAGE_ID..., --type, or --all")
    ids = list(message_ids) if message_ids else None
    count = run(_requeue(target, inbox_collection, consumer, ids, event_type, everything))
    say(
        f"requeued {count} failed messages of {consumer}: their next delivery runs the handler "
        "again (deliver them again: mongo-outbox replay, or the dead letter's copy)"
    )


async def _requeue(
    target: Target,
    collection: str,
    consumer: str,
    ids: list[str] | None,
    event_type: str | None,
    everything: bool,
) -> int:
    """Requeue, or fail as ``parked requeue`` does: an id that is not a failed message of the
    consumer fails the whole requeue before anything changes, and a requeue that found nothing
    to requeue (a misspelled ``--consumer``, say) fails too, saying who has failures."""
    async with connected(target) as conn:
        box = Inbox(conn.db, consumer=consumer, collection=collection)
        if ids is not None:
            failed = {r.get("message_id") for r in await box.failed(event_type=event_type)}
            missing = [i for i in dict.fromkeys(ids) if i not in failed]
            if missing:
                kind = f" of type {event_type}" if event_type else ""
                raise Failure(
                    f"not a failed message{kind} of {consumer}: {', '.join(missing)} "
                    f"(nothing was requeued){await _who(conn, collection, consumer)}"
                )
        requeued = await box.requeue(ids, event_type=event_type, all_failed=everything)
        if not requeued:
            kind = f" of type {event_type}" if event_type else ""
            raise Failure(
                f"no failed messages{kind} of {consumer} to requeue"
                f"{await _who(conn, collection, consumer)}"
            )
        return requeued


async def _who(conn: Connection, collection: str, consumer: str) -> str:
    """Which consumers have failed messages, when ``consumer`` has none (a misspelling?)."""
    counts = await OutboxAdmin(conn.outbox, inbox=collection).inbox_failures()
    if consumer in counts:
        return ""
    if not counts:
        return f"; {conn.db.name}.{collection} holds no failed message of any consumer"
    named = ", ".join(f"{name} ({n})" for name, n in counts.items())
    return f"; {consumer} has none, these consumers have failed messages: {named}"
