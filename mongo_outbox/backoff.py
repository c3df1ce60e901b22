"""The import path ``mongo_outbox.backoff.Backoff`` of the first version; ``Backoff`` lives in
``mongo_outbox.settings``, where the library imports it from."""

from mongo_outbox.settings import Backoff

__all__ = ["Backoff"]
