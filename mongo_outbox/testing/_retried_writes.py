"""Retryable writes applied once, as a replica set member applies them.

A driver sends a retryable write (``insert``, ``update``, ``delete``, ``findAndModify`` outside a
transaction) with its session's ``lsid`` and a ``txnNumber``, and sends it again, with the same
number, after a network error or a retryable error. MongoDB records the outcome of the session's
last number and answers a retry from that record, so a write whose reply was lost is applied
once. mongoeco ran the retry as a new write: an insert whose reply was lost raised
``DuplicateKeyError`` at its retry, an ``$inc`` counted twice. So a fault the server applied
before it failed (a write concern error, a reply lost past the client's socket timeout) was
seen twice by the library under test, which MongoDB never does.

The record is kept per session for its last ``txnNumber`` only, as the server's; a session's
writes run one at a time (MongoDB checks a session out for each command), so a retry that
arrives while the first try still runs (held by ``blockConnection``) waits for it and answers
from its record.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from typing import Any

from mongoeco.wire._session_identity import wire_session_key

Reply = dict[str, Any]
RETRYABLE = frozenset({"insert", "update", "delete", "findAndModify", "findandmodify"})


class RetriedWrites:
    """Each session's last retryable write and its reply, to answer its retries."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, Reply]] = {}  # session key -> (txnNumber, reply)
        self.locks: dict[str, asyncio.Lock] = {}

    async def run(self, body: dict[str, Any], execute: Callable[[], Awaitable[Reply]]) -> Reply:
        name = next((key for key in body if not key.startswith("$")), "")
        if (
            name not in RETRYABLE
            or "lsid" not in body
            or "txnNumber" not in body
            or "autocommit" in body  # a transaction's statement: its commit is what retries
        ):
            return await execute()
        key = wire_session_key(body["lsid"])
        number = int(getattr(body["txnNumber"], "value", body["txnNumber"]))
        lock = self.locks.setdefault(key, asyncio.Lock())
        async with lock:
            recorded = self.last.get(key)
            if recorded is not None and recorded[0] == number:
                return copy.deepcopy(recorded[1])
            reply = await execute()
            # A write that failed as a whole was not applied: its retry runs it again.
            if reply.get("ok"):
                self.last[key] = (number, copy.deepcopy(reply))
            return reply
