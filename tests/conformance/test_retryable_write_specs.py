"""MongoDB's own specification tests for retryable writes, run against the suite's MongoDB.

The outbox's writes go through PyMongo's retryable writes: a write whose connection dropped, or
that a primary stepping down refused, is sent again with the same ``txnNumber``, and the server
must apply it once. The drivers' retryable-writes specification tests (mongodb/specifications
``retryable-writes``, unified format) say what the server answers such a retry and which errors
carry the ``RetryableWriteError`` label. They run here as the transactions ones do
(``test_transaction_specs.py``): each test not run is skipped with its reason, and each the
emulator fails for a known reason is a strict expected failure listed below with that reason.
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
from tests.conformance.unified import operations_of
from tests.support.servers import MongoServer

pytestmark = pytest.mark.conformance
__all__ = ["drop_spec_databases", "server"]  # the fixtures, shared with the transactions tests

CASES = cases(("retryable-writes",))
# onPrimaryTransactionalWrite fails a retryable write's statement on the primary: it closes the
# connection after the statement is applied, or (failBeforeCommitExceptionCode) before. It
# counts statements, not commands, and the server answers a retry statement by statement.
_NO_TRANSACTIONAL_WRITE_FAIL_POINT = (
    "the emulator has no onPrimaryTransactionalWrite fail point (only failCommand, which "
    "fails a whole command before it runs, and failGetMoreAfterCursorCheckout)"
)
EMULATOR_DIFFERENCES: dict[str, str] = {
    "retryable-writes/aggregate-out-merge.json: aggregate with $out does not set txnNumber": (
        "mongoeco has no $out stage (Unsupported aggregation stage)"
    ),
    # Every test that sets the fail point: derived from the files, as each one names it.
    **{
        param.values[0].key: _NO_TRANSACTIONAL_WRITE_FAIL_POINT
        for param in CASES
        if param.values[0] is not None
        and any(
            operation["name"] == "failPoint"
            and operation["arguments"]["failPoint"]["configureFailPoint"]
            == "onPrimaryTransactionalWrite"
            for operation in operations_of(param.values[0].test)
        )
    },
}


@pytest.mark.parametrize("case", CASES)
def test_spec(
    case: Case,
    mongo: MongoServer,
    server: Server,
    drop_spec_databases: set[str],
    request: pytest.FixtureRequest,
) -> None:
    run_case(case, mongo, server, drop_spec_databases, request, EMULATOR_DIFFERENCES)
