"""MongoDB's own specification tests for transactions, run against the suite's MongoDB.

Every other test of the suite trusts that the MongoDB under it (a replica set with
``MONGODB_URI``, or the emulator) runs transactions as MongoDB does. The drivers' specification
tests (mongodb/specifications, ``transactions`` and ``transactions-convenient-api``, unified
format) say what a driver and server do together; running them here through PyMongo checks the
server half. The files are fetched from PyMongo's sdist at test time (``specs.py``), run by our
own runner (``unified.py``), and each test not run is skipped with its reason: what the server
cannot meet (``runOnRequirements``), fail points on a server without test commands, what the
runner does not implement,
and the known differences of the emulator (``EMULATOR_DIFFERENCES``, each explained). The end of
the run prints the tally and every skip; ``CONFORMANCE_REPORT=path`` writes it to a file too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.errors import OperationFailure

from tests.conformance.specs import NOTES, TRANSACTIONS, SpecsUnavailable, spec_files
from tests.conformance.unified import (
    SCHEMA_VERSION,
    Entities,
    Runner,
    Unsupported,
    load,
    operations_of,
)
from tests.support.servers import MongoServer

pytestmark = pytest.mark.conformance

# Tests the emulator fails for a reason understood and outside what our tests rely on; strict
# xfails on the emulator, so a fix shows up. Keyed "folder/file.json: test description".
EMULATOR_DIFFERENCES: dict[str, str] = {
    "transactions/commit.json: write concern error on commit": (
        "mongoeco accepts any write concern: commitTransaction with w: 10 on one node succeeds "
        "where a server answers UnsatisfiableWriteConcern (100)"
    ),
}


@dataclass(frozen=True)
class Case:
    """One test of one spec file."""

    path: Path
    spec: dict[str, Any]
    test: dict[str, Any]

    @property
    def key(self) -> str:
        return f"{self.path.parent.name}/{self.path.name}: {self.test['description']}"


@dataclass(frozen=True)
class Server:
    """What the server under test says it is, for runOnRequirements."""

    version: tuple[int, ...]
    topology: str  # "single" | "replicaset" | "sharded" | "load-balanced"
    kind: str  # the suite's MongoServer.kind: "replica-set" | "emulator"
    auth: bool
    fail_points: bool  # whether configureFailPoint works (a server needs enableTestCommands)
    note: str = ""


def cases(folders: tuple[str, ...] = TRANSACTIONS) -> list[Any]:
    """One pytest parameter per test of the spec files of ``folders``."""
    try:
        files = spec_files(folders)
    except SpecsUnavailable as error:
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"the {folders} spec tests are unavailable: {error}") from error
        reason = f"spec files unavailable (outside CI, so skipped): {error}"
        return [pytest.param(None, id="unavailable", marks=pytest.mark.skip(reason=reason))]
    cases = []
    for path in files:
        spec = load(path.read_text())
        for test in spec["tests"]:
            case = Case(path, spec, test)
            cases.append(pytest.param(case, id=case.key))
    return cases


@pytest.fixture(scope="module")
def server(mongo: MongoServer) -> Server:
    with MongoClient(mongo.uri, serverSelectionTimeoutMS=10_000) as client:
        hello = client.admin.command("hello")
        build = client.admin.command("buildInfo")
        is_load_balanced = client.options.load_balanced
        try:
            client.admin.command({"configureFailPoint": "failCommand", "mode": "off"})
            fail_points = True
        except OperationFailure:
            fail_points = False
    version = tuple(int(part) for part in build["versionArray"][:3])
    auth = "@" in mongo.uri.split("://", 1)[-1].split("/", 1)[0]
    if is_load_balanced:
        topology = "load-balanced"
    elif hello.get("msg") == "isdbgrid":
        topology = "sharded"
    elif "setName" in hello:
        topology = "replicaset"
    else:
        topology = "single"
    note = ""
    NOTES.add(
        f"server: {mongo.description}, version {'.'.join(map(str, version))}, "
        f"evaluated as topology {topology}" + (f": {note}" if note else "")
    )
    return Server(version, topology, mongo.kind, auth, fail_points, note)


@pytest.fixture(scope="module", autouse=True)
def drop_spec_databases(mongo: MongoServer) -> Iterator[set[str]]:
    """The spec files name their databases ("transaction-tests"...): dropped after the run."""
    names: set[str] = set()
    yield names
    with MongoClient(mongo.uri) as client:
        for name in names:
            client.drop_database(name)


def _version(text: str) -> tuple[int, ...]:
    parts = [int(part) for part in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def _unmet(requirement: dict[str, Any], server: Server) -> str | None:
    """Why the server does not meet one runOnRequirements entry, or None."""
    for key, value in requirement.items():
        if key == "minServerVersion" and server.version < _version(value):
            return f"needs server >= {value}"
        if key == "maxServerVersion" and server.version > _version(value):
            return f"needs server <= {value}"
        if key == "topologies" and server.topology not in value:
            return f"needs topology {'/'.join(value)}"
        if key == "serverless" and value == "require":
            return "needs serverless"
        if key == "auth" and value != server.auth:
            return "needs authentication" if value else "needs no authentication"
        if key == "csfle" and value:
            return "needs client-side field level encryption"
        if key == "serverParameters":
            return f"needs server parameters {value}"
        if key == "authMechanism":
            return f"needs auth mechanism {value}"
    return None


def _requirements(requirements: list[dict[str, Any]] | None, server: Server) -> str | None:
    if not requirements:
        return None
    reasons = [_unmet(requirement, server) for requirement in requirements]
    if all(reasons):
        return "; or ".join(sorted({reason for reason in reasons if reason}))
    return None


def skip_reason(case: Case, server: Server) -> str | None:
    """Why this test is not run here, or None: the same for every test of a file first."""
    schema = tuple(int(part) for part in case.spec["schemaVersion"].split(".")[:2])
    if schema[0] != SCHEMA_VERSION[0] or schema > SCHEMA_VERSION:
        return f"schemaVersion {case.spec['schemaVersion']} is newer than the runner's"
    unmet = _requirements(case.spec.get("runOnRequirements"), server)
    if unmet:
        return f"runOnRequirements (file): {unmet}"
    if "skipReason" in case.test:
        return f"skipReason: {case.test['skipReason']}"
    unmet = _requirements(case.test.get("runOnRequirements"), server)
    if unmet:
        return f"runOnRequirements (test): {unmet}"
    names = {operation["name"] for operation in operations_of(case.test)}
    if "failPoint" in names and not server.fail_points:
        return "needs fail points: the server refuses configureFailPoint (enableTestCommands=1)"
    return None


INTERRUPTED = 11601


def _kill_all_sessions(client: MongoClient[Any]) -> None:
    """As the unified format asks before each test on a replica set: a transaction an earlier
    test left open (its session lost with a closed connection) would hold its documents."""
    try:
        client.admin.command({"killAllSessions": []})
    except OperationFailure as error:
        if error.code != INTERRUPTED:  # a server may interrupt the command that kills them
            raise


@pytest.mark.parametrize("case", cases())
def test_spec(
    case: Case,
    mongo: MongoServer,
    server: Server,
    drop_spec_databases: set[str],
    request: pytest.FixtureRequest,
) -> None:
    run_case(case, mongo, server, drop_spec_databases, request, EMULATOR_DIFFERENCES)


def run_case(
    case: Case,
    mongo: MongoServer,
    server: Server,
    drop_spec_databases: set[str],
    request: pytest.FixtureRequest,
    differences: dict[str, str],
) -> None:
    """Run one spec test, skipped with its reason where it cannot run, a strict xfail where
    ``differences`` explains why the emulator fails it."""
    reason = skip_reason(case, server)
    if reason is not None:
        pytest.skip(reason)
    if server.kind == "emulator" and case.key in differences:
        reason = f"emulator: {differences[case.key]}"
        request.applymarker(pytest.mark.xfail(reason=reason, strict=True))
    drop_spec_databases.update(entry["databaseName"] for entry in case.spec.get("initialData", []))
    entities = Entities(mongo.uri)
    with MongoClient(mongo.uri) as internal:
        _kill_all_sessions(internal)
        runner = Runner(entities, internal)
        try:
            entities.create(case.spec.get("createEntities", []))
            runner.initial_data(case.spec.get("initialData", []))
            runner.run(case.test["operations"])
            if "expectEvents" in case.test:
                runner.expect_events(case.test["expectEvents"])
            entities.close()
            if "outcome" in case.test:
                runner.outcome(case.test["outcome"])
        except Unsupported as error:
            pytest.skip(f"runner: {error} not implemented")
        finally:
            runner.disable_fail_points()  # first: a fail point could refuse the sessions' end
            entities.close()
