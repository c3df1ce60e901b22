"""Kept for the import path ``mongo_outbox.backoff.Backoff``; it lives in ``settings``."""

from mongo_outbox.settings import Backoff

__all__ = ["Backoff"]
