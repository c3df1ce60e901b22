"""The runner's matching rules (unified format, "Evaluating Matches"), without a server: a
runner that matched too loosely would pass spec tests it should fail."""

from __future__ import annotations

from typing import Any

import pytest
from bson import Int64

from tests.conformance.unified import Entities, Matcher, Mismatch, load

pytestmark = pytest.mark.conformance


@pytest.fixture
def matcher() -> Matcher:
    entities = Entities("mongodb://unused")
    entities.lsids["session0"] = {"id": "the-lsid"}
    return Matcher(entities)


MATCHES: list[tuple[str, Any]] = [
    ('{"a": 1}', {"a": 1, "extra": True}),  # extra fields in the root document
    ('{"n": {"$numberLong": "1"}}', {"n": 1}),  # numbers compare by value
    ('{"n": 1}', {"n": 1.0}),
    ('{"n": {"$$type": "long"}}', {"n": Int64(1)}),
    ('{"n": {"$$type": ["int", "long"]}}', {"n": 7}),
    ('{"w": {"$$exists": false}}', {"x": 1}),
    ('{"w": {"$$exists": true}}', {"w": None}),
    ('{"r": {"$$unsetOrMatches": {"id": 1}}}', {}),
    ('{"r": {"$$unsetOrMatches": {"id": 1}}}', {"r": {"id": 1}}),
    ('{"lsid": {"$$sessionLsid": "session0"}}', {"lsid": {"id": "the-lsid"}}),
    ('[{"_id": 1}]', [{"_id": 1, "x": 2}]),  # a find's documents are root-level
]

MISMATCHES: list[tuple[str, Any]] = [
    ('{"a": 1}', {"a": 2}),
    ('{"a": 1}', {"b": 1}),
    ('{"d": {"x": 1}}', {"d": {"x": 1, "extra": 2}}),  # no extra fields in nested documents
    ('{"n": {"$$type": "long"}}', {"n": 1}),
    ('{"w": {"$$exists": false}}', {"w": 1}),
    ('{"w": {"$$exists": true}}', {}),
    ('{"r": {"$$unsetOrMatches": {"id": 1}}}', {"r": {"id": 2}}),
    ('{"flag": true}', {"flag": 1}),  # a bool is not a number
    ('{"a": [1, 2]}', {"a": [1, 2, 3]}),
    ('{"lsid": {"$$sessionLsid": "session0"}}', {"lsid": {"id": "another"}}),
]


@pytest.mark.parametrize(("expected", "actual"), MATCHES)
def test_matches(matcher: Matcher, expected: str, actual: Any) -> None:
    matcher.match(load(expected), actual)


@pytest.mark.parametrize(("expected", "actual"), MISMATCHES)
def test_mismatches(matcher: Matcher, expected: str, actual: Any) -> None:
    with pytest.raises(Mismatch):
        matcher.match(load(expected), actual)
