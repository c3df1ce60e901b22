"""A Django project on MongoDB that saves its orders with their events, then relays them.

    python examples/django_shop/run.py

MongoDB: MONGODB_URI, else the mongoeco emulator started here (mongo_outbox.testing, which needs
mongo-outbox[testing] and Python >= 3.13). It migrates the ``shop`` app, places three orders
(one refused by validation: nothing written), pays one in ``django_mongodb_backend``'s
``transaction.atomic()`` with a ``Payment`` beside it, fails another payment inside the block
(aborted: no payment, no event), then drains the outbox through ``PollingRelay`` into an
in-memory publisher and prints what was published.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the project's own modules


@contextlib.contextmanager
def mongodb() -> Iterator[str]:
    """MONGODB_URI, or an emulator for the example's length."""
    if uri := os.environ.get("MONGODB_URI"):
        yield uri
        return
    from mongo_outbox.testing import start_emulator

    with start_emulator() as emulator:
        yield emulator.uri


def main() -> int:
    with mongodb() as uri:
        os.environ["MONGODB_URI"] = uri
        os.environ.setdefault("DJANGO_SHOP_DB", f"django_shop_{uuid.uuid4().hex[:8]}")
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")
        import django
        from django.core.exceptions import ValidationError
        from django.core.management import call_command
        from django.db import connections
        from pymongo import AsyncMongoClient

        django.setup()
        from shop import orders
        from shop.models import Order, Payment

        from mongo_outbox import Outbox, PollingRelay
        from mongo_outbox.publishers import MemoryPublisher

        call_command("migrate", verbosity=0)
        shop = orders.outbox()
        shop.outbox.ensure_indexes()
        ada = orders.place(shop, " ada ", 30)
        bob = orders.place(shop, "bob", 12)
        try:
            orders.place(shop, "eve", -5)
        except ValidationError as error:
            print("refused      ", error.message_dict["total"][0])
        orders.pay(shop, ada)
        try:
            orders.pay(shop, Order.objects.get(pk=bob.pk), fail_after=True)
        except RuntimeError as error:
            print("aborted      ", error)

        async def relay() -> MemoryPublisher:
            client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(uri, tz_aware=True)
            try:
                publisher = MemoryPublisher()
                database = client[os.environ["DJANGO_SHOP_DB"]]
                await PollingRelay(Outbox(database), publisher).drain()
                return publisher
            finally:
                await client.close()

        publisher = asyncio.run(relay())
        for event in publisher.events:
            print("published    ", event.type, event.aggregate_id, event.sequence)
        print("orders       ", len(list(Order.objects.all())))
        print("payments     ", len(list(Payment.objects.all())))
        print("ada          ", Order.objects.get(pk=ada.pk).status, ada.version)
        connections["default"].connection.drop_database(os.environ["DJANGO_SHOP_DB"])
        connections.close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
