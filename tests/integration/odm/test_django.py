"""Django models saved with their events through ``DjangoOutbox``, on the real Django and
django-mongodb-backend against the test MongoDB, in both modes: the model and its events in one
write, joined to ``django_mongodb_backend.transaction.atomic()``, Django's validation, signals
and conventions kept. The models are examples/django_shop's ``shop`` app, migrated by Django."""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("django_mongodb_backend", reason="the django extra is not installed")

import django
from bson import ObjectId
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.db import connections
from django.db.models import signals
from django_mongodb_backend import transaction

from mongo_outbox import ConcurrencyError, ConfigurationError, DuplicateSequenceError, Event
from mongo_outbox.errors import AggregateNotFoundError, InvalidAggregateError, InvalidEventError
from mongo_outbox.odm.django import DjangoOutbox
from tests.support.servers import MongoServer

ROOT = Path(__file__).resolve().parents[3]
PROJECT = ROOT / "examples" / "django_shop"
MODES = ["collection", "embedded"]


@pytest.fixture(scope="module")
def project(mongo: MongoServer) -> Iterator[Any]:
    """Django configured once for this process with the example's app, migrated on a database
    of this module's own; a second, SQLite database for the misuse tests."""
    name = f"t_django_{uuid.uuid4().hex[:8]}"
    if not settings.configured:
        sys.path.insert(0, str(PROJECT))
        settings.configure(
            DATABASES={
                "default": {"ENGINE": "django_mongodb_backend", "HOST": mongo.uri, "NAME": name},
                "sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
            },
            INSTALLED_APPS=["shop"],
            DEFAULT_AUTO_FIELD="django_mongodb_backend.fields.ObjectIdAutoField",
            USE_TZ=True,
        )
        django.setup()
    call_command("migrate", verbosity=0)
    database = connections["default"].database  # type: ignore[attr-defined]
    yield database
    database.client.drop_database(database.name)


@pytest.fixture(params=MODES)
def shop(project: Any, request: pytest.FixtureRequest) -> DjangoOutbox:
    """A DjangoOutbox in one mode over emptied collections; signals recorded."""
    for name in ("orders", "payments", "customers", "outbox"):
        project[name].delete_many({})
    orders = DjangoOutbox.for_database(mode=request.param, collections=["orders", "customers"])
    orders.outbox.ensure_indexes()
    return orders


@pytest.fixture
def sent() -> Iterator[list[str]]:
    """The model signals sent for shop's Order, in order."""
    from shop.models import Order

    names: list[str] = []

    def pre_save(sender: Any, instance: Any, **kwargs: Any) -> None:
        names.append(f"pre_save update_fields={kwargs['update_fields']}")

    def post_save(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
        names.append(f"post_save created={created}")

    def deleted(sender: Any, instance: Any, **kwargs: Any) -> None:
        names.append("delete")

    receivers = [
        (signals.pre_save, pre_save),
        (signals.post_save, post_save),
        (signals.pre_delete, deleted),
        (signals.post_delete, deleted),
    ]
    for signal, receiver in receivers:
        signal.connect(receiver, sender=Order)
    yield names
    for signal, receiver in receivers:
        signal.disconnect(receiver, sender=Order)


def events_of(shop: DjangoOutbox, project: Any, order_id: Any) -> list[tuple[str, int]]:
    """(type, sequence) of the order's events, as stored in either mode."""
    if shop.outbox.mode == "embedded":
        stored = project.orders.find_one({"_id": order_id}) or {}
        pending = stored.get("_outbox", [])
        # An update pushes its entries unnumbered: the last one holds _sequence (no relay ran).
        first = stored.get("_sequence", 0) - len(pending) + 1
        return [(e["type"], first + i) for i, e in enumerate(pending)]
    entries = project.outbox.find({"aggregate_id": str(order_id)}).sort("sequence", 1)
    return [(e["type"], e["sequence"]) for e in entries]


def test_a_saved_model_and_its_events_load_back_in_django(shop: DjangoOutbox, project: Any) -> None:
    from shop.models import Order

    order = Order(customer=" ada ", total=10)
    saved = shop.save(order, [Event(type="order.placed"), Event(type="order.priced")])
    assert isinstance(order.pk, ObjectId) and saved.id == order.pk and saved.version == 1
    assert order.version == 1 and order.customer == "ada"  # clean() ran before the write
    assert order.placed_at is not None and not order._state.adding  # auto_now_add, as Django
    stored = project.orders.find_one({"_id": order.pk})
    assert (stored["customer"], stored["total"], stored["_version"]) == ("ada", 10, 1)
    assert events_of(shop, project, order.pk) == [("order.placed", 1), ("order.priced", 2)]
    loaded = Order.objects.get(pk=order.pk)
    stamp = order.placed_at.replace(microsecond=order.placed_at.microsecond // 1000 * 1000)
    assert (loaded.total, loaded.version, loaded.placed_at) == (10, 1, stamp)  # BSON: ms
    loaded.total = 12
    shop.save(loaded, [Event(type="order.repriced")], expected_version=loaded.version)
    assert loaded.version == 2
    loaded.status = "packed"
    loaded.save()  # Django's own save keeps the outbox's fields and pending events
    again = project.orders.find_one({"_id": order.pk})
    assert (again["_version"], again["_sequence"], again["total"]) == (2, 3, 12)
    assert events_of(shop, project, order.pk)[-1] == ("order.repriced", 3)


def test_a_save_inside_atomic_commits_with_the_blocks_other_writes(
    shop: DjangoOutbox, project: Any
) -> None:
    from shop.models import Order, Payment

    order = Order(customer="ada", total=10)
    shop.save(order, [Event(type="order.placed")])
    with transaction.atomic():
        order.status = "paid"
        shop.save(order, [Event(type="order.paid")], expected_version=1)
        Payment.objects.create(order_id=order.pk, amount=10)
        assert order.version == 1  # the commit has not happened yet
        assert project.payments.count_documents({}) == 0  # nor is anything visible outside
    assert order.version == 2  # set on commit
    assert Order.objects.get(pk=order.pk).status == "paid"
    assert project.payments.count_documents({"order_id": order.pk}) == 1
    assert events_of(shop, project, order.pk) == [("order.placed", 1), ("order.paid", 2)]


def test_a_save_rolled_back_by_an_exception_inside_atomic_leaves_no_event(
    shop: DjangoOutbox, project: Any
) -> None:
    from shop.models import Order, Payment

    order = Order(customer="ada", total=10)
    shop.save(order, [Event(type="order.placed")])
    with pytest.raises(RuntimeError, match="declined"), transaction.atomic():
        order.status = "paid"
        shop.save(order, [Event(type="order.paid")], expected_version=order.version)
        Payment.objects.create(order_id=order.pk, amount=10)
        raise RuntimeError("declined")
    assert Order.objects.get(pk=order.pk).status == "new"
    assert project.payments.count_documents({}) == 0
    assert events_of(shop, project, order.pk) == [("order.placed", 1)]
    assert order.version == 1  # the version its retry must expect
    shop.save(order, [Event(type="order.paid")], expected_version=order.version)
    assert events_of(shop, project, order.pk) == [("order.placed", 1), ("order.paid", 2)]


def test_a_new_model_rolled_back_inside_atomic_is_not_stored(
    shop: DjangoOutbox, project: Any
) -> None:
    from shop.models import Order

    with pytest.raises(RuntimeError), transaction.atomic():
        shop.save(Order(customer="ada", total=1), [Event(type="order.placed")])
        shop.save(Order(customer="bob", total=2), [Event(type="order.placed")])
        raise RuntimeError("abandoned")
    assert project.orders.count_documents({}) == 0
    assert project.outbox.count_documents({}) == 0


def test_a_validation_error_writes_nothing_and_sends_no_signal(
    shop: DjangoOutbox, project: Any, sent: list[str]
) -> None:
    from shop.models import Order

    with pytest.raises(ValidationError) as refused:
        shop.save(Order(customer="ada", total=-1), [Event(type="order.placed")])
    assert "total" in refused.value.message_dict
    order = Order(customer="ada", total=0)
    shop.save(order, [Event(type="order.placed")])
    order.status = "paid"  # clean(): a paid order has a total
    with pytest.raises(ValidationError):
        shop.save(order, [Event(type="order.paid")])
    assert project.orders.find_one({"_id": order.pk})["status"] == "new"
    assert events_of(shop, project, order.pk) == [("order.placed", 1)]
    assert sent == ["pre_save update_fields=None", "post_save created=True"]


def test_post_save_runs_once_per_save_with_djangos_arguments(
    shop: DjangoOutbox, project: Any, sent: list[str]
) -> None:
    from shop.models import Order

    order = Order(customer="ada", total=1)
    shop.save(order, [Event(type="order.placed")])
    order.total = 2
    with transaction.atomic():
        shop.save(order, [Event(type="a"), Event(type="b")], update_fields=["total"])
    if shop.outbox.mode == "collection":  # delete_with_events is of collection mode only
        shop.delete(order, [Event(type="order.deleted")])
    expected = [
        "pre_save update_fields=None",
        "post_save created=True",
        "pre_save update_fields=frozenset({'total'})",
        "post_save created=False",
    ]
    if shop.outbox.mode == "collection":
        expected += ["delete", "delete"]
        assert order.pk is None and project.orders.count_documents({}) == 0
    assert sent == expected


def test_update_fields_writes_only_the_named_fields(shop: DjangoOutbox, project: Any) -> None:
    from shop.models import Order

    order = Order(customer="ada", total=1)
    shop.save(order, [Event(type="order.placed")])
    order.total, order.status = 5, "paid"
    shop.save(order, [Event(type="order.repriced")], update_fields=["total"])
    stored = project.orders.find_one({"_id": order.pk})
    assert (stored["total"], stored["status"], stored["_version"]) == (5, "new", 2)


def test_a_loaded_model_whose_document_is_gone_is_inserted_again_as_django_does(
    shop: DjangoOutbox, project: Any
) -> None:
    from shop.models import Order

    order = Order(customer="ada", total=1)
    shop.save(order, [Event(type="order.placed")])
    project.orders.delete_one({"_id": order.pk})
    if shop.outbox.mode == "collection":
        project.outbox.delete_many({})  # its sequences would otherwise be refused as repeated
    shop.save(order, [Event(type="order.restored")])
    assert project.orders.find_one({"_id": order.pk})["customer"] == "ada"
    project.orders.delete_one({"_id": order.pk})
    with pytest.raises(AggregateNotFoundError):  # a forced update does not insert
        shop.save(order, [Event(type="order.repriced")], update_fields=["total"])


def test_two_models_saved_concurrently_each_in_its_own_atomic_block(
    shop: DjangoOutbox, project: Any
) -> None:
    from shop.models import Order, Payment

    barrier = threading.Barrier(2)

    def place(customer: str) -> Any:
        try:
            # Each thread has its own Django connection, so its own session and transaction.
            with transaction.atomic():
                order = Order(customer=customer, total=3)
                shop.save(order, [Event(type="order.placed"), Event(type="order.priced")])
                barrier.wait(timeout=10)  # both transactions open at once
                Payment.objects.create(order_id=order.pk, amount=3)
            return order.pk
        finally:
            connections.close_all()

    with ThreadPoolExecutor(2) as pool:
        ids = list(pool.map(place, ["ada", "bob"]))  # raises what a thread raised
    assert len(set(ids)) == 2 and project.payments.count_documents({}) == 2
    for order_id in ids:
        assert events_of(shop, project, order_id) == [("order.placed", 1), ("order.priced", 2)]


def test_two_writers_of_one_model_at_one_version_one_wins(shop: DjangoOutbox, project: Any) -> None:
    from shop.models import Order

    order = Order(customer="ada", total=1)
    shop.save(order, [Event(type="order.placed")])
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def pay(total: int) -> None:
        try:
            mine = Order.objects.get(pk=order.pk)
            barrier.wait(timeout=10)
            mine.total = total
            shop.save(mine, [Event(type="order.repriced")], expected_version=mine.version)
            outcomes.append("saved")
        except ConcurrencyError:
            outcomes.append("conflict")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=pay, args=(total,)) for total in (5, 7)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["conflict", "saved"]
    assert events_of(shop, project, order.pk) == [("order.placed", 1), ("order.repriced", 2)]


def test_misuse_is_refused_before_anything_is_written(shop: DjangoOutbox, project: Any) -> None:
    from shop.models import Order

    with pytest.raises(InvalidAggregateError, match="set to None"):
        shop.delete(Order(customer="ada", total=1), [Event(type="order.deleted")])
    with pytest.raises(InvalidAggregateError, match="sqlite"):
        shop.save(Order(customer="ada", total=1), [Event(type="order.placed")], using="sqlite")
    with pytest.raises(ConfigurationError) as not_mongodb:
        DjangoOutbox.for_database("sqlite")
    assert not_mongodb.value.setting == "alias"
    order = Order(customer="ada", total=1)
    with pytest.raises(InvalidAggregateError, match="does not have"):
        shop.save(order, [Event(type="order.placed")], update_fields=["totl"])
    with pytest.raises(InvalidAggregateError, match="force both"):
        shop.save(order, [Event(type="order.placed")], force_insert=True, force_update=True)
    assert order.pk is None and order._state.adding
    assert project.orders.count_documents({}) == 0
    assert project.outbox.count_documents({}) == 0


def test_force_insert_of_a_stored_pk_is_refused_and_writes_nothing(
    shop: DjangoOutbox, project: Any
) -> None:
    """Django's forced insert of a stored pk fails (IntegrityError); the outbox's create does."""
    from shop.models import Order

    order = Order(customer="ada", total=1)
    shop.save(order, [Event(type="order.placed")])
    twin = Order(pk=order.pk, customer="eve", total=9)
    with pytest.raises(ValidationError, match="already exists"):  # full_clean's unique check
        shop.save(twin, [Event(type="order.placed")], force_insert=True)
    with pytest.raises(ConcurrencyError):  # the write refuses it too
        shop.save(twin, [Event(type="order.placed")], force_insert=True, validate=False)
    assert project.orders.find_one({"_id": order.pk})["customer"] == "ada"
    assert events_of(shop, project, order.pk) == [("order.placed", 1)]


@pytest.fixture(scope="module")
def odd_models(project: Any) -> dict[str, Any]:
    """Models of the shop app that only these tests declare: a proxy, a multi-table child, and
    a model others point at. Declared once per process (Django keeps its registry)."""
    from django.apps import apps
    from django.db import models
    from shop.models import Order

    if "rushorder" in apps.all_models["shop"]:
        names = ("rushorder", "giftorder", "customer", "address")
        return {name: apps.get_model("shop", name) for name in names}

    class RushOrder(Order):
        class Meta:
            app_label = "shop"
            proxy = True

    class GiftOrder(Order):  # multi-table inheritance: a table of its own, a link to orders
        message = models.CharField(max_length=100)

        class Meta:
            app_label = "shop"

    class Customer(models.Model):
        name = models.CharField(max_length=100)

        class Meta:
            app_label = "shop"
            db_table = "customers"

    class Address(models.Model):
        customer = models.ForeignKey(Customer, on_delete=models.CASCADE)

        class Meta:
            app_label = "shop"

    return {
        "rushorder": RushOrder,
        "giftorder": GiftOrder,
        "customer": Customer,
        "address": Address,
    }


def test_a_proxy_model_saves_its_concrete_table_and_sends_signals_as_itself(
    shop: DjangoOutbox, project: Any, odd_models: dict[str, Any]
) -> None:
    proxy = odd_models["rushorder"]
    senders: list[Any] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        senders.append(sender)

    signals.post_save.connect(receiver, sender=proxy)
    try:
        rush = proxy(customer="ada", total=3)
        shop.save(rush, [Event(type="order.rushed")])
    finally:
        signals.post_save.disconnect(receiver, sender=proxy)
    assert senders == [proxy]
    assert project.orders.find_one({"_id": rush.pk})["customer"] == "ada"
    assert events_of(shop, project, rush.pk) == [("order.rushed", 1)]


def test_models_whose_save_or_delete_is_several_writes_are_refused(
    shop: DjangoOutbox, project: Any, odd_models: dict[str, Any]
) -> None:
    from django.db.models import F
    from shop.models import Order

    with pytest.raises(InvalidAggregateError, match="inherits fields"):
        gift = odd_models["giftorder"](customer="ada", total=1, message="hi")
        shop.save(gift, [Event(type="order.placed")], validate=False)
    customer = odd_models["customer"](name="ada")
    shop.save(customer, [Event(type="customer.joined")])
    with pytest.raises(InvalidAggregateError, match="cascade"):
        shop.delete(customer, [Event(type="customer.left")])
    order = Order(customer="ada", total=1)
    shop.save(order, [Event(type="order.placed")])
    order.total = F("total") + 1
    with pytest.raises(InvalidAggregateError, match="expression"):
        shop.save(order, [Event(type="order.repriced")], validate=False)
    assert project.orders.find_one({"_id": order.pk})["total"] == 1
    assert events_of(shop, project, order.pk) == [("order.placed", 1)]


def test_a_refused_insert_leaves_a_new_model_without_a_pk(shop: DjangoOutbox, project: Any) -> None:
    from shop.models import Order

    order = Order(customer="ada", total=1)
    with pytest.raises(InvalidEventError):  # an event id used twice in one save
        shop.save(order, [Event(id="e1", type="a"), Event(id="e1", type="b")])
    assert order.pk is None and order._state.adding
    assert project.orders.count_documents({}) == 0
    shop.save(order, [Event(type="order.placed")])
    assert events_of(shop, project, order.pk) == [("order.placed", 1)]


def test_a_save_that_aborts_the_blocks_transaction_itself_leaves_nothing_of_the_block(
    shop: DjangoOutbox, project: Any
) -> None:
    """Refused for repeated sequences after the document's write, the outbox aborts the joined
    transaction; the backend's atomic() then fails to abort it again (docs/django.md)."""
    from pymongo.errors import InvalidOperation
    from shop.models import Order, Payment

    if shop.outbox.mode == "embedded":
        pytest.skip("embedded mode keeps no sequences outside the document")
    order = Order(customer="ada", total=1)
    shop.save(order, [Event(type="order.placed")])
    project.orders.delete_one({"_id": order.pk})  # its sequence 1 stays in the outbox
    with pytest.raises(InvalidOperation, match="abortTransaction twice") as ended:
        with transaction.atomic():
            Payment.objects.create(order_id=order.pk, amount=1)
            shop.save(order, [Event(type="order.restored")])
    assert isinstance(ended.value.__context__, DuplicateSequenceError)
    assert project.orders.count_documents({}) == 0
    assert project.payments.count_documents({}) == 0
    assert events_of(shop, project, order.pk) == [("order.placed", 1)]
