"""Integrations with MongoDB's Python ODMs: ``mongo_outbox.odm.beanie`` (async, extra
``beanie``), ``mongo_outbox.odm.mongoengine`` (sync, extra ``mongoengine``),
``mongo_outbox.odm.odmantic`` (async on Motor, extra ``odmantic``) and
``mongo_outbox.odm.django`` (Django's ORM on django-mongodb-backend, sync, extra ``django``).

Each is its own module and imports its ODM there only, so ``import mongo_outbox`` never needs
either. They save the ODM's documents through an ``Outbox`` (the same rules, the same storage)
and keep the ODM's own behaviour around the write: validation, its event hooks, its optimistic
concurrency. docs/beanie.md, docs/mongoengine.md, docs/odmantic.md and docs/django.md say what
each ODM sees.
"""
