"""``mongo-outbox parked list|show|requeue``: events the relay parked.

Everything goes through the outbox's admin (``mongo_outbox.admin``), as the relays' own
``parked()`` and ``requeue()`` do: a requeue brings back the earlier parked events of each
chosen event's aggregate as well, so none overtakes another. The active relay publishes
requeued events at its next sweep (``--sweep-interval``, 30 s by default; at once in embedded
mode, whose requeue is a write the change stream sees).
"""

from __future__ import annotations

import asyncio
from typing import Any

import click

from mongo_outbox.admin import OutboxAdmin, ParkedEntry
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
    target: Target,
    types: tuple[str, ...] = (),
    aggregates: tuple[str, ...] = (),
    whole: bool = False,
) -> list[ParkedEntry]:
    async with connected(target) as conn:
        return list((await OutboxAdmin(conn.outbox).parked(types, aggregates, whole=whole)).entries)


async def _parked_one(target: Target, event_id: str) -> list[ParkedEntry]:
    async with connected(target) as conn:
        return await OutboxAdmin(conn.outbox).parked_entries([event_id])


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
    # Read whole only for --json, which prints them whole: the table shows a few fields.
    entries = run(_parked(target, types, aggregates, whole=as_json))
    if as_json:
        say(to_json([dict(entry.document) for entry in entries]))
        return
    if not entries:
        say("no parked events")
        return
    rows = [
        [
            e.event_id,
            _raw(e, "type"),
            # As in ``inbox failed``: the version consumers will meet once it is requeued.
            "?" if e.version is None else f"v{e.version}",
            f"{_raw(e, 'aggregate_type')}/{e.aggregate_id}",
            _raw(e, "sequence"),
            e.attempts,
            _short(e.last_error),
        ]
        for e in entries
    ]
    headings = ["EVENT ID", "TYPE", "VERSION", "AGGREGATE", "SEQ", "ATTEMPTS", "LAST ERROR"]
    say(table(headings, rows, ""))


def _raw(entry: ParkedEntry, name: str) -> Any:
    """A field as stored, also one in a type the record cannot hold (an unreadable entry's
    ``sequence: "x"``): the operator fixing it by hand needs to see it."""
    return entry.document.get(name)


@parked.command("show")
@target_options
@click.argument("event_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
def show_parked(target: Target, event_id: str, as_json: bool) -> None:
    """Show one parked event in full."""
    found = run(_parked_one(target, event_id))
    if not found:
        raise Failure(f"no parked event {event_id!r}")
    entry = dict(found[0].document)
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
        admin = OutboxAdmin(conn.outbox)
        # Ids, types and aggregate ids only: a requeue of every parked entry must not hold
        # them all whole (an outbox can have parked a broker outage's worth).
        if event_ids:
            chosen = [e.event_id for e in await admin.parked_entries(event_ids)]
        else:
            chosen = await admin.matching(types, aggregates)
        missing = sorted(set(event_ids) - {str(c) for c in chosen})
        if missing:
            raise Failure(f"not parked: {', '.join(missing)} (nothing was requeued)")
        if not chosen:  # a misspelled --type or --aggregate must not pass for a done requeue
            present = (await admin.parked(limit=0)).types
            raise Failure(
                "no parked event matches: nothing was requeued"
                + (f" (parked types: {', '.join(present)})" if present else " (none is parked)")
            )
        requeued = await _in_chunks(admin, chosen)
    earlier = requeued - len(chosen)
    if earlier < 0:  # a relay or another requeue got to some first, or one cannot come back
        return (
            f"requeued {requeued} of the {len(chosen)} parked events: the rest are no longer "
            "parked, or are unreadable entries without a sequence, to be fixed by hand "
            "(docs/failures.md)"
        )
    also = f", and {earlier} earlier parked events of their aggregates" if earlier > 0 else ""
    return f"requeued {len(chosen)} parked events{also}"


async def _in_chunks(admin: OutboxAdmin, chosen: list[Any]) -> int:
    """Requeue ``chosen`` (a chunk of ids at a time, in the admin), with progress on stderr;
    interrupted, say how far it got: whole chunks are requeued, the rest parked."""
    done = 0

    def add(n: int) -> None:
        nonlocal done
        done += n
        shown.add(n)

    async with progress("requeue", "events", total=len(chosen)) as shown:
        try:
            return await admin.requeue(chosen, progress=add)
        except (asyncio.CancelledError, KeyboardInterrupt):
            click.echo(
                f"requeue interrupted after {done} of {len(chosen)} chosen parked events: the "
                "rest are still parked; run the same command again for them",
                err=True,
            )
            raise
