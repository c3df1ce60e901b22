"""Saving Django models with their events: ``DjangoOutbox.save`` against the model's own
``save()`` with a hand-written outbox insert, in the backend's ``transaction.atomic()``.

The workload: ``ORDERS`` orders, each saved new with one event, then loaded-and-changed orders
saved again with one event (``ROUNDS`` rounds over them), collection mode, every save in a
transaction of its own, on django-mongodb-backend. Both sides validate (``full_clean()``, which
``DjangoOutbox.save`` calls by default); each has a table and an outbox collection of its own:

- ``DjangoOutbox.save(order, [event])``: validation, the signals, one ``findAndModify`` or
  insert of the document with its counters, the entry's insert, the commit (a transaction of
  the outbox's own);
- by hand: ``full_clean()``, then in ``django_mongodb_backend.transaction.atomic()`` the model's
  ``save()`` (the backend's ``insert_many``, or its ``update_one`` pipeline) and ``insert_one``
  of the outbox entry (the same fields as the library's, into a collection with the same
  indexes) on the block's session, with no version or sequence kept and no checks.

The sides are interleaved save by save in a rotating order, in ``BLOCKS`` blocks; the headline
is the median of the blocks' ratios, printed with the ratio of the totals and the range. The
goal is 1.10 or less. Django's ORM is synchronous: the benchmark runs in a thread of its own.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.common import header, median, say, standalone, stored
from mongo_outbox import Event
from mongo_outbox.events import utc_now

ORDERS = int(os.environ.get("BENCH_DJANGO_ORDERS", "300"))
ROUNDS = 2
BLOCKS = 10
INTEGRATION = "DjangoOutbox.save"
BY_HAND = "save() + outbox insert_one in atomic()"

Save = Callable[[Any, Event], None]


async def run(uri: str) -> list[str]:
    header(
        f"saving Django models: {ORDERS} new orders, then {ROUNDS} rounds of changes, each save "
        "in its own transaction with one event (collection mode), the sides interleaved"
    )
    return await asyncio.to_thread(measure, uri)


def measure(uri: str) -> list[str]:
    import django
    from django.conf import settings
    from django.core.validators import MinValueValidator
    from django.db import connections, models
    from django_mongodb_backend import transaction

    from mongo_outbox.odm.django import DjangoOutbox
    from mongo_outbox.sync import Outbox

    name = f"bench_django_{uuid.uuid4().hex[:8]}"
    settings.configure(
        DATABASES={"default": {"ENGINE": "django_mongodb_backend", "HOST": uri, "NAME": name}},
        INSTALLED_APPS=["benchmarks"],
        DEFAULT_AUTO_FIELD="django_mongodb_backend.fields.ObjectIdAutoField",
        USE_TZ=True,
    )
    django.setup()

    class Order(models.Model):
        customer: models.CharField[str, str] = models.CharField(max_length=100)
        total: models.IntegerField[int, int] = models.IntegerField(
            validators=[MinValueValidator(0)]
        )

        class Meta:
            app_label = "benchmarks"
            db_table = "orders"

    class HandOrder(models.Model):
        customer: models.CharField[str, str] = models.CharField(max_length=100)
        total: models.IntegerField[int, int] = models.IntegerField(
            validators=[MinValueValidator(0)]
        )

        class Meta:
            app_label = "benchmarks"
            db_table = "hand_orders"

    connection: Any = connections["default"]
    database = connection.database
    with connection.schema_editor() as editor:
        editor.create_model(Order)
        editor.create_model(HandOrder)
    database.create_collection("outbox")
    database.create_collection("hand_outbox")
    shop = DjangoOutbox.for_database()
    shop.outbox.ensure_indexes()
    # The hand-written side's outbox has the indexes a relay needs too: each costs every insert.
    Outbox(database, collection="hand_outbox").ensure_indexes()

    def integration(order: Any, event: Event) -> None:
        shop.save(order, [event])

    def by_hand(order: Any, event: Event) -> None:
        order.full_clean()
        with transaction.atomic():
            order.save()
            data = stored(event, "_id") | {
                "aggregate_type": "hand_orders",
                "aggregate_id": str(order.pk),
            }
            entry = data | {"status": "pending", "available_at": utc_now(), "attempts": 0}
            database.hand_outbox.insert_one(entry, session=connection.session)

    try:
        blocks = interleaved({INTEGRATION: (Order, integration), BY_HAND: (HandOrder, by_hand)})
    finally:
        database.client.drop_database(name)
        connections.close_all()
    return report(blocks)


def interleaved(sides: dict[str, tuple[Any, Save]]) -> list[dict[str, float]]:
    names = list(sides)
    orders: dict[str, list[Any]] = {name: [] for name in names}
    steps = ORDERS * (1 + ROUNDS)
    per_block = max(1, steps // BLOCKS)
    blocks: list[dict[str, float]] = []
    for n in range(steps):
        if n % per_block == 0:
            blocks.append(dict.fromkeys(names, 0.0))
        for name in names[n % len(names) :] + names[: n % len(names)]:
            model, save = sides[name]
            if n < ORDERS:
                order = model(customer=f"c{n % 17}", total=10 + n % 90)
                orders[name].append(order)
            else:
                order = model.objects.get(pk=orders[name][n % ORDERS].pk)
                order.total += 1
            event = Event(type="order.saved", payload={"total": order.total})
            start = time.perf_counter()
            save(order, event)
            blocks[-1][name] += time.perf_counter() - start
    return blocks


def report(blocks: list[dict[str, float]]) -> list[str]:
    ratios = [block[INTEGRATION] / block[BY_HAND] for block in blocks]
    totals = sum(b[INTEGRATION] for b in blocks) / sum(b[BY_HAND] for b in blocks)
    lines = [
        f"{name:<42}{sum(block[name] for block in blocks):6.1f} s"
        for name in (INTEGRATION, BY_HAND)
    ]
    lines.append(
        f"{INTEGRATION} to {BY_HAND}: ratio {median(ratios):.3f} (blocks "
        f"{min(ratios):.2f}-{max(ratios):.2f}, totals {totals:.3f}; goal <= 1.10)"
    )
    lines.append(
        f"(median of {len(blocks)} blocks of {ORDERS * (1 + ROUNDS) // len(blocks)} saves)"
    )
    for line in lines:
        say(line)
    return lines


if __name__ == "__main__":
    standalone(run)
