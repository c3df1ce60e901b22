"""MongoDB's own specification tests for change streams, run against the suite's MongoDB.

The relay reads PyMongo's ``watch()``; the drivers' change-streams specification tests
(mongodb/specifications ``change-streams``, unified format) say what a server sends a watching
driver: its events, resume tokens, errors and how the driver resumes after them. They run
here as the transactions ones do (``test_transaction_specs.py``): each test not run is skipped
with its reason, and each the emulator fails for a known reason is a strict expected failure
listed below with that reason.
"""

from __future__ import annotations

import pytest

from tests.conformance.test_transaction_specs import (
    Case,
    Server,
    cases,
    drop_spec_databases,
    run_case,
    server,
)
from tests.support.servers import MongoServer

pytestmark = pytest.mark.conformance
__all__ = ["drop_spec_databases", "server"]  # the fixtures, shared with the transactions tests

_EXPANDED = (
    "change-streams/change-streams-showExpandedEvents.json: when showExpandedEvents is true, "
)
_NO_DDL_EVENTS = (
    "mongoeco publishes no event for {what}, and the emulator makes none up: the relay watches "
    "documents, and a showExpandedEvents stream's DDL events are left to a real replica set"
)
EMULATOR_DIFFERENCES: dict[str, str] = {
    _EXPANDED + "create events are reported": _NO_DDL_EVENTS.format(what="create"),
    _EXPANDED + "create events on views are reported": _NO_DDL_EVENTS.format(
        what="create (of a view)"
    ),
    _EXPANDED + "createIndex events are reported": _NO_DDL_EVENTS.format(what="createIndexes"),
    _EXPANDED + "dropIndexes events are reported": _NO_DDL_EVENTS.format(what="dropIndexes"),
    _EXPANDED + "modify events are reported": (
        "collMod only takes changeStreamPreAndPostImages on the emulator (mongoeco has no "
        "collMod); validators and the modify event are not served"
    ),
    _EXPANDED + "new fields on change stream events are handled appropriately": (
        "the expanded fields are not served: collectionUUID (mongoeco's collections have no "
        "UUID), nor the createIndexes event and its operationDescription"
    ),
}


@pytest.mark.parametrize("case", cases(("change-streams",)))
def test_spec(
    case: Case,
    mongo: MongoServer,
    server: Server,
    drop_spec_databases: set[str],
    request: pytest.FixtureRequest,
) -> None:
    run_case(case, mongo, server, drop_spec_databases, request, EMULATOR_DIFFERENCES)
