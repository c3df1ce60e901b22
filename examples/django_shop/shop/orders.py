"""What the shop does with orders: each change saved with its event, atomically."""

from __future__ import annotations

from django_mongodb_backend import transaction
from pydantic import BaseModel

from mongo_outbox import Event
from mongo_outbox.odm.django import DjangoOutbox
from shop.models import Order, Payment


class OrderPlaced(BaseModel):
    """The event's payload: what consumers read, no Django in it."""

    customer: str
    total: int


def outbox() -> DjangoOutbox:
    """The outbox over the backend's own database (the same MongoClient)."""
    return DjangoOutbox.for_database("default")


def place(orders: DjangoOutbox, customer: str, total: int) -> Order:
    order = Order(customer=customer, total=total)
    event = Event.of(OrderPlaced(customer=customer, total=total), type="order.placed")
    orders.save(order, [event])  # validated, signalled, stored with its event in one write
    return order


def pay(orders: DjangoOutbox, order: Order, *, fail_after: bool = False) -> None:
    """Pay ``order`` and record the payment in one transaction: both, or neither."""
    with transaction.atomic():
        order.status = "paid"
        orders.save(order, [Event(type="order.paid")], expected_version=order.version)
        Payment.objects.create(order_id=order.pk, amount=order.total)  # the same transaction
        if fail_after:
            raise RuntimeError("the card was declined after all")
