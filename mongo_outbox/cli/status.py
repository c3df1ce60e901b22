"""``mongo-outbox status``: the outbox's health as an operator reads it, from MongoDB alone.

Everything is read through the outbox's admin (``mongo_outbox.admin``): the backlog and the
parked count; each change-stream relay's lease (shown as its state: ``active`` while its lease
runs, ``inactive`` once it ran out or was given up), holder and checkpoint age; the inbox
failures. Polling relays keep no record in MongoDB, so only
change-stream relays are listed.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import click

from mongo_outbox.admin import Lease, OutboxAdmin
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
from mongo_outbox.events import utc_now


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
    admin = OutboxAdmin(conn.outbox, checkpoints=checkpoints, inbox=inbox_collection)
    backlog = await admin.backlog()
    now = utc_now()
    oldest = backlog.oldest_age(now)
    return {
        "database": conn.db.name,
        "mode": target.mode,
        "outbox": target.describe(conn.db.name),
        "pending": backlog.pending,
        "oldest_pending_age_seconds": oldest.total_seconds() if oldest else None,
        "parked": backlog.parked,
        "relays": [relay_row(lease, now) for lease in await admin.leases()],
        "inbox_failures": [
            {"consumer": consumer, "failed": n}
            for consumer, n in (await admin.inbox_failures()).items()
        ],
    }


def relay_row(lease: Lease, now: datetime) -> dict[str, Any]:
    """A relay's row of the report: ``state`` is its lease's, ``active`` while it runs."""
    checkpoint_age = ago(lease.checkpoint_at, now)
    return {
        "name": lease.name,
        "state": "active" if lease.held else "inactive",
        "lease_holder": lease.holder,
        "lease_until": lease.until,
        "checkpoint_at": lease.checkpoint_at,
        "checkpoint_age_seconds": checkpoint_age.total_seconds() if checkpoint_age else None,
    }


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
