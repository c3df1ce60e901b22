"""Multi-document transactions the way MongoDB runs them, on mongoeco's in-memory engine.

mongoeco 4.11 gives each transaction a private copy of the data (its snapshot plus its own
writes), which is right, but commits it wrongly: any commit since the snapshot fails the whole
transaction ("Write conflict during transaction commit", without code 112 or the
``TransientTransactionError`` label), and a commit installs its copy of every collection it
touched, so writes other sessions made meanwhile are lost. ``Transactions`` replaces the
conflict and commit rules and keeps mongoeco's snapshots:

- **Conflicts per document, at the write.** A transaction that writes a document (or a key of a
  unique index) which another open transaction holds, or which was changed after its snapshot,
  gets ``WriteConflict`` (code 112, label ``TransientTransactionError``) and is aborted. First
  writer wins. Two transactions that insert different ``_id``\\ s never conflict.
- **A write outside a transaction waits** for the transaction that holds its document to end,
  then runs (``TransactionsOverWire`` runs it again).
- **A commit applies exactly its own changes** to the live data (documents and index entries),
  and its change events, once, in commit order. An aborted transaction leaves nothing.
- **Transaction numbers are checked** the way a server does: a command of a transaction that
  was aborted (by a conflict, or because it outlived its lifetime) gets
  ``NoSuchTransaction`` (251) with ``TransientTransactionError``, its commit included, and never
  runs outside the transaction.
- **The lifetime is the server's ``transactionLifetimeLimitSeconds``**:
  ``MONGOECO_TRANSACTION_LIFETIME`` at start (60 s by default), changed at run time by
  ``setParameter`` and read by ``getParameter``, as on a server.
- **A failed command ends its transaction**, as on a server: after a duplicate key (or any
  other error) inside a transaction, its next command gets ``NoSuchTransaction``. A command a
  server does not run in a transaction (``count``, ``listCollections``...) is refused with
  ``OperationNotSupportedInTransaction`` (263) and aborts it too.
- **A collection or index a transaction creates** (``create``, ``createIndexes`` on a new
  collection) exists from its commit on, even when the transaction wrote no document.

Everything here reaches into mongoeco's engine, so it is pinned to the version it was written
for (``PINNED``); ``install`` refuses another one rather than guess.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

from mongoeco.core.collation import normalize_collation, string_equality_key
from mongoeco.engines._memory_collection import MemoryCollection
from mongoeco.engines.virtual_indexes import document_in_virtual_index
from mongoeco.errors import OperationFailure
from mongoeco.wire._session_identity import wire_session_key
from mongoeco.wire.executor import WireCommandExecutor

PINNED = "4.11.0"
WRITE_CONFLICT = 112
NO_SUCH_TRANSACTION = 251
OPERATION_NOT_SUPPORTED_IN_TRANSACTION = 263
# The commands a server runs inside a multi-document transaction (MongoDB 7.0's allow list,
# less its internal cluster* and prepare commands); any other is refused with code 263.
ALLOWED_IN_TRANSACTION = frozenset(
    {
        "abortTransaction", "aggregate", "bulkWrite", "commitTransaction", "create",
        "createIndexes", "delete", "distinct", "find", "findAndModify", "findandmodify",
        "getMore", "insert", "killCursors", "update",
    }
)  # fmt: skip
TRANSIENT = "TransientTransactionError"
# A server aborts a transaction that stays open longer than transactionLifetimeLimitSeconds
# (60 s by default); a client SIGKILLed mid-transaction would otherwise hold its documents forever.
TRANSACTION_LIFETIME = float(os.environ.get("MONGOECO_TRANSACTION_LIFETIME", "60"))
LIFETIME_PARAMETER = "transactionLifetimeLimitSeconds"
BAD_VALUE = 2
INVALID_OPTIONS = 72
# What a driver adds to any command, beside its name and arguments.
GENERIC_FIELDS = frozenset(
    {"lsid", "comment", "$db", "$clusterTime", "$readPreference", "apiVersion"}
)
CONFLICT_MARK = "[emulator: conflict with transaction"
WAIT_MARK = "[emulator: waits for transaction "

Token = tuple[Any, ...]  # ("doc", db, coll, storage key) or ("key", db, coll, index, key)


@dataclass(eq=False)
class Txn:
    """One open transaction: its snapshot's clock, what it holds and what it wrote."""

    number: int
    session: Any  # mongoeco's ClientSession
    state: Any  # mongoeco's MemoryMvccState: the snapshot plus its own writes
    start: int
    started: float = field(default_factory=time.monotonic)
    held: set[Token] = field(default_factory=set)
    writes: dict[tuple[str, str], dict[Any, None]] = field(default_factory=dict)
    doomed: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    lsid: Any = None  # the driver's session and transaction number, for its change events
    txn_number: int = 0


class Transactions:
    """The conflict and commit rules, installed on one mongoeco ``MemoryEngine``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.numbers = itertools.count(1)
        self.clock = 0  # moves at every write outside a transaction and every commit
        self.open: dict[str, Txn] = {}  # by mongoeco session id
        self.by_number: dict[int, Txn] = {}
        self.holders: dict[Token, Txn] = {}
        self.changed_at: dict[Token, int] = {}  # kept only while a transaction is open
        self.applying = False  # a commit or a TTL purge: live writes nobody may refuse
        self.where: dict[int, tuple[Any, str, str, Txn | None]] = {}
        self.lifetime = TRANSACTION_LIFETIME  # seconds; setParameter changes it
        # Told the tokens of each commit's change events, and the transaction.
        self.on_commit: Callable[[int, int, Txn], None] = lambda first, last, txn: None
        self._patch()

    # -- the engine's hooks --------------------------------------------------------------

    def _patch(self) -> None:
        engine = self.engine
        originals = {
            name: getattr(engine, name)
            for name in (
                "_start_session_transaction",
                "_commit_session_transaction",
                "_abort_session_transaction",
                "_set_storage_document_locked",
                "_delete_storage_document_locked",
                "_update_indexes_locked",
                "_purge_expired_documents_locked",
            )
        }
        self.original = originals

        def start(session: Any) -> None:
            originals["_start_session_transaction"](session)
            txn = Txn(
                next(self.numbers), session, engine._mvcc_states[session.session_id], self.clock
            )
            self.open[session.session_id] = txn
            self.by_number[txn.number] = txn

        def set_document(collection: Any, storage_key: Any, document: Any) -> None:
            self._touch_document(collection, storage_key)
            originals["_set_storage_document_locked"](collection, storage_key, document)

        def delete_document(collection: Any, storage_key: Any) -> None:
            self._touch_document(collection, storage_key)
            originals["_delete_storage_document_locked"](collection, storage_key)

        def update_indexes(
            db_name: str, coll_name: str, storage_key: Any, document: Any, **options: Any
        ) -> None:
            self._touch_unique_keys(db_name, coll_name, document, options)
            originals["_update_indexes_locked"](
                db_name, coll_name, storage_key, document, **options
            )

        def purge(db_name: str, coll_name: str, **options: Any) -> int:
            storage = options.get("storage_view")
            if storage is not None and storage is not engine._storage:
                return 0  # a server's TTL monitor deletes outside any transaction
            self.applying = True
            try:
                return int(
                    originals["_purge_expired_documents_locked"](db_name, coll_name, **options)
                )
            finally:
                self.applying = False

        engine._start_session_transaction = start
        engine._commit_session_transaction = self._commit
        engine._abort_session_transaction = self._abort
        engine._set_storage_document_locked = set_document
        engine._delete_storage_document_locked = delete_document
        engine._update_indexes_locked = update_indexes
        engine._purge_expired_documents_locked = purge

    def _locate(self, collection: Any) -> tuple[str, str, Txn | None] | None:
        """Which namespace ``collection`` is, and whose: the live data's or a transaction's."""
        hit = self.where.get(id(collection))
        if hit is not None and hit[0] is collection:
            # Still under that name: a rename moves the same object to another one.
            storage = self.engine._storage if hit[3] is None else hit[3].state.storage
            if storage.get(hit[1], {}).get(hit[2]) is collection:
                return hit[1], hit[2], hit[3]
        owners: list[tuple[Any, Txn | None]] = [(self.engine._storage, None)]
        owners += [(txn.state.storage, txn) for txn in self.open.values()]
        for storage, owner in owners:
            for db_name, collections in storage.items():
                for coll_name, candidate in collections.items():
                    if candidate is collection:
                        if len(self.where) > 10_000:
                            self.where.clear()
                        self.where[id(collection)] = (collection, db_name, coll_name, owner)
                        return db_name, coll_name, owner
        return None  # a scratch copy mongoeco builds for itself (a rename, a rebuild)

    def _touch_document(self, collection: Any, storage_key: Any) -> None:
        if not self.open:
            # No transaction to conflict with or to record the write for: _touch would do
            # nothing, so a plain write (the relay's claim, settle and checkpoint) skips it.
            return
        place = self._locate(collection)
        if place is not None:
            db_name, coll_name, owner = place
            self._touch(("doc", db_name, coll_name, storage_key), owner)
            if owner is not None:
                owner.writes.setdefault((db_name, coll_name), {})[storage_key] = None

    def _touch_unique_keys(
        self, db_name: str, coll_name: str, document: Any, options: dict[str, Any]
    ) -> None:
        if not self.open:
            return  # as in _touch_document: nothing to conflict with
        index_data = options.get("index_data_view")
        owner = next(
            (txn for txn in self.open.values() if txn.state.index_data is index_data), None
        )
        indexes = (options.get("indexes_view") or self.engine._indexes).get(db_name, {})
        for index in indexes.get(coll_name, []):
            if not index.unique or index.fields == ["_id"]:
                continue
            if not document_in_virtual_index(document, index):
                continue
            for key in self._unique_keys(document, index):
                self._touch(("key", db_name, coll_name, index.name, key), owner)

    def _unique_keys(self, document: Any, index: Any) -> set[tuple[Any, ...]]:
        """The keys ``document`` takes in a unique index: equal under the index's collation
        where it has one (strength 2 makes "B" and "b" one key), BSON-equal otherwise."""
        collation = normalize_collation(index.collation)
        if collation is None:
            return set(self.engine._unique_index_keys(document, index.fields))
        return {
            tuple(
                ("collated", string_equality_key(value, collation))
                if isinstance(value, str)
                else self.engine._index_equality_key(value)
                for value in values
            )
            for values in self.engine._unique_index_values(document, index.fields)
        }

    def _touch(self, token: Token, owner: Txn | None) -> None:
        if self.applying:
            if self._watched():
                self.changed_at[token] = self.clock + 1
            return
        holder = self.holders.get(token)
        if owner is None:
            if holder is not None:
                raise OperationFailure(
                    f"WriteConflict: a transaction holds this document {WAIT_MARK}{holder.number}]",
                    code=WRITE_CONFLICT,
                )
            if self._watched():
                self.clock += 1
                self.changed_at[token] = self.clock
            return
        if holder is owner:
            return
        if owner.doomed or holder is not None or self.changed_at.get(token, 0) > owner.start:
            self._doom(owner)
            raise OperationFailure(
                "WriteConflict error: this operation conflicted with another operation. "
                f"Please retry your operation or multi-document transaction. {CONFLICT_MARK} "
                f"{owner.number}]",
                code=WRITE_CONFLICT,
                error_labels=(TRANSIENT,),
            )
        self.holders[token] = owner
        owner.held.add(token)

    def _doom(self, txn: Txn) -> None:
        """Free what a conflicted (or expired) transaction holds at once: on MongoDB it is
        aborted. It stays mongoeco's open transaction until its client ends it, so that none
        of its commands can run outside it: its writes conflict, its commit is refused."""
        txn.doomed = True
        self._release(txn)
        self._forget_changes()

    def _watched(self) -> bool:
        """Whether a live transaction's snapshot is older than the live data."""
        return any(not txn.doomed for txn in self.open.values())

    def _forget_changes(self) -> None:
        if not self._watched():
            self.changed_at.clear()  # no live transaction's snapshot is older than the data

    def _release(self, txn: Txn) -> None:
        for token in txn.held:
            if self.holders.get(token) is txn:
                del self.holders[token]
        txn.held.clear()
        txn.ended.set()

    def _end(self, txn: Txn) -> None:
        self._release(txn)
        self.open.pop(txn.session.session_id, None)
        self.by_number.pop(txn.number, None)
        for key in [key for key, hit in self.where.items() if hit[3] is txn]:
            del self.where[key]
        self._forget_changes()

    # -- commit and abort ---------------------------------------------------------------

    def _commit(self, session: Any) -> None:
        engine = self.engine
        txn = self.open.get(session.session_id)
        if txn is None:
            self.original["_commit_session_transaction"](session)
            return
        if txn.doomed:
            self._abort(session)
            raise OperationFailure(
                "Transaction was aborted by a write conflict",
                code=NO_SUCH_TRANSACTION,
                error_labels=(TRANSIENT,),
            )
        state = txn.state
        with engine._meta_lock:
            engine._ensure_publication_boundary()
            if state.has_writes:
                self._apply(txn)
                engine._invalidate_transaction_search_runtime_cache(state)
            engine._mvcc_states.pop(session.session_id, None)
        self._end(txn)
        engine._sync_session_state(
            session, transaction_active=False, snapshot_version=engine._mvcc_version
        )

    def _apply(self, txn: Txn) -> None:
        """Write the transaction's own documents and index entries into the live data, and
        publish its change events, in one publication (one commit for change streams)."""
        engine = self.engine
        state = txn.state
        namespaces = set(state.touched_namespaces) | set(txn.writes)
        first = engine._commit_sequence + 1
        self.applying = True
        try:
            with engine._publication_scope(engine._storage, touched_namespaces=namespaces):
                for db_name, coll_name in sorted(namespaces):
                    self._adopt_namespace(txn, db_name, coll_name)
                for (db_name, coll_name), keys in txn.writes.items():
                    live = engine._storage[db_name][coll_name]
                    mine = state.storage.get(db_name, {}).get(coll_name, {})
                    for key in keys:
                        self._apply_document(db_name, coll_name, live, mine, key)
                engine._publication_stack[-1].changes.extend(state.pending_changes)
        finally:
            self.applying = False
        if engine._commit_sequence >= first:
            self.on_commit(first, engine._commit_sequence, txn)
        self.clock += 1
        for token in txn.held:
            self.changed_at[token] = self.clock

    def _adopt_namespace(self, txn: Txn, db_name: str, coll_name: str) -> None:
        """A collection the transaction created exists live from its commit on."""
        engine = self.engine
        state = txn.state
        created = (
            coll_name in state.storage.get(db_name, {})
            or coll_name in state.collections.get(db_name, set())
            or bool(state.indexes.get(db_name, {}).get(coll_name))
        )  # createIndexes on a new collection registers it and its indexes, stores nothing
        if not created:
            return
        if coll_name in engine._storage.get(db_name, {}):
            return
        engine._storage.setdefault(db_name, {})[coll_name] = MemoryCollection()
        engine._register_collection_locked(
            db_name,
            coll_name,
            collections=engine._collections,
            collection_options=engine._collection_options,
        )
        options = state.collection_options.get(db_name, {}).get(coll_name)
        if options is not None:
            engine._collection_options.setdefault(db_name, {})[coll_name] = options
        indexes = state.indexes.get(db_name, {}).get(coll_name)
        if indexes is not None and not engine._indexes.get(db_name, {}).get(coll_name):
            engine._indexes.setdefault(db_name, {})[coll_name] = list(indexes)

    def _apply_document(self, db_name: str, coll_name: str, live: Any, mine: Any, key: Any) -> None:
        engine = self.engine
        # Not .get(): MemoryCollection keeps its rows outside the dict it subclasses.
        before = live[key] if key in live else None  # noqa: SIM401
        after = mine[key] if key in mine else None  # noqa: SIM401
        if before is None and after is None:
            return
        if before is not None:
            engine._update_indexes_locked(
                db_name, coll_name, key, engine._borrow_storage_document(before), action="delete"
            )
            if after is None:
                engine._delete_storage_document_locked(live, key)
        if after is not None:
            engine._set_storage_document_locked(live, key, after)
            engine._update_indexes_locked(
                db_name, coll_name, key, engine._borrow_storage_document(after), action="insert"
            )

    def _abort(self, session: Any) -> None:
        txn = self.open.get(session.session_id)
        self.original["_abort_session_transaction"](session)
        if txn is not None:
            self._end(txn)

    def expired(self, now: float, lifetimes: float = 1.0) -> list[Txn]:
        limit = self.lifetime * lifetimes
        return [txn for txn in self.open.values() if now - txn.started > limit]


class TransactionsOverWire:
    """Checks transaction numbers before mongoeco sees a command, turns a conflict into the
    reply a server sends, and makes a write outside a transaction wait for the one holding
    its document."""

    def __init__(self, engine: Any, sessions: Any, client: Any) -> None:
        found = version("mongoeco")
        if found != PINNED:
            raise RuntimeError(
                f"mongo_outbox.testing's transactions are written for mongoeco {PINNED}, "
                f"found {found}: pin mongoeco or port mongo_outbox/testing/_transactions.py"
            )
        self.rules = Transactions(engine)
        self.sessions = sessions  # mongoeco's WireSessionStore
        self.client = client  # mongoeco's in-process client: reads of the live data
        self.running: dict[str, int] = {}  # wire session key -> its open transaction's number
        self.committed: dict[str, int] = {}

    def refuse(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The reply to a transaction command that must not reach mongoeco, or None."""
        if "lsid" not in body:
            return None
        key = wire_session_key(body["lsid"])
        if body.get("autocommit") is not False:
            # A command outside a transaction ends the session's open one (a server aborts it
            # for a newer txnNumber); mongoeco would run the command inside it.
            self._abandon(key)
            return None
        number = _number(body)
        name = next(iter(body))
        if body.get("startTransaction"):
            self._abandon(key)  # a new number aborts the session's older transaction
            if name not in ALLOWED_IN_TRANSACTION:
                return _not_in_transaction(name)
            self.running[key] = number
            return None
        # Expired transactions first: one reaped now is refused below, never let through.
        self._reap()
        if self.running.get(key) == number:
            if self._doomed(key):
                # Aborted by the server (it outlived its lifetime): its commands and its commit
                # are refused, as MongoDB's NoSuchTransaction, so the caller retries it whole.
                self._abandon(key)
                return _transient(
                    NO_SUCH_TRANSACTION, f"Transaction with txnNumber {number} has been aborted."
                )
            if name in ALLOWED_IN_TRANSACTION:
                return None
            self._abandon(key)
            return _not_in_transaction(name)
        if name == "commitTransaction" and self.committed.get(key) == number:
            return {"ok": 1.0}  # a retried commit of a committed transaction
        return _transient(
            NO_SUCH_TRANSACTION, f"Transaction with txnNumber {number} has been aborted."
        )

    def _doomed(self, key: str) -> bool:
        context = self.sessions._sessions.get(key)
        txn = None if context is None else self.rules.open.get(context.session.session_id)
        return txn is not None and txn.doomed

    def parameter(self, body: dict[str, Any]) -> dict[str, Any]:
        """A server's answer to ``getParameter`` or ``setParameter``, for the one parameter the
        emulator has: the transaction lifetime."""
        name = next(iter(body))
        asked = [key for key in body if key != name and key not in GENERIC_FIELDS]
        if asked != [LIFETIME_PARAMETER]:
            return {
                "ok": 0.0,
                "code": INVALID_OPTIONS,
                "codeName": "InvalidOptions",
                "errmsg": f"the emulator's only parameter is {LIFETIME_PARAMETER}, not {asked}",
            }
        current = _whole(self.rules.lifetime)
        if name == "getParameter":
            return {LIFETIME_PARAMETER: current, "ok": 1.0}
        value = body[LIFETIME_PARAMETER]
        seconds = getattr(value, "value", value)
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 1:
            return {
                "ok": 0.0,
                "code": BAD_VALUE,
                "codeName": "BadValue",
                "errmsg": f"{LIFETIME_PARAMETER} must be at least 1, got {value!r}",
            }
        self.rules.lifetime = float(seconds)
        self._reap()
        return {"was": current, "ok": 1.0}

    def kill_all_sessions(self) -> dict[str, Any]:
        """``killAllSessions``: every open transaction is aborted, as a server does (drivers'
        test runners send it before each spec test, for what an earlier test left open)."""
        for key in list(self.running):
            self._abandon(key)
        for txn in list(self.rules.open.values()):
            if txn.session.transaction_active:
                txn.session.abort_transaction()
            else:
                self.rules._end(txn)
        return {"ok": 1.0}

    def _abandon(self, key: str) -> None:
        self.running.pop(key, None)
        context = self.sessions._sessions.get(key)
        if context is not None and context.session.active and context.session.transaction_active:
            context.session.abort_transaction()

    async def run(self, body: dict[str, Any], execute: Any) -> dict[str, Any]:
        self._reap()
        in_transaction = body.get("autocommit") is False and "lsid" in body
        if not in_transaction:
            await self._wait_before_writing(body)
        elif next(iter(body), "") == "commitTransaction":
            self._name_transaction(body)
        while True:
            try:
                reply: dict[str, Any] = await execute()
            except OperationFailure as error:  # some commands raise where others reply
                marked = CONFLICT_MARK in str(error) or WAIT_MARK in str(error)
                # In a transaction the reply is read as well: a failed command aborts it (a
                # findAndModify upsert's duplicate key raises, an insert's is a write error).
                if not (marked or in_transaction):
                    raise
                reply = WireCommandExecutor.error_document(error)
            text = _error_text(reply)
            if in_transaction:
                return self._after_transaction_command(body, reply, text)
            if WAIT_MARK not in text:
                return reply
            number = int(text.split(WAIT_MARK, 1)[1].split("]", 1)[0])
            holder = self.rules.by_number.get(number)
            if holder is not None:
                await self._wait_for(holder)

    def _name_transaction(self, body: dict[str, Any]) -> None:
        """Give the transaction its driver's lsid and number: its change events carry them."""
        context = self.sessions._sessions.get(wire_session_key(body["lsid"]))
        txn = None if context is None else self.rules.open.get(context.session.session_id)
        if txn is not None:
            txn.lsid = body["lsid"]
            txn.txn_number = _number(body)

    async def _wait_before_writing(self, body: dict[str, Any]) -> None:
        """Wait until no transaction holds a document a plain update or delete will write.

        mongoeco writes a multi-document statement's documents one by one, and one held by a
        transaction stops it halfway: run again, it counted only what was left (``delete_many``
        2 of 4) and changed the first ones twice. MongoDB waits at the held document and goes
        on; waiting before the first write gives the same outcome and counts."""
        name = next(iter(body), "")
        if name == "createIndexes":
            await self._wait_for_writers(body)
            return
        statements = body.get({"update": "updates", "delete": "deletes"}.get(name, ""))
        if not isinstance(statements, list) or not isinstance(body.get(name), str):
            return
        db_name, coll_name = str(body.get("$db")), body[name]
        while True:
            held = self._held_documents(db_name, coll_name)
            if not held:
                return
            ids = list(held)
            collection = self.client[db_name][coll_name]
            holder = None
            for statement in statements:
                query = {"$and": [statement.get("q") or {}, {"_id": {"$in": ids}}]}
                found = await collection.find_one(query, {"_id": 1})
                if found is not None:
                    holder = held[found["_id"]]
                    break
            if holder is None:
                return
            await self._wait_for(holder)

    async def _wait_for_writers(self, body: dict[str, Any]) -> None:
        """A unique index's build waits for the transactions writing its collection, as on
        MongoDB, whose build takes the collection to itself: built beside one, mongoeco
        checked only the live documents and the commit then added a duplicate."""
        if not any(index.get("unique") for index in body.get("indexes") or []):
            return
        namespace = (str(body.get("$db")), body["createIndexes"])
        while True:
            writer = next(
                (txn for txn in self.rules.open.values()
                 if not txn.doomed and namespace in txn.writes),
                None,
            )  # fmt: skip
            if writer is None:
                return
            await self._wait_for(writer)

    def _held_documents(self, db_name: str, coll_name: str) -> dict[Any, Txn]:
        """The ``_id`` of each live document of a namespace that a transaction holds."""
        live = self.rules.engine._storage.get(db_name, {}).get(coll_name)
        held: dict[Any, Txn] = {}
        if live is None:
            return held
        for token, txn in self.rules.holders.items():
            if token[0] == "doc" and token[1:3] == (db_name, coll_name) and token[3] in live:
                document = self.rules.engine._borrow_storage_document(live[token[3]])
                held[document["_id"]] = txn
        return held

    async def _wait_for(self, holder: Txn) -> None:
        remaining = self.rules.lifetime - (time.monotonic() - holder.started)
        try:
            await asyncio.wait_for(holder.ended.wait(), max(remaining, 0) + 0.05)
        except TimeoutError:
            self._reap()

    def _after_transaction_command(
        self, body: dict[str, Any], reply: dict[str, Any], text: str
    ) -> dict[str, Any]:
        key = wire_session_key(body["lsid"])
        number = _number(body)
        name = next(iter(body))
        conflict = CONFLICT_MARK in text
        if conflict or reply.get("code") == NO_SUCH_TRANSACTION:
            self._abandon(key)
            code = WRITE_CONFLICT if conflict else NO_SUCH_TRANSACTION
            return _transient(code, text.split(CONFLICT_MARK, 1)[0].strip())
        failed = not reply.get("ok") or bool(reply.get("writeErrors"))
        if failed and name not in ("commitTransaction", "abortTransaction"):
            self._abandon(key)  # a server aborts a transaction whose command failed
            return reply
        if name in ("commitTransaction", "abortTransaction") and self.running.get(key) == number:
            if name == "commitTransaction" and reply.get("ok"):
                self.running.pop(key, None)
                self.committed[key] = number
            else:
                self._abandon(key)  # whatever failed, mongoeco must not keep it open
        return reply

    def _reap(self) -> None:
        now = time.monotonic()
        # Past its lifetime a transaction is doomed (a server aborts it): it holds nothing and
        # its writes and commit are refused. It is not taken from mongoeco yet: a command of
        # it already past refuse() would then run outside any transaction.
        for txn in self.rules.expired(now):
            if not txn.doomed:
                self.rules._doom(txn)
        # Twice past it, its client is gone (SIGKILLed mid-transaction): end it in mongoeco.
        for txn in self.rules.expired(now, lifetimes=2.0):
            key = next(
                (
                    key
                    for key, context in self.sessions._sessions.items()
                    if context.session is txn.session
                ),
                None,
            )
            if key is not None:
                self._abandon(key)
            elif txn.session.transaction_active:
                txn.session.abort_transaction()


def _transient(code: int, message: str) -> dict[str, Any]:
    """A server's reply to a command of a transaction that conflicted or is gone: retry it."""
    name = "WriteConflict" if code == WRITE_CONFLICT else "NoSuchTransaction"
    return {
        "ok": 0.0,
        "code": code,
        "codeName": name,
        "errmsg": message,
        "errorLabels": [TRANSIENT],
    }


def _not_in_transaction(name: str) -> dict[str, Any]:
    return {
        "ok": 0.0,
        "code": OPERATION_NOT_SUPPORTED_IN_TRANSACTION,
        "codeName": "OperationNotSupportedInTransaction",
        "errmsg": f"Cannot run '{name}' in a multi-document transaction.",
    }


def _whole(seconds: float) -> int | float:
    return int(seconds) if seconds == int(seconds) else seconds


def _error_text(reply: dict[str, Any]) -> str:
    parts = [str(reply.get("errmsg", ""))] if not reply.get("ok") else []
    parts += [str(error.get("errmsg", "")) for error in reply.get("writeErrors") or []]
    return " ".join(parts)


def _number(body: dict[str, Any]) -> int:
    value = body.get("txnNumber", 0)
    return int(getattr(value, "value", value))  # mongoeco decodes an Int64 to its BsonInt64
