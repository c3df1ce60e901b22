"""``inbox_guard``'s own import path, for the broker consumers and for users who import it from
here. The guard runs a handler against an ``Inbox`` and is one concept with it, so both live in
``mongo_outbox.inbox``."""

from mongo_outbox.inbox import (
    MAX_ID_LENGTH,
    Guarded,
    Handler,
    check_message_id,
    inbox_guard,
    qualified_name,
)

__all__ = [
    "MAX_ID_LENGTH",
    "Guarded",
    "Handler",
    "check_message_id",
    "inbox_guard",
    "qualified_name",
]
