"""The inbox's implementation, behind ``mongo_outbox.inbox``: how its records are read and
written (``store``, the one place that knows their shape), one attempt at a delivery in either
mode and what a failure leads to (``attempts``), and the words for a message's fate
(``outcomes``, a leaf)."""
