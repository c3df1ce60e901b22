"""The import path ``mongo_outbox.publishers.base`` of before the seam below the brokers moved to
``mongo_outbox.brokers._publishing``: the Publisher protocol and what the adapters share."""

from mongo_outbox.brokers._publishing import (
    BatchPublisher,
    Naming,
    NamingFailed,
    Publisher,
    check_naming,
    check_publisher,
    client_call,
    closed_error,
    full_error,
    message_headers,
    redact_url,
    render,
    unavailable_error,
    url_secrets,
)
from mongo_outbox.errors import unavailable

__all__ = [
    "BatchPublisher",
    "Naming",
    "NamingFailed",
    "Publisher",
    "check_naming",
    "check_publisher",
    "client_call",
    "closed_error",
    "full_error",
    "message_headers",
    "redact_url",
    "render",
    "unavailable",
    "unavailable_error",
    "url_secrets",
]
