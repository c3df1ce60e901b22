"""Update documents and filters for ``update_with_events``: what is accepted, and how the outbox
adds its own part to the caller's update.

An update is either a document of update operators or an aggregation pipeline of ``$set``
(``$addFields``) and ``$unset`` stages. Every path it writes is checked before anything is
written: none may start at ``_id`` (the filter chose the aggregate by it) or at a field the outbox
owns (``_version``, ``_sequence`` and, in embedded mode, the entries and their bookkeeping
fields), whichever operator names it (``$rename`` both ways, ``$unset``, a pipeline stage, a
dotted or positional path). Pipeline stages that replace the whole document (``$project``,
``$replaceWith``, ``$replaceRoot``) are refused: they would drop the owned fields, and what they
drop cannot be told before the server runs them.

The filter names the aggregate by ``_id`` (a value, or ``{"$eq": value}``); other conditions may
join it as guards. An ``_id`` is unique, so the filter matches one document or none, and the
events can carry their ``aggregate_id`` (and embedded mode reserve their ids) before the write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mongo_outbox.errors import InvalidAggregateError

Update = dict[str, Any] | list[dict[str, Any]]

OPERATORS = frozenset(
    {
        "$set",
        "$unset",
        "$inc",
        "$mul",
        "$min",
        "$max",
        "$rename",
        "$currentDate",
        "$setOnInsert",
        "$push",
        "$addToSet",
        "$pull",
        "$pullAll",
        "$pop",
        "$bit",
    }
)
_SETTING_STAGES = frozenset({"$set", "$addFields"})
_REPLACING_STAGES = frozenset({"$project", "$replaceWith", "$replaceRoot"})
# Values stored as given: checked like a saved document's (no $-keys), unlike $push's modifiers
# or $pull's conditions, whose $-keys are operators.
_STORED_AS_GIVEN = frozenset({"$set", "$setOnInsert"})


def id_of(query: Any, collection: str) -> Any:
    """The ``_id`` the filter selects; InvalidAggregateError if it does not name one."""
    if not isinstance(query, Mapping):
        raise InvalidAggregateError("the filter must be a mapping", collection=collection)
    if "_id" not in query:
        raise InvalidAggregateError(
            "the filter must name the aggregate by _id, e.g. {'_id': order_id, 'status': "
            "'open'}: an _id matches one document at most, and the events need it before the "
            "write",
            collection=collection,
        )
    value = query["_id"]
    if isinstance(value, Mapping) and any(str(k).startswith("$") for k in value):
        if list(value) != ["$eq"]:
            raise InvalidAggregateError(
                f"the filter's _id must be a value or {{'$eq': value}}, not {value!r}: it must "
                "match one document at most",
                collection=collection,
            )
        value = value["$eq"]
    return value


def check_upsert_filter(query: Mapping[Any, Any], owned: Iterable[str], collection: str) -> None:
    """An upsert inserts what its filter's conditions say (``$and`` and ``$or`` clauses too): none
    may name a field the outbox owns, or a new aggregate would start its counters there."""
    for key, value in query.items():
        if key in ("$and", "$or") and isinstance(value, (list, tuple)):
            for clause in value:
                if isinstance(clause, Mapping):
                    check_upsert_filter(clause, owned, collection)
        elif isinstance(key, str) and key.split(".", 1)[0] in owned:
            raise InvalidAggregateError(
                f"the filter of an upsert names {key!r}, a field the outbox owns: a document it "
                "inserts would take its value there; use expected_version",
                collection=collection,
            )


def check_update(update: Any, owned: Iterable[str], collection: str) -> Update:
    """A copy of ``update`` (operators or a pipeline) that writes no owned field and no ``_id``."""
    forbidden = {"_id", *owned}
    if isinstance(update, Mapping):
        return _check_operators(update, forbidden, collection)
    if isinstance(update, (list, tuple)):
        return _check_pipeline(update, forbidden, collection)
    raise InvalidAggregateError(
        f"the update must be a mapping of update operators or a pipeline (a list of stages), "
        f"not {type(update).__name__}",
        collection=collection,
    )


def check_array_filters(
    array_filters: Any, update: Update, collection: str
) -> list[dict[str, Any]]:
    """A copy of ``array_filters``: a list of filter documents, one per ``$[identifier]`` the
    update uses. MongoDB takes them for an update of operators only, not for a pipeline."""
    if isinstance(array_filters, (str, bytes, Mapping)) or not isinstance(
        array_filters, (list, tuple)
    ):
        raise InvalidAggregateError(
            f"array_filters must be a list of filter documents, not {type(array_filters).__name__}",
            collection=collection,
        )
    if not isinstance(update, dict):
        raise InvalidAggregateError(
            "array_filters apply to an update of operators ($set with $[identifier]), "
            "not to a pipeline",
            collection=collection,
        )
    checked: list[dict[str, Any]] = []
    for one in array_filters:
        if not isinstance(one, Mapping) or not one:
            raise InvalidAggregateError(
                f"each of array_filters must be a non-empty filter document, not {one!r}",
                collection=collection,
            )
        checked.append(dict(one))
    return checked


def _check_operators(update: Mapping[Any, Any], forbidden: set[str], name: str) -> dict[str, Any]:
    if not update:
        raise InvalidAggregateError("the update is empty", collection=name)
    checked: dict[str, Any] = {}
    for operator, fields in update.items():
        if not (isinstance(operator, str) and operator.startswith("$")):
            raise InvalidAggregateError(
                f"the update holds the field {operator!r}: an update is made of operators "
                "($set, $inc, ...); to replace the whole document use save_with_events",
                collection=name,
            )
        if operator not in OPERATORS:
            raise InvalidAggregateError(
                f"{operator} is not an update operator this outbox accepts "
                f"({', '.join(sorted(OPERATORS))})",
                collection=name,
            )
        if not isinstance(fields, Mapping):
            raise InvalidAggregateError(
                f"{operator} takes a mapping of field paths, not {fields!r}", collection=name
            )
        for path, value in fields.items():
            _check_path(path, forbidden, operator, name)
            if operator == "$rename":
                _check_path(value, forbidden, operator, name)
            if operator in _STORED_AS_GIVEN:
                _check_keys(value, f"{operator} {path}", name)
        checked[operator] = dict(fields)
    return checked


def _check_pipeline(update: Sequence[Any], forbidden: set[str], name: str) -> list[dict[str, Any]]:
    if not update:
        raise InvalidAggregateError("the update pipeline is empty", collection=name)
    checked: list[dict[str, Any]] = []
    for stage in update:
        if not (isinstance(stage, Mapping) and len(stage) == 1):
            raise InvalidAggregateError(
                f"a pipeline stage is a mapping of one stage operator, not {stage!r}",
                collection=name,
            )
        ((operator, spec),) = stage.items()
        if operator in _REPLACING_STAGES:
            raise InvalidAggregateError(
                f"{operator} replaces the whole document and would drop the fields the outbox "
                "owns: use $set and $unset stages, or save_with_events to replace it",
                collection=name,
            )
        if operator in _SETTING_STAGES and isinstance(spec, Mapping):
            paths: Iterable[Any] = spec
        elif operator == "$unset" and isinstance(spec, (str, list)) and spec:
            paths = [spec] if isinstance(spec, str) else spec
        else:
            raise InvalidAggregateError(
                f"pipeline stage {operator} {spec!r} is not accepted: an update pipeline here "
                "is made of $set ($addFields) stages with a mapping, and $unset stages with a "
                "field path or a list of them",
                collection=name,
            )
        for path in paths:
            _check_path(path, forbidden, operator, name)
        checked.append({operator: spec})
    return checked


def _check_path(path: Any, forbidden: set[str], operator: str, name: str) -> None:
    # MongoDB refuses an empty segment ("a..b", ".a", "a.") in any update.
    if not isinstance(path, str) or "" in path.split("."):
        raise InvalidAggregateError(f"{operator}: {path!r} is not a field path", collection=name)
    top = path.split(".", 1)[0]
    if top in forbidden:
        what = "the aggregate's _id" if top == "_id" else "a field the outbox owns"
        raise InvalidAggregateError(
            f"{operator} writes {path!r}, {what}: the update may not touch "
            f"{', '.join(sorted(forbidden))}",
            collection=name,
        )


def _check_keys(value: Any, path: str, name: str) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str) or key.startswith("$") or "\x00" in key:
                raise InvalidAggregateError(
                    f"{path}: key {key!r} cannot be stored in MongoDB", collection=name
                )
            _check_keys(item, f"{path}.{key}", name)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_keys(item, f"{path}[{index}]", name)


def with_operators(update: dict[str, Any], ours: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``update`` with the outbox's own operators merged in (their paths are disjoint). An
    operator with no field is left out: MongoDB before 5.0 refuses ``{"$set": {}}``."""
    merged = {operator: dict(fields) for operator, fields in update.items() if fields}
    for operator, fields in ours.items():
        if fields:
            merged.setdefault(operator, {}).update(fields)
    return merged


def guarded(query: Mapping[str, Any], conditions: Mapping[str, Any]) -> dict[str, Any]:
    """The caller's filter and the outbox's conditions, both to hold."""
    if not conditions:
        return dict(query)
    if any(key in query for key in conditions):
        # The caller conditions a field we condition too: both must hold, neither replaced.
        return {"_id": query["_id"], "$and": [dict(query), dict(conditions)]}
    return {**query, **conditions}
