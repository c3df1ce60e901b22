"""The write side behind ``mongo_outbox.Outbox`` and ``mongo_outbox.sync.Outbox``.

A save goes: ``rules`` checks it and makes a ``Plan`` (``plan``; ``aggregates`` names the
aggregate, ``updates`` checks an update); ``engine`` runs it as steps (``mongo_outbox._steps``:
generators of database calls that both APIs drive). The ``layout`` of the outbox's mode
(``collection_layout``, ``embedded_layout``) owns what differs between the modes: the fields the
outbox owns, its indexes and how entries are written. ``documents`` writes the aggregate
document, ``refusals`` reads why a write matched nothing, ``event_ids`` keeps embedded mode's
event ids unique, and ``sessions`` keeps a caller's session to one save's transaction at a time.
"""
