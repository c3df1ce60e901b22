"""``mongo-outbox parked list|show|requeue``: events the relay set aside as dead-lettered.

Everything goes through the relay's store, as the relays' own ``parked()`` and ``requeue()``
do: a requeue brings back the earlier parked events of each chosen event's aggregate as well,
so none overtakes another. The active relay publishes requeued events at its next sweep
(``--sweep-interval``, 30 s by default; at once in embedded mode, whose requeue is a write the
change stream sees).
"""

from __future__ import annotations

import asyncio
from typing import Any

import click

from mongo_outbox._relay.store import store_for
from mongo_outbox._relay.store.base import ParkedKey, batches, choose_parked, hashable
from mongo_outbox.cli.common import (
    Failure,
    Target,
    connected,
    run,
    say,
    selection,
    table,
    target_options,
    to_json,
)
from mongo_outbox.cli.progress import progress


@click.group()
def parked() -> None:
    """Events the relay parked after max_attempts failures (or at once, when no broker can
    carry them)."""


async def _parked(
    target: Target, types: tuple[str, ...] = (), aggregates: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    async with connected(target) as conn:
        store = store_for(conn.outbox)
        if not types and not aggregates:
            return await store.parked()
        return (await choose_parked(store, types, aggregates)).entries


async def _parked_one(target: Target, event_id: str) -> list[dict[str, Any]]:
    async with connected(target) as conn:
        return await store_for(conn.outbox).parked([event_id])


def _short(text: Any, width: int = 60) -> str:
    line = " ".join(str(text or "").split())
    return line if len(line) <= width else line[: width - 3] + "..."


@parked.command("list")
@target_options
@click.option("--type", "types", multiple=True, help="Only events of this type (repeatable).")
@click.option("--aggregate", "aggregates", multiple=True, help="Only this aggregate id.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
def list_parked(
    target: Target, types: tuple[str, ...], aggregates: tuple[str, ...], as_json: bool
) -> None:
    """List parked events with their last error."""
    entries = run(_parked(target, types, aggregates))
    if as_json:
        say(to_json(entries))
        return
    if not entries:
        say("no parked events")
        return
    rows = [
        [
            e.get("_id"),
            e.get("type"),
            _version(e),
            f"{e.get('aggregate_type')}/{e.get('aggregate_id')}",
            e.get("sequence"),
            e.get("attempts"),
            _short(e.get("last_error")),
        ]
        for e in entries
    ]
    headings = ["EVENT ID", "TYPE", "VERSION", "AGGREGATE", "SEQ", "ATTEMPTS", "LAST ERROR"]
    say(table(headings, rows, ""))


def _version(entry: dict[str, Any]) -> str:
    # As in ``inbox failed``: the version consumers will meet once it is requeued. An entry
    # without one is published as version 1 (Event's default); one the relay cannot read, "?".
    version = entry.get("version", 1)
    return f"v{version}" if isinstance(version, int) and not isinstance(version, bool) else "?"


@parked.command("show")
@target_options
@click.argument("event_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
def show_parked(target: Target, event_id: str, as_json: bool) -> None:
    """Show one parked event in full."""
    found = run(_parked_one(target, event_id))
    if not found:
        raise Failure(f"no parked event {event_id!r}")
    entry = found[0]
    if as_json:
        say(to_json(entry))
        return
    width = max(map(len, map(str, entry)))
    for key, value in entry.items():
        shown = to_json(value) if isinstance(value, (dict, list)) else value
        say(f"{key:<{width}}  {shown}")


@parked.command("requeue")
@target_options
@click.argument("event_ids", nargs=-1)
@click.option("--type", "types", multiple=True, help="Every parked event of this type.")
@click.option("--aggregate", "aggregates", multiple=True, help="Every parked event of it.")
@click.option("--all", "everything", is_flag=True, help="Every parked event.")
def requeue_parked(
    target: Target,
    event_ids: tuple[str, ...],
    types: tuple[str, ...],
    aggregates: tuple[str, ...],
    everything: bool,
) -> None:
    """Make parked events due again, with a fresh set of attempts: by id, by type or
    aggregate, or all. The earlier parked events of their aggregates come back too."""
    choices = "EVENT_ID..., --type, --aggregate, or --all"
    selection(bool(event_ids), bool(types or aggregates), everything, choices)
    say(run(_requeue(target, event_ids, types, aggregates)))


async def _requeue(
    target: Target, event_ids: tuple[str, ...], types: tuple[str, ...], aggregates: tuple[str, ...]
) -> str:
    async with connected(target) as conn:
        store = store_for(conn.outbox)
        # Ids, types and aggregate ids only: a requeue of every parked entry must not hold
        # them all whole (an outbox can have parked a broker outage's worth).
        if event_ids:
            keys = [ParkedKey.of(entry) for entry in await store.parked(list(event_ids))]
        else:
            keys = await store.parked_keys()
        chosen = [
            key.id
            for key in keys
            if (not event_ids or key.id in event_ids) and key.matches(types, aggregates)
        ]
        missing = sorted(set(event_ids) - {hashable(c) for c in chosen})
        if missing:
            raise Failure(f"not parked: {', '.join(missing)} (nothing was requeued)")
        if not chosen:  # a misspelled --type or --aggregate must not pass for a done requeue
            present = sorted({str(key.type) for key in keys})
            raise Failure(
                "no parked event matches: nothing was requeued"
                + (f" (parked types: {', '.join(present)})" if present else " (none is parked)")
            )
        requeued = await _in_batches(store, chosen)
    earlier = requeued - len(chosen)
    if earlier < 0:  # a relay or another requeue got to some first, or one cannot come back
        return (
            f"requeued {requeued} of the {len(chosen)} parked events: the rest are no longer "
            "parked, or are unreadable entries without a sequence, to be fixed by hand "
            "(docs/failures.md)"
        )
    also = f", and {earlier} earlier parked events of their aggregates" if earlier > 0 else ""
    return f"requeued {len(chosen)} parked events{also}"


async def _in_batches(store: Any, chosen: list[Any]) -> int:
    """Requeue ``chosen`` a batch at a time (``REQUEUE_BATCH`` ids per command), with progress
    on stderr; interrupted, say how far it got: whole batches are requeued, the rest parked."""
    requeued = done = 0
    async with progress("requeue", "events", total=len(chosen)) as shown:
        try:
            for batch in batches(chosen):
                requeued += await store.requeue(batch)
                done += len(batch)
                shown.add(len(batch))
        except (asyncio.CancelledError, KeyboardInterrupt):
            click.echo(
                f"requeue interrupted after {done} of {len(chosen)} chosen parked events: the "
                "rest are still parked; run the same command again for them",
                err=True,
            )
            raise
    return requeued
