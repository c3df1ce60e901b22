"""An order: a Django model on MongoDB, saved with its events by ``shop.orders``."""

from __future__ import annotations

from datetime import datetime

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django_mongodb_backend.fields import ObjectIdField


class Order(models.Model):
    customer: models.CharField[str, str] = models.CharField(max_length=100)
    total: models.IntegerField[int, int] = models.IntegerField(validators=[MinValueValidator(0)])
    status: models.CharField[str, str] = models.CharField(max_length=20, default="new")
    placed_at: models.DateTimeField[datetime, datetime] = models.DateTimeField(auto_now_add=True)
    # The outbox's version of the document, loaded by Django and set by DjangoOutbox: pass it
    # as expected_version to save only if nobody wrote in between.
    version: models.IntegerField[int, int] = models.IntegerField(
        db_column="_version", default=0, editable=False
    )

    class Meta:
        db_table = "orders"

    def clean(self) -> None:
        self.customer = self.customer.strip()
        if self.status == "paid" and self.total == 0:
            raise ValidationError({"total": "a paid order has a total"})


class Payment(models.Model):
    """Written by Django's own ORM in the transaction that saves the order paid."""

    order_id = ObjectIdField()
    amount: models.IntegerField[int, int] = models.IntegerField()

    class Meta:
        db_table = "payments"
