"""The stored layout both sides meet in: the names of the fields the library keeps on what it
stores, and the id registry's shape. One leaf (it imports nothing of the library), so that the
write side, the relays, the admin and the inbox name a stored field the same way, and a rename
is one line, not a search through the modules that once spelled it each on their own. The
event's own fields are ``Event``'s (``_codec`` encodes them); these are the bookkeeping fields
around them.
"""

from __future__ import annotations

from typing import Any

# -- an outbox entry's bookkeeping (collection mode: the entry is a document of the outbox
# collection; embedded mode: an element of the aggregate document's entries array) --

STATUS = "status"
"""Collection mode: ``PENDING``, ``PARKED`` or ``PUBLISHED``."""
PENDING = "pending"
PARKED = "parked"
PUBLISHED = "published"
PARKED_FLAG = "parked"
"""Embedded mode: ``True`` on a parked entry (an embedded entry has no status: a published one
leaves its document)."""
AVAILABLE_AT = "available_at"
"""When the entry is due (collection mode; embedded mode keeps the due time on the document)."""
CLAIM = "claim"
"""The token of the round whose claim holds the entry, while its claim lease runs."""
ATTEMPTS = "attempts"
"""Failed attempts that counted (an outage counts none)."""
SEQUENCES = "aggregate_sequence"
"""Collection mode: the unique index of ``(aggregate_type, aggregate_id, sequence)``."""
WAITS = "waits"
"""Failures that counted no attempt: the broker away or full."""
MISSES = "misses"
"""Rounds that met the entry held back behind an earlier one of its aggregate."""
WAITING = "waiting"
"""Due again only once the entry before it of its aggregate was published or parked."""
LAST_ERROR = "last_error"
PUBLISHED_AT = "published_at"
PUBLISHED_BY = "published_by"
"""The name of the relay that published it (on an entry, or an id's registry document): the
console's rates per relay."""
PARKED_AT = "parked_at"
PARKED_BY = "parked_by"
"""The name of the relay that parked it."""
EXPIRE_AT = "expire_at"
"""The TTL index's field (outbox, id registry, inbox): the document goes after this time."""

# -- a leader lease (``outbox_relays``: a change-stream relay's, a relay group's partition's) --

OWNER = "owner"
LEASE_UNTIL = "lease_until"
FENCE = "fence"
TOKEN = "token"
"""A change-stream relay's resume token, saved under the fence."""
CHECKPOINT_AT = "checkpoint_at"

# -- the event-id registry of embedded mode (``<outbox>_event_ids``): one id, one document --

HOLDER_COLLECTION = "collection"
"""The full name of the collection of the aggregate document that holds the id."""
HOLDER_DOCUMENT = "aggregate"
"""That document's ``_id``."""
HOLDER_SEQUENCE = "sequence"
"""The entry's sequence, once a relay took the id for it (a save's reservation has none)."""
MARKED_PUBLISHED = "published"
"""``True`` once the relay's settle marked the id published (with an ``EXPIRE_AT``)."""

Holder = tuple[Any, Any]
"""An aggregate document as the registry and the relay name it: its collection's name, its
``_id``."""
Taken = tuple[Holder, Any]
"""Who holds an id in the registry: the document, and the entry's sequence."""
