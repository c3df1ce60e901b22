"""Every ```python block of README.md and docs/*.md runs, as written, against the test MongoDB.

Blocks see ``client`` (AsyncMongoClient), ``db`` (a fresh database), ``sync_client`` (a
``MongoClient`` of the same server, for ``mongo_outbox.sync``), ``NATS_URL``,
``RABBITMQ_URL`` and ``REDIS_URL``, and may use top-level ``await``. A block preceded by
``<!-- not-tested: reason -->`` is skipped, visibly.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from tests.support.servers import NATS_URL, RABBITMQ_URL, REDIS_URL

try:
    from opentelemetry.test.globals_test import reset_trace_globals
except ImportError:  # without the otel extra and the SDK's test helper
    reset_trace_globals = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- not-tested: [^>]*-->\s*)?```python\n(.*?)```", re.DOTALL)


def blocks() -> list[Any]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start(2)) + 1
            marks = [pytest.mark.skip(reason=match.group(1).strip())] if match.group(1) else []
            found.append(
                pytest.param(path, line, match.group(2), id=f"{path.name}:{line}", marks=marks)
            )
    return found


def test_every_document_has_runnable_blocks() -> None:
    assert {p.name for p in DOCS} >= {"README.md", "outbox.md", "relay.md"}
    assert len(blocks()) >= 5


@pytest.mark.parametrize(("path", "line", "source"), blocks())
async def test_block_runs(
    path: Path,
    line: int,
    source: str,
    client: Any,
    db: Any,
    sync_client: MongoClient[Any],
    nats_client: Any,
) -> None:
    js = nats_client.jetstream()
    stream = f"docs_{db.name}"
    await js.add_stream(name=stream, subjects=["orders.>"])  # the README publishes to orders.*
    namespace: dict[str, Any] = {
        "client": client,
        "db": db,
        "sync_client": sync_client,
        "NATS_URL": NATS_URL,
        "RABBITMQ_URL": RABBITMQ_URL,
        "REDIS_URL": REDIS_URL,
    }
    try:
        # dont_inherit: a block runs as written, without this module's __future__ annotations
        # (pydantic models in a block resolve their annotations where they are defined).
        code = compile(
            "\n" * (line - 1) + source,
            str(path),
            "exec",
            flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
            dont_inherit=True,
        )
        result = eval(code, namespace)
        if inspect.iscoroutine(result):
            await result
        if path.name == "README.md" and "publisher" in namespace:  # it reached the broker
            assert (await js.stream_info(stream)).state.messages == 1
    finally:
        if reset_trace_globals is not None:
            reset_trace_globals()  # a block that installed a tracer provider (docs/tracing.md)
        publisher = namespace.get("publisher")
        if publisher is not None:
            await publisher.aclose()
        await js.delete_stream(stream)
        if "redis" in source:  # docs/redis.md names its streams after the database
            await delete_redis_keys(f"{db.name}*")


async def delete_redis_keys(pattern: str) -> None:
    from redis.asyncio import Redis

    async with Redis.from_url(REDIS_URL) as redis:
        keys = [key async for key in redis.scan_iter(match=pattern)]
        if keys:
            await redis.delete(*keys)
