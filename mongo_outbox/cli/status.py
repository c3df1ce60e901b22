"""``mongo-outbox status``: the outbox's health as an operator reads it, from MongoDB alone.

The backlog and the parked entries come from the relay's store; each change-stream relay's state,
lease holder and checkpoint age from its checkpoint document (``outbox_relays``); the inbox
failures from the inbox collection. Polling relays keep no record in MongoDB, so only
change-stream relays are listed.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import click

from mongo_outbox._inbox.store import failures
from mongo_outbox._relay.store import store_for
from mongo_outbox.cli.common import (
    Connection,
    Target,
    age,
    ago,
    connected,
    option,
    run,
    say,
    table,
    target_options,
    to_json,
)
from mongo_outbox.events import as_utc, utc_now


@click.command()
@target_options
@option("--checkpoints", default="outbox_relays", show_default=True, help="Relays' checkpoints.")
@option("--inbox-collection", default="inbox", show_default=True, help="The inbox collection.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
def status(target: Target, checkpoints: str, inbox_collection: str, as_json: bool) -> None:
    """Backlog, oldest pending age, parked count, each relay's state, lease holder and
    checkpoint age, and inbox failures per consumer."""
    report = run(_report(target, checkpoints, inbox_collection))
    say(to_json(report) if as_json else _text(report))


async def _report(target: Target, checkpoints: str, inbox_collection: str) -> dict[str, Any]:
    async with connected(target) as conn:
        return await gather(conn, target, checkpoints, inbox_collection)


async def gather(
    conn: Connection, target: Target, checkpoints: str, inbox_collection: str
) -> dict[str, Any]:
    store = store_for(conn.outbox)
    backlog = await store.backlog()
    now = utc_now()
    oldest = ago(backlog.oldest, now)
    relays = [_relay(doc, now) async for doc in conn.db[checkpoints].find().sort("_id", 1)]
    return {
        "database": conn.db.name,
        "mode": target.mode,
        "outbox": target.describe(conn.db.name),
        "pending": backlog.pending,
        "oldest_pending_age_seconds": oldest.total_seconds() if oldest else None,
        "parked": await store.parked_count(),
        "relays": relays,
        "inbox_failures": [
            {"consumer": consumer, "failed": n}
            for consumer, n in (await failures(conn.db[inbox_collection])).items()
        ],
    }


def _relay(doc: dict[str, Any], now: datetime) -> dict[str, Any]:
    lease_until = _date(doc.get("lease_until"))
    checkpoint_at = _date(doc.get("checkpoint_at"))
    # A relay that stopped gave its lease up; one that died lets it run out.
    active = lease_until is not None and lease_until > now
    checkpoint_age = ago(checkpoint_at, now)
    return {
        "name": str(doc["_id"]),
        "state": "active" if active else "inactive",
        "lease_holder": doc.get("owner") if active else None,
        "lease_until": lease_until,
        "checkpoint_at": checkpoint_at,
        "checkpoint_age_seconds": checkpoint_age.total_seconds() if checkpoint_age else None,
    }


def _date(value: Any) -> datetime | None:
    return as_utc(value) if isinstance(value, datetime) else None


def _seconds(value: float | None) -> str:
    return age(None if value is None else timedelta(seconds=value))


def _text(report: dict[str, Any]) -> str:
    lines = [
        f"outbox {report['outbox']}",
        table(
            ["PENDING", "OLDEST PENDING", "PARKED"],
            [[report["pending"], _seconds(report["oldest_pending_age_seconds"]), report["parked"]]],
        ),
        "",
        "relays",
    ]
    if report["relays"]:
        rows = [
            [r["name"], r["state"], r["lease_holder"], _seconds(r["checkpoint_age_seconds"])]
            for r in report["relays"]
        ]
        lines.append(table(["NAME", "STATE", "LEASE HOLDER", "CHECKPOINT AGE"], rows))
    else:
        lines.append("  none recorded (polling relays keep no record; change-stream relays do)")
    lines += ["", "inbox failures"]
    if report["inbox_failures"]:
        rows = [[f["consumer"], f["failed"]] for f in report["inbox_failures"]]
        lines.append(table(["CONSUMER", "FAILED"], rows))
    else:
        lines.append("  none")
    return "\n".join(lines)
