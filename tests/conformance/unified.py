"""A small runner of MongoDB's unified test format, enough for the transactions specs.

The format is mongodb/specifications' ``source/unified-test-format``: a file declares entities
(clients, databases, collections, sessions), initial data and tests; a test runs operations,
checks their results or errors, the commands each client sent (``expectEvents``) and the
collections' final contents (``outcome``). This runner covers what the transactions and
convenient-API files use, through PyPI's synchronous ``pymongo.MongoClient``, against any server.

What it does not do it says: ``Unsupported`` names the operation or feature, and the suite skips
the test with that reason rather than pass it half-checked. ``failPoint`` runs the server's
``configureFailPoint`` through the test's client and turns it off after the test
(``Runner.disable_fail_points``); ``targetedFailPoint`` (a fail point on the mongos a session is
pinned to) is not implemented.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from bson import Decimal128, Int64, ObjectId, Regex, Timestamp, json_util
from bson.binary import Binary
from bson.codec_options import CodecOptions
from pymongo import MongoClient, ReadPreference, ReturnDocument, monitoring
from pymongo.change_stream import ChangeStream
from pymongo.client_session import ClientSession, TransactionOptions
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.errors import BulkWriteError, ConnectionFailure, OperationFailure, PyMongoError
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import make_read_preference, read_pref_mode_from_name
from pymongo.write_concern import WriteConcern

# The highest schemaVersion this runner knows (all it implements of it is checked per use).
SCHEMA_VERSION = (1, 9)
# Commands the driver hides from command monitoring unless a test observes sensitive ones.
SENSITIVE = {
    "authenticate", "saslstart", "saslcontinue", "getnonce", "createuser", "updateuser",
    "copydbgetnonce", "copydbsaslstart", "copydb", "hello", "ismaster",
}  # fmt: skip


class Unsupported(Exception):
    """A feature this runner (or the server under test) does not provide: the test is skipped."""


class Mismatch(AssertionError):
    """An actual value that does not match the expected one, with the path to it."""


def load(text: str) -> Any:
    """Extended JSON as the format means it: ``$numberLong`` is an Int64, and so on."""
    return json_util.loads(text, json_options=json_util.CANONICAL_JSON_OPTIONS)


# -- matching (unified format, "Evaluating Matches") -------------------------------------------

TYPES: dict[str, Callable[[Any], bool]] = {
    "double": lambda v: isinstance(v, float),
    "string": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "binData": lambda v: isinstance(v, bytes | Binary),
    "objectId": lambda v: isinstance(v, ObjectId),
    "bool": lambda v: isinstance(v, bool),
    "date": lambda v: isinstance(v, datetime),
    "null": lambda v: v is None,
    "regex": lambda v: isinstance(v, Regex | re.Pattern),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool | Int64),
    "timestamp": lambda v: isinstance(v, Timestamp),
    "long": lambda v: isinstance(v, Int64),
    "decimal": lambda v: isinstance(v, Decimal128),
}
TYPES["number"] = lambda v: any(TYPES[t](v) for t in ("int", "long", "double", "decimal"))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _operator(expected: Any) -> str | None:
    if isinstance(expected, dict) and len(expected) == 1:
        key = next(iter(expected))
        if key.startswith("$$"):
            return key
    return None


class Matcher:
    """Matches actual values against expected ones; entities resolve ``$$sessionLsid`` etc."""

    def __init__(self, entities: Entities) -> None:
        self.entities = entities

    def match(self, expected: Any, actual: Any, path: str = "", *, root: bool = True) -> None:
        operator = _operator(expected)
        if operator is not None:
            self._special(operator, expected[operator], actual, path)
            return
        if isinstance(expected, dict):
            if not isinstance(actual, dict):
                raise Mismatch(f"{path or '<root>'}: expected a document, got {actual!r}")
            for key, value in expected.items():
                inner = f"{path}.{key}" if path else key
                if _operator(value) == "$$exists":
                    if value["$$exists"] != (key in actual):
                        raise Mismatch(f"{inner}: expected $$exists {value['$$exists']}")
                    continue
                if key not in actual:
                    if _operator(value) == "$$unsetOrMatches":
                        continue
                    raise Mismatch(f"{inner}: missing (expected {value!r})")
                self.match(value, actual[key], inner, root=False)
            if not root:
                extra = set(actual) - set(expected)
                if extra:
                    raise Mismatch(f"{path}: unexpected fields {sorted(extra)} in {actual!r}")
            return
        if isinstance(expected, list):
            if not isinstance(actual, list) or len(actual) != len(expected):
                raise Mismatch(f"{path or '<root>'}: expected {expected!r}, got {actual!r}")
            # The documents of a root-level array (find's, aggregate's) are root-level too.
            for index, (value, got) in enumerate(zip(expected, actual, strict=True)):
                self.match(value, got, f"{path}[{index}]", root=root)
            return
        if _is_number(expected) and _is_number(actual):
            if expected != actual:
                raise Mismatch(f"{path or '<root>'}: expected {expected!r}, got {actual!r}")
            return
        if type(expected) is not type(actual) and not (
            isinstance(expected, str) and isinstance(actual, str)
        ):
            raise Mismatch(f"{path or '<root>'}: expected {expected!r}, got {actual!r}")
        if expected != actual:
            raise Mismatch(f"{path or '<root>'}: expected {expected!r}, got {actual!r}")

    def _special(self, operator: str, argument: Any, actual: Any, path: str) -> None:
        where = path or "<root>"
        if operator == "$$unsetOrMatches":
            self.match(argument, actual, path, root=True)
        elif operator == "$$exists":
            if not argument:
                raise Mismatch(f"{where}: expected to be absent, got {actual!r}")
        elif operator == "$$type":
            names = argument if isinstance(argument, list) else [argument]
            if not any(TYPES[name](actual) for name in names):
                raise Mismatch(f"{where}: expected $$type {names}, got {actual!r}")
        elif operator == "$$sessionLsid":
            self.match(self.entities.lsid(argument), actual, path, root=False)
        elif operator == "$$matchesEntity":
            self.match(self.entities.get(argument), actual, path, root=False)
        elif operator == "$$lte":
            if not (_is_number(actual) and actual <= argument):
                raise Mismatch(f"{where}: expected <= {argument!r}, got {actual!r}")
        elif operator == "$$matchAsRoot":
            self.match(argument, actual, path, root=True)
        else:
            raise Unsupported(f"match operator {operator}")


# -- entities -------------------------------------------------------------------------------


class CommandLog(monitoring.CommandListener):
    """The command-started events of one client entity, as the format observes them."""

    def __init__(self, observe: list[str], ignore: list[str], sensitive: bool) -> None:
        self.observe = set(observe)
        self.ignore = {name.lower() for name in ignore}
        self.sensitive = sensitive
        self.events: list[tuple[str, Any]] = []

    def _keep(self, name: str) -> bool:
        lowered = name.lower()
        if lowered in self.ignore or lowered == "configurefailpoint":
            return False
        return self.sensitive or lowered not in SENSITIVE

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if "commandStartedEvent" in self.observe and self._keep(event.command_name):
            self.events.append(("commandStartedEvent", event))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if "commandSucceededEvent" in self.observe and self._keep(event.command_name):
            self.events.append(("commandSucceededEvent", event))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        if "commandFailedEvent" in self.observe and self._keep(event.command_name):
            self.events.append(("commandFailedEvent", event))


@dataclass
class Entities:
    """The entity map of one test: clients, databases, collections, sessions and results."""

    uri: str
    objects: dict[str, Any] = field(default_factory=dict)
    logs: dict[str, CommandLog] = field(default_factory=dict)
    lsids: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str) -> Any:
        if name not in self.objects:
            raise KeyError(f"no entity {name!r}")
        return self.objects[name]

    def lsid(self, name: str) -> Any:
        return self.lsids[name]

    def create(self, specs: list[dict[str, Any]]) -> None:
        for spec in specs:
            ((kind, options),) = spec.items()
            name = options["id"]
            if name in self.objects:
                raise ValueError(f"entity {name!r} defined twice")
            create = getattr(self, f"_create_{kind}", None)
            if create is None:
                raise Unsupported(f"entity type {kind}")
            self.objects[name] = create(options)

    def _create_client(self, options: dict[str, Any]) -> MongoClient[Any]:
        unknown = set(options) - {
            "id", "uriOptions", "useMultipleMongoses", "observeEvents",
            "ignoreCommandMonitoringEvents", "observeSensitiveCommands",
        }  # fmt: skip
        if unknown:
            raise Unsupported(f"client options {sorted(unknown)}")
        log = CommandLog(
            options.get("observeEvents", []),
            options.get("ignoreCommandMonitoringEvents", []),
            options.get("observeSensitiveCommands", False),
        )
        self.logs[options["id"]] = log
        uri_options = dict(options.get("uriOptions", {}))
        if "appname" in uri_options:
            uri_options["appName"] = uri_options.pop("appname")
        return MongoClient(self.uri, event_listeners=[log], **uri_options)

    def _create_database(self, options: dict[str, Any]) -> Any:
        client = self.get(options["client"])
        return client.get_database(
            options["databaseName"], **_collection_options(options.get("databaseOptions", {}))
        )

    def _create_collection(self, options: dict[str, Any]) -> Any:
        database = self.get(options["database"])
        return database.get_collection(
            options["collectionName"],
            **_collection_options(options.get("collectionOptions", {})),
        )

    def _create_session(self, options: dict[str, Any]) -> ClientSession:
        client = self.get(options["client"])
        session_options = dict(options.get("sessionOptions", {}))
        kwargs: dict[str, Any] = {}
        if "causalConsistency" in session_options:
            kwargs["causal_consistency"] = session_options.pop("causalConsistency")
        if "defaultTransactionOptions" in session_options:
            kwargs["default_transaction_options"] = TransactionOptions(
                **_transaction_options(session_options.pop("defaultTransactionOptions"))
            )
        if session_options:
            raise Unsupported(f"session options {sorted(session_options)}")
        session: ClientSession = client.start_session(**kwargs)
        self.lsids[options["id"]] = session.session_id
        return session

    def close(self) -> None:
        """End every session, then close every client (an open transaction is aborted)."""
        for value in self.objects.values():
            if isinstance(value, ClientSession):
                value.end_session()
        for value in self.objects.values():
            if isinstance(value, MongoClient):
                value.close()
        self.objects.clear()


def _read_preference(spec: dict[str, Any]) -> Any:
    spec = dict(spec)
    mode = read_pref_mode_from_name(spec.pop("mode"))
    tags = spec.pop("tagSets", None)
    staleness = spec.pop("maxStalenessSeconds", -1)
    return make_read_preference(mode, tag_sets=tags, max_staleness=staleness)


def _write_concern(spec: dict[str, Any]) -> WriteConcern:
    spec = dict(spec)
    if "wtimeoutMS" in spec:
        spec["wtimeout"] = spec.pop("wtimeoutMS")
    if "journal" in spec:
        spec["j"] = spec.pop("journal")
    return WriteConcern(**spec)


def _collection_options(spec: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key, value in spec.items():
        if key == "readConcern":
            options["read_concern"] = ReadConcern(**value)
        elif key == "writeConcern":
            options["write_concern"] = _write_concern(value)
        elif key == "readPreference":
            options["read_preference"] = _read_preference(value)
        else:
            raise Unsupported(f"database/collection option {key}")
    return options


def _transaction_options(spec: dict[str, Any]) -> dict[str, Any]:
    options = _collection_options({k: v for k, v in spec.items() if k != "maxCommitTimeMS"})
    if "maxCommitTimeMS" in spec:
        options["max_commit_time_ms"] = spec["maxCommitTimeMS"]
    return options


# PyMongo's _TxnState numbers, as the format names them (an empty commit is a commit).
TXN_STATES = {
    1: "none", 2: "starting", 3: "in_progress", 4: "committed", 5: "committed", 6: "aborted"
}  # fmt: skip

# -- operations -------------------------------------------------------------------------------

# The format's argument names, as PyMongo spells them.
ARGUMENTS = {
    "arrayFilters": "array_filters",
    "bypassDocumentValidation": "bypass_document_validation",
    "fieldName": "key",
    "batchSize": "batch_size",
    "maxTimeMS": "max_time_ms",
    "returnDocument": "return_document",
    "upsert": "upsert",
    "sort": "sort",
    "projection": "projection",
    "hint": "hint",
    "collation": "collation",
    "let": "let",
    "comment": "comment",
    "limit": "limit",
    "skip": "skip",
    "ordered": "ordered",
    "filter": "filter",
    "update": "update",
    "replacement": "replacement",
    "document": "document",
    "documents": "documents",
    "pipeline": "pipeline",
    "requests": "requests",
    "session": "session",
}


# createChangeStream's arguments, as watch() names them.
WATCH_ARGUMENTS = {
    "pipeline": "pipeline",
    "batchSize": "batch_size",
    "fullDocument": "full_document",
    "fullDocumentBeforeChange": "full_document_before_change",
    "resumeAfter": "resume_after",
    "startAfter": "start_after",
    "startAtOperationTime": "start_at_operation_time",
    "showExpandedEvents": "show_expanded_events",
    "comment": "comment",
    "maxAwaitTimeMS": "max_await_time_ms",
    "session": "session",
}
ITERATION_LIMIT = 10.0  # seconds iterateUntilDocumentOrError waits for a change


@dataclass
class Outcome:
    """What one operation returned or raised."""

    result: Any = None
    error: BaseException | None = None


class Runner:
    """Runs one test of a spec file: its operations, events and outcome."""

    def __init__(self, entities: Entities, internal: MongoClient[Any]) -> None:
        self.entities = entities
        self.internal = internal  # an unobserved client, for initialData, outcome and asserts
        self.matcher = Matcher(entities)
        self.fail_points: list[str] = []  # the fail points a test set, to turn off after it

    # -- data

    def initial_data(self, data: list[dict[str, Any]]) -> None:
        majority = WriteConcern(w="majority")
        for entry in data:
            database = self.internal.get_database(entry["databaseName"], write_concern=majority)
            name = entry["collectionName"]
            database.drop_collection(name)
            options = entry.get("createOptions", {})
            if entry["documents"] or options:
                database.create_collection(name, **options)
            if entry["documents"]:
                database[name].insert_many(entry["documents"])
            elif not options:
                database.create_collection(name)

    def outcome(self, expected: list[dict[str, Any]]) -> None:
        for entry in expected:
            collection = self.internal.get_database(
                entry["databaseName"],
                read_preference=ReadPreference.PRIMARY,
                read_concern=ReadConcern("local"),
                codec_options=CodecOptions(document_class=dict),
            )[entry["collectionName"]]
            actual = list(collection.find(sort=[("_id", 1)]))
            where = f"outcome {entry['databaseName']}.{entry['collectionName']}"
            if len(actual) != len(entry["documents"]):
                raise Mismatch(f"{where}: expected {entry['documents']!r}, got {actual!r}")
            for want, got in zip(entry["documents"], actual, strict=True):
                self.matcher.match(want, got, where, root=False)

    # -- operations

    def run(self, operations: list[dict[str, Any]]) -> None:
        for operation in operations:
            self.step(operation)

    def step(self, operation: dict[str, Any]) -> None:
        name = operation["name"]
        outcome = self.execute(operation)
        if "expectError" in operation:
            if outcome.error is None:
                raise Mismatch(f"{name}: expected an error, got result {outcome.result!r}")
            self.check_error(name, operation["expectError"], outcome.error)
            return
        if outcome.error is not None:
            if operation.get("ignoreResultAndError"):
                return
            raise Mismatch(f"{name}: unexpected error {outcome.error!r}") from outcome.error
        if "expectResult" in operation:
            self.matcher.match(operation["expectResult"], outcome.result, name)
        if "saveResultAsEntity" in operation:
            self.entities.objects[operation["saveResultAsEntity"]] = outcome.result

    def execute(self, operation: dict[str, Any]) -> Outcome:
        target_name = operation["object"]
        name = operation["name"]
        arguments = dict(operation.get("arguments", {}))
        if target_name == "testRunner":
            method = getattr(self, f"_runner_{name}", None)
            if method is None:
                raise Unsupported(f"test runner operation {name}")
            method(arguments)
            return Outcome()
        target = self.entities.get(target_name)
        # Not hasattr(): a Database answers any attribute with a Collection of that name.
        kind = (
            "changeStream" if isinstance(target, ChangeStream)
            else "session" if isinstance(target, ClientSession)
            else "client" if isinstance(target, MongoClient)
            else "collection" if isinstance(target, Collection)
            else "database" if isinstance(target, Database)
            else type(target).__name__
        )  # fmt: skip
        method = getattr(self, f"_{kind}_{name}", None)
        if method is None:
            raise Unsupported(f"{kind} operation {name}")
        if "session" in arguments:
            arguments["session"] = self.entities.get(arguments["session"])
        try:
            return Outcome(result=method(target, arguments))
        except (PyMongoError, ValueError, TypeError) as error:
            return Outcome(error=error)

    def check_error(self, name: str, expected: dict[str, Any], error: BaseException) -> None:
        where = f"{name} error {error!r}"
        server = isinstance(error, OperationFailure)
        client_side = not server and not isinstance(error, ConnectionFailure)
        details: dict[str, Any] = getattr(error, "details", None) or {}
        if isinstance(error, BulkWriteError):
            first = (details.get("writeErrors") or [{}])[0]
            details = {**details, **first}
        for key, want in expected.items():
            if key == "isError":
                continue
            if key == "isClientError":
                if want != client_side:
                    raise Mismatch(f"{where}: isClientError should be {want}")
            elif key == "errorContains":
                if want.lower() not in str(error).lower():
                    raise Mismatch(f"{where}: does not contain {want!r}")
            elif key == "errorCode":
                if not server or details.get("code", getattr(error, "code", None)) != want:
                    raise Mismatch(f"{where}: expected code {want}")
            elif key == "errorCodeName":
                if details.get("codeName") != want:
                    raise Mismatch(f"{where}: expected codeName {want}, details {details}")
            elif key == "errorLabelsContain":
                for label in want:
                    if not (isinstance(error, PyMongoError) and error.has_error_label(label)):
                        raise Mismatch(f"{where}: lacks label {label}")
            elif key == "errorLabelsOmit":
                for label in want:
                    if isinstance(error, PyMongoError) and error.has_error_label(label):
                        raise Mismatch(f"{where}: has label {label}")
            elif key == "expectResult":
                raise Unsupported("expectError.expectResult")
            else:
                raise Unsupported(f"expectError.{key}")

    # -- arguments

    def _kwargs(self, arguments: dict[str, Any], *allowed: str) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        for key, value in arguments.items():
            if key not in allowed or key not in ARGUMENTS:
                raise Unsupported(f"argument {key}")
            kwargs[ARGUMENTS[key]] = value
        if "return_document" in kwargs:
            after = kwargs["return_document"] == "After"
            kwargs["return_document"] = ReturnDocument.AFTER if after else ReturnDocument.BEFORE
        if "sort" in kwargs and isinstance(kwargs["sort"], dict):
            kwargs["sort"] = list(kwargs["sort"].items())
        return kwargs

    # -- collection operations

    def _collection_insertOne(self, collection: Any, arguments: dict[str, Any]) -> Any:
        done = collection.insert_one(**self._kwargs(arguments, "document", "session", "comment"))
        return {"insertedId": done.inserted_id}

    def _collection_insertMany(self, collection: Any, arguments: dict[str, Any]) -> Any:
        kwargs = self._kwargs(arguments, "documents", "session", "ordered", "comment")
        done = collection.insert_many(**kwargs)
        return {"insertedIds": {str(i): value for i, value in enumerate(done.inserted_ids)}}

    def _update_result(self, done: Any) -> dict[str, Any]:
        result = {
            "matchedCount": done.matched_count,
            "modifiedCount": done.modified_count,
            "upsertedCount": 0 if done.upserted_id is None else 1,
        }
        if done.upserted_id is not None:
            result["upsertedId"] = done.upserted_id
        return result

    def _collection_updateOne(self, collection: Any, arguments: dict[str, Any]) -> Any:
        kwargs = self._kwargs(
            arguments, "filter", "update", "session", "upsert", "arrayFilters", "hint", "sort"
        )
        return self._update_result(collection.update_one(**kwargs))

    def _collection_updateMany(self, collection: Any, arguments: dict[str, Any]) -> Any:
        kwargs = self._kwargs(arguments, "filter", "update", "session", "upsert", "arrayFilters")
        return self._update_result(collection.update_many(**kwargs))

    def _collection_replaceOne(self, collection: Any, arguments: dict[str, Any]) -> Any:
        kwargs = self._kwargs(arguments, "filter", "replacement", "session", "upsert")
        return self._update_result(collection.replace_one(**kwargs))

    def _collection_deleteOne(self, collection: Any, arguments: dict[str, Any]) -> Any:
        done = collection.delete_one(**self._kwargs(arguments, "filter", "session"))
        return {"deletedCount": done.deleted_count}

    def _collection_deleteMany(self, collection: Any, arguments: dict[str, Any]) -> Any:
        done = collection.delete_many(**self._kwargs(arguments, "filter", "session"))
        return {"deletedCount": done.deleted_count}

    def _collection_find(self, collection: Any, arguments: dict[str, Any]) -> Any:
        kwargs = self._kwargs(
            arguments, "filter", "session", "sort", "batchSize", "limit", "skip", "projection"
        )
        return list(collection.find(**kwargs))

    def _collection_findOneAndUpdate(self, collection: Any, arguments: dict[str, Any]) -> Any:
        kwargs = self._kwargs(
            arguments, "filter", "update", "session", "upsert", "returnDocument", "sort",
            "projection", "arrayFilters",
        )  # fmt: skip
        return collection.find_one_and_update(**kwargs)

    def _collection_findOneAndReplace(self, collection: Any, arguments: dict[str, Any]) -> Any:
        kwargs = self._kwargs(
            arguments, "filter", "replacement", "session", "upsert", "returnDocument", "sort",
            "projection",
        )  # fmt: skip
        return collection.find_one_and_replace(**kwargs)

    def _collection_findOneAndDelete(self, collection: Any, arguments: dict[str, Any]) -> Any:
        kwargs = self._kwargs(arguments, "filter", "session", "sort", "projection")
        return collection.find_one_and_delete(**kwargs)

    def _collection_countDocuments(self, collection: Any, arguments: dict[str, Any]) -> Any:
        kwargs = self._kwargs(arguments, "filter", "session", "limit", "skip")
        return collection.count_documents(**kwargs)

    def _collection_distinct(self, collection: Any, arguments: dict[str, Any]) -> Any:
        kwargs = self._kwargs(arguments, "fieldName", "filter", "session")
        return collection.distinct(**kwargs)

    def _collection_aggregate(self, collection: Any, arguments: dict[str, Any]) -> Any:
        kwargs = self._kwargs(arguments, "pipeline", "session", "batchSize")
        if "batch_size" in kwargs:  # aggregate() passes its keywords on as the command's
            kwargs["batchSize"] = kwargs.pop("batch_size")
        return list(collection.aggregate(**kwargs))

    def _collection_bulkWrite(self, collection: Any, arguments: dict[str, Any]) -> Any:
        from pymongo import (
            DeleteMany,
            DeleteOne,
            InsertOne,
            ReplaceOne,
            UpdateMany,
            UpdateOne,
        )

        models = {
            "insertOne": (InsertOne, {"document": "document"}),
            "updateOne": (UpdateOne, {"filter": "filter", "update": "update", "upsert": "upsert"}),
            "updateMany": (
                UpdateMany,
                {"filter": "filter", "update": "update", "upsert": "upsert"},
            ),
            "replaceOne": (
                ReplaceOne,
                {"filter": "filter", "replacement": "replacement", "upsert": "upsert"},
            ),
            "deleteOne": (DeleteOne, {"filter": "filter"}),
            "deleteMany": (DeleteMany, {"filter": "filter"}),
        }
        requests = []
        for request in arguments.pop("requests"):
            ((kind, fields),) = request.items()
            model, names = models[kind]
            if set(fields) - set(names):
                raise Unsupported(f"bulkWrite {kind} fields {sorted(set(fields) - set(names))}")
            requests.append(model(**{names[key]: value for key, value in fields.items()}))
        kwargs = self._kwargs(arguments, "session", "ordered")
        done = collection.bulk_write(requests, **kwargs)
        return {
            "deletedCount": done.deleted_count,
            "insertedCount": done.inserted_count,
            "matchedCount": done.matched_count,
            "modifiedCount": done.modified_count,
            "upsertedCount": done.upserted_count,
            "upsertedIds": {str(k): v for k, v in done.upserted_ids.items()},
        }

    def _database_runCommand(self, database: Any, arguments: dict[str, Any]) -> Any:
        session = arguments.pop("session", None)
        command = arguments.pop("command")
        arguments.pop("commandName", None)
        kwargs: dict[str, Any] = {}
        if "readPreference" in arguments:
            kwargs["read_preference"] = _read_preference(arguments.pop("readPreference"))
        if arguments:
            raise Unsupported(f"runCommand arguments {sorted(arguments)}")
        return database.command(command, session=session, **kwargs)

    def _collection_count(self, collection: Any, arguments: dict[str, Any]) -> Any:
        # Collection.count() left PyMongo 4; the command is what the spec test is about.
        session = arguments.pop("session", None)
        command = {"count": collection.name, "query": arguments.pop("filter", {})}
        if arguments:
            raise Unsupported(f"count arguments {sorted(arguments)}")
        return collection.database.command(command, session=session)["n"]

    def _database_createCollection(self, database: Any, arguments: dict[str, Any]) -> Any:
        session = arguments.pop("session", None)
        name = arguments.pop("collection")
        database.create_collection(name, session=session, **arguments)

    def _database_dropCollection(self, database: Any, arguments: dict[str, Any]) -> Any:
        session = arguments.pop("session", None)
        database.drop_collection(arguments.pop("collection"), session=session, **arguments)

    def _collection_createIndex(self, collection: Any, arguments: dict[str, Any]) -> Any:
        session = arguments.pop("session", None)
        keys = list(arguments.pop("keys").items())
        return collection.create_index(keys, session=session, **arguments)

    def _collection_dropIndex(self, collection: Any, arguments: dict[str, Any]) -> Any:
        session = arguments.pop("session", None)
        collection.drop_index(arguments.pop("name"), session=session, **arguments)

    def _collection_rename(self, collection: Any, arguments: dict[str, Any]) -> Any:
        session = arguments.pop("session", None)
        to = arguments.pop("to")
        drop_target = arguments.pop("dropTarget", False)
        if arguments:
            raise Unsupported(f"rename arguments {sorted(arguments)}")
        collection.rename(to, dropTarget=drop_target, session=session)

    # -- change streams

    def _watch(self, target: Any, arguments: dict[str, Any]) -> Any:
        kwargs: dict[str, Any] = {}
        for key, value in arguments.items():
            if key not in WATCH_ARGUMENTS:
                raise Unsupported(f"createChangeStream argument {key}")
            kwargs[WATCH_ARGUMENTS[key]] = value
        return target.watch(**kwargs)

    _client_createChangeStream = _watch
    _database_createChangeStream = _watch
    _collection_createChangeStream = _watch

    def _changeStream_iterateUntilDocumentOrError(
        self, stream: ChangeStream[Any], arguments: dict[str, Any]
    ) -> Any:
        # As next() does, one getMore after another; but bounded, so a stream that never
        # sends what the test waits for fails the test instead of hanging the run.
        deadline = time.monotonic() + ITERATION_LIMIT
        while time.monotonic() < deadline:
            change = stream.try_next()
            if change is not None:
                return change
            if not stream.alive:
                raise Mismatch("the change stream ended without a document or an error")
        raise Mismatch(f"no change event within {ITERATION_LIMIT} s")

    def _changeStream_iterateOnce(
        self, stream: ChangeStream[Any], arguments: dict[str, Any]
    ) -> Any:
        return stream.try_next()

    def _changeStream_close(self, stream: ChangeStream[Any], arguments: dict[str, Any]) -> Any:
        stream.close()

    # -- session operations

    def _session_startTransaction(self, session: ClientSession, arguments: dict[str, Any]) -> Any:
        session.start_transaction(**_transaction_options(arguments))

    def _session_commitTransaction(self, session: ClientSession, arguments: dict[str, Any]) -> Any:
        if arguments:
            raise Unsupported(f"commitTransaction arguments {sorted(arguments)}")
        session.commit_transaction()

    def _session_abortTransaction(self, session: ClientSession, arguments: dict[str, Any]) -> Any:
        session.abort_transaction()

    def _session_endSession(self, session: ClientSession, arguments: dict[str, Any]) -> Any:
        session.end_session()

    def _session_withTransaction(self, session: ClientSession, arguments: dict[str, Any]) -> Any:
        callback_operations = arguments.pop("callback")

        def callback(_: ClientSession) -> None:
            # An operation's error propagates to with_transaction, which decides on retries;
            # expectError inside the callback checks it first, as the format says.
            for operation in callback_operations:
                outcome = self.execute(operation)
                if outcome.error is not None:
                    if "expectError" in operation:
                        self.check_error(operation["name"], operation["expectError"], outcome.error)
                    raise outcome.error
                if "expectError" in operation:
                    raise Mismatch(f"{operation['name']}: expected an error")
                if "expectResult" in operation:
                    self.matcher.match(operation["expectResult"], outcome.result, operation["name"])

        return session.with_transaction(callback, **_transaction_options(arguments))

    # -- test runner operations

    def _runner_failPoint(self, arguments: dict[str, Any]) -> None:
        command = arguments["failPoint"]
        self.entities.get(arguments["client"]).admin.command(command)
        # Only once set: turning off a fail point the server refused raises again, in the
        # test's cleanup, before its clients are closed (they were left to the collector).
        self.fail_points.append(command["configureFailPoint"])

    def disable_fail_points(self) -> None:
        """Turn off every fail point the test set: they are server-wide and outlive it."""
        for name in self.fail_points:
            self.internal.admin.command({"configureFailPoint": name, "mode": "off"})
        self.fail_points.clear()

    def _runner_targetedFailPoint(self, arguments: dict[str, Any]) -> None:
        raise Unsupported("targetedFailPoint (configureFailPoint on a pinned mongos)")

    def _runner_createEntities(self, arguments: dict[str, Any]) -> None:
        self.entities.create(arguments["entities"])

    def _runner_assertSessionTransactionState(self, arguments: dict[str, Any]) -> None:
        session = self.entities.get(arguments["session"])
        state = TXN_STATES[session._transaction.state]
        if state != arguments["state"]:
            raise Mismatch(f"session transaction state {state}, expected {arguments['state']}")

    def _runner_assertSessionPinned(self, arguments: dict[str, Any]) -> None:
        if self.entities.get(arguments["session"])._pinned_address is None:
            raise Mismatch("session is not pinned")

    def _runner_assertSessionUnpinned(self, arguments: dict[str, Any]) -> None:
        if self.entities.get(arguments["session"])._pinned_address is not None:
            raise Mismatch("session is pinned")

    def _collection_names(self, arguments: dict[str, Any]) -> list[str]:
        names: list[str] = self.internal[arguments["databaseName"]].list_collection_names()
        return names

    def _runner_assertCollectionExists(self, arguments: dict[str, Any]) -> None:
        if arguments["collectionName"] not in self._collection_names(arguments):
            raise Mismatch(f"collection {arguments['collectionName']} does not exist")

    def _runner_assertCollectionNotExists(self, arguments: dict[str, Any]) -> None:
        if arguments["collectionName"] in self._collection_names(arguments):
            raise Mismatch(f"collection {arguments['collectionName']} exists")

    def _index_names(self, arguments: dict[str, Any]) -> list[str]:
        collection = self.internal[arguments["databaseName"]][arguments["collectionName"]]
        return [index["name"] for index in collection.list_indexes()]

    def _runner_assertIndexExists(self, arguments: dict[str, Any]) -> None:
        if arguments["indexName"] not in self._index_names(arguments):
            raise Mismatch(f"index {arguments['indexName']} does not exist")

    def _runner_assertIndexNotExists(self, arguments: dict[str, Any]) -> None:
        if arguments["indexName"] in self._index_names(arguments):
            raise Mismatch(f"index {arguments['indexName']} exists")

    # -- events

    def expect_events(self, expectations: list[dict[str, Any]]) -> None:
        for expectation in expectations:
            kind = expectation.get("eventType", "command")
            if kind != "command":
                raise Unsupported(f"expectEvents eventType {kind}")
            log = self.entities.logs[expectation["client"]]
            actual = list(log.events)
            expected = expectation["events"]
            if expectation.get("ignoreExtraEvents"):
                actual = actual[: len(expected)]
            names = [event.command_name for _, event in actual]
            if len(actual) != len(expected):
                raise Mismatch(
                    f"client {expectation['client']}: expected {len(expected)} events, "
                    f"got {len(actual)}: {names}"
                )
            for index, (want, (kind_seen, event)) in enumerate(zip(expected, actual, strict=True)):
                ((want_kind, fields),) = want.items()
                where = f"event {index} ({event.command_name})"
                if want_kind != kind_seen:
                    raise Mismatch(f"{where}: expected {want_kind}, got {kind_seen}")
                self._match_event(fields, event, where)

    def _match_event(self, fields: dict[str, Any], event: Any, where: str) -> None:
        for key, value in fields.items():
            if key == "command":
                self.matcher.match(value, _plain(event.command), f"{where}.command")
            elif key == "reply":
                self.matcher.match(value, _plain(event.reply), f"{where}.reply")
            elif key == "commandName":
                if event.command_name != value:
                    raise Mismatch(f"{where}: commandName {event.command_name}, expected {value}")
            elif key == "databaseName":
                if event.database_name != value:
                    raise Mismatch(f"{where}: databaseName {event.database_name}, expected {value}")
            elif key == "hasServiceId":
                if (event.service_id is not None) != value:
                    raise Mismatch(f"{where}: hasServiceId should be {value}")
            elif key == "hasServerConnectionId":
                if (event.server_connection_id is not None) != value:
                    raise Mismatch(f"{where}: hasServerConnectionId should be {value}")
            else:
                raise Unsupported(f"event field {key}")


def _plain(document: Any) -> Any:
    """A command as plain dicts and lists (PyMongo may hand over SON or RawBSONDocument)."""
    if isinstance(document, dict):
        return {key: _plain(value) for key, value in document.items()}
    if hasattr(document, "items") and not isinstance(document, str | bytes):
        return {key: _plain(value) for key, value in document.items()}
    if isinstance(document, list | tuple):
        return [_plain(value) for value in document]
    return document


def operations_of(test: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every operation of a test, those inside withTransaction callbacks included."""

    def walk(operations: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for operation in operations:
            yield operation
            walk_inside = operation.get("arguments", {}).get("callback")
            if isinstance(walk_inside, list):
                yield from walk(walk_inside)

    return walk(test.get("operations", []))
