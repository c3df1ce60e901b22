"""The import path ``mongo_outbox.consumers.base`` of before the seam below the brokers moved to
``mongo_outbox.brokers._consuming``: the delivery loop and the outcome-to-broker table."""

from mongo_outbox.brokers._consuming import (
    DeadLetterDelivery,
    Delivery,
    Dispatcher,
    Rejected,
    aggregate_key,
    being_cancelled,
    check_source,
    decode,
    decode_delivery,
    delivery_limit_of,
    ready,
    settle,
    stopped_within,
)

__all__ = [
    "DeadLetterDelivery",
    "Delivery",
    "Dispatcher",
    "Rejected",
    "aggregate_key",
    "being_cancelled",
    "check_source",
    "decode",
    "decode_delivery",
    "delivery_limit_of",
    "ready",
    "settle",
    "stopped_within",
]
