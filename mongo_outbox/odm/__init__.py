"""Integrations with MongoDB's Python ODMs: ``mongo_outbox.odm.beanie`` (async, extra
``beanie``) and ``mongo_outbox.odm.mongoengine`` (sync, extra ``mongoengine``).

Each is its own module and imports its ODM there only, so ``import mongo_outbox`` never needs
either. They save the ODM's documents through an ``Outbox`` (the same rules, the same storage)
and keep the ODM's own behaviour around the write: validation, its event hooks, its optimistic
concurrency. docs/beanie.md and docs/mongoengine.md say what each ODM sees.
"""
