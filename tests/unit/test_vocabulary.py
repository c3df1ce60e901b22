"""One word, one meaning: the glossary of docs/architecture.md ("Words") defines each term once,
and the modules use its words in its sense only. A word that names two things ("batch" for a
round, a wave and a requeue chunk) costs every reader a guess; these checks keep it from
coming back. Each exception is listed with the reason it is one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mongo_outbox"
PAGE = (ROOT / "docs" / "architecture.md").read_text()

TERMS = {
    "event",
    "entry",
    "round",
    "claim",
    "wave",
    "settle",
    "attempt",
    "park",
    "requeue",
    "chunk",
    "dead letter",
    "lease",
    "claim lease",
    "leader lease",
    "processing lease",
    "fence",
    "counters",
    "status",
    "batch",
}

# "batch" in the sense of the parts we speak to (docs/architecture.md, Words), by module.
BATCH_ALLOWED = {
    "changestream/source.py": "a change stream's batch of changes, the server's post-batch token",
    "changestream/relay.py": "the change stream's batches it hands to rounds",
    "changestream/__init__.py": "exports ChangeBatch, the change stream's batch",
    "brokers/nats/consumer.py": "consume_nats(batch=): how many messages one fetch asks for",
    "brokers/redis/consumer.py": "consume_redis(batch=): how many entries one XREADGROUP asks for",
    "brokers/faststream/consumer.py": "FastStream's batch subscribers, which it refuses",
    "odm/beanie.py": "Beanie's insert_many of a batch of the user's documents",
    "testing/_changestreams.py": "the wire protocol's cursor batches (firstBatch, nextBatch)",
    "testing/_numeric_ids.py": "the wire protocol's cursor batches",
}
# Lines that keep "batch" anywhere: the public names of before, and the settings' names.
BATCH_LINE_ALLOWED = re.compile(
    r"batch_size|--batch-size|change-stream batch|BatchPublisher|publish_batch"
    r'|"batch" now means nothing'
)
BATCH = re.compile(r"batch", re.IGNORECASE)

# The outbox parks; "dead letter" is the consumers' word. The modules of the outbox's side:
OUTBOX_SIDE = ("_write", "_relay", "relay.py", "changestream", "group.py", "tenants.py")
OUTBOX_SIDE_ALLOWED = {
    "_relay/replay.py": "replays for consumers whose dead letters were requeued: theirs, not ours",
}
DEAD_LETTER = re.compile(r"dead.?letter", re.IGNORECASE)
POISON = re.compile(r"poison", re.IGNORECASE)


def modules() -> list[tuple[str, str]]:
    return sorted(
        (path.relative_to(PACKAGE).as_posix(), path.read_text()) for path in PACKAGE.rglob("*.py")
    )


def glossary() -> str:
    return PAGE.split("\n## Words\n", 1)[1].split("\n## ", 1)[0]


def test_each_glossary_term_is_defined_once_in_the_architecture_page() -> None:
    defined = re.findall(r"\*\*([a-z ]+)\*\*", glossary())
    assert sorted(defined) == sorted(TERMS), "a term defined twice, or one missing"
    # Nowhere else on the page is a term defined again (a bold term followed by a colon).
    elsewhere = PAGE.replace(glossary(), "")
    redefined = {t for t in TERMS if re.search(rf"\*\*{t}\*\*\s*[:(]", elsewhere, re.IGNORECASE)}
    assert not redefined


@pytest.mark.parametrize("module", [m for m, _ in modules()])
def test_batch_means_only_the_drivers_and_brokers_batch(module: str) -> None:
    if module in BATCH_ALLOWED:
        return
    text = (PACKAGE / module).read_text()
    used = [
        f"{module}:{n}: {line.strip()}"
        for n, line in enumerate(text.splitlines(), 1)
        if BATCH.search(line) and not BATCH_LINE_ALLOWED.search(line)
    ]
    assert not used, "say round, wave or chunk (docs/architecture.md, Words)"


def test_the_outbox_side_parks_and_never_dead_letters() -> None:
    used = [
        f"{module}:{n}: {line.strip()}"
        for module, text in modules()
        if module.startswith(OUTBOX_SIDE) and module not in OUTBOX_SIDE_ALLOWED
        for n, line in enumerate(text.splitlines(), 1)
        if DEAD_LETTER.search(line)
    ]
    assert not used, "the outbox parks an entry: dead letters are the consumers'"


def test_poison_is_only_the_name_of_the_public_exception() -> None:
    used = [
        f"{module}:{n}: {line.strip()}"
        for module, text in modules()
        for n, line in enumerate(text.splitlines(), 1)
        if POISON.search(line.replace("PoisonMessage", ""))
    ]
    assert not used, "say the message is given up on, or dead-lettered"


def test_the_allow_lists_name_modules_that_exist() -> None:
    names = {m for m, _ in modules()}
    assert set(BATCH_ALLOWED) <= names
    assert set(OUTBOX_SIDE_ALLOWED) <= names


# The stored field names live in one leaf, mongo_outbox/_storage.py: these modules, which read and
# write what the two sides store, spell none of them out (a docstring may name one).
STORAGE_READERS = (
    "_relay/lease.py",
    "_relay/store/collection.py",
    "_relay/store/embedded.py",
    "_relay/store/embedded_parked.py",
    "_relay/store/published_ids.py",
    "_write/collection_layout.py",
    "_write/event_ids.py",
    "admin.py",
    "group.py",
)
SPELLED = {
    "attempts",
    "available_at",
    "checkpoint_at",
    "claim",
    "expire_at",
    "fence",
    "last_error",
    "lease_until",
    "misses",
    "owner",
    "published_at",
    "waits",
}


def string_literals(text: str) -> set[str]:
    tree = ast.parse(text)
    documented = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in documented
    }


@pytest.mark.parametrize("module", STORAGE_READERS)
def test_stored_field_names_are_spelled_only_in_the_storage_leaf(module: str) -> None:
    assert not string_literals((PACKAGE / module).read_text()) & SPELLED


def test_the_command_line_spells_no_stored_field_it_reads() -> None:
    # The console's chart asks the admin (latest_publication, published_after).
    assert "expire_at" not in string_literals((PACKAGE / "cli/console/data.py").read_text())
