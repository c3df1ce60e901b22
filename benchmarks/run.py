"""``make bench`` (``python -m benchmarks.run``): every benchmark in one run, on one MongoDB,
with a summary at the end.

MongoDB is ``MONGODB_URI`` if set, else the mongoeco emulator (``mongo_outbox.testing``);
RabbitMQ and NATS come from ``RABBITMQ_URL`` and ``NATS_URL`` (local defaults). Each benchmark
module has ``async def run(uri) -> list[str]``: it prints as it goes and returns its headline
figures. Optional modules (written separately) run when they exist and import. Names given on
the command line (``python -m benchmarks.run bench_publishers``) run only those.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import time
import traceback

from benchmarks.common import NATS_URL, RABBITMQ_URL, header, say, start_backend

BENCHMARKS = (
    "bench_relay",
    "bench_relay_cpu",
    "bench_publishers",
    "bench_save",
    "bench_update",
    "bench_create",
)
OPTIONAL = (
    "bench_inbox",
    "bench_changestream",
    "bench_latency_defaults",
    "bench_tracing",
    "bench_redis",
    "bench_metrics",
    "bench_group",
    "bench_odm",
    "bench_django",
    "bench_tenants",
)


def load(name: str, optional: bool) -> object | None:
    try:
        return importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError as error:
        if optional and error.name == f"benchmarks.{name}":
            return None
        raise
    except Exception:
        if not optional:
            raise
        say(f"\n{name}: skipped, it does not import:\n{traceback.format_exc()}")
        return None


async def main() -> int:
    server = start_backend()
    say(f"MongoDB backend: {server.description}")
    say(f"Brokers: NATS {NATS_URL}, RabbitMQ {RABBITMQ_URL}")
    summary: dict[str, list[str]] = {}
    failed: list[str] = []
    start = time.perf_counter()
    chosen = [(n, False) for n in BENCHMARKS] + [(n, True) for n in OPTIONAL]
    if len(sys.argv) > 1:
        unknown = set(sys.argv[1:]) - {name for name, _ in chosen}
        if unknown:
            say(f"unknown benchmarks: {', '.join(sorted(unknown))}")
            return 2
        chosen = [(name, False) for name, _ in chosen if name in sys.argv[1:]]
    try:
        for name, optional in chosen:
            module = load(name, optional)
            if module is None:
                continue
            try:
                summary[name] = await module.run(server.uri)  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - report it and let the other benchmarks run
                failed.append(name)
                say(f"\n{name} FAILED:\n{traceback.format_exc()}")
    finally:
        server.stop()
    header(f"Summary ({server.description}; {time.perf_counter() - start:.0f}s)")
    for name, lines in summary.items():
        say(f"[{name}]")
        for line in lines:
            say(f"  {line}")
    if failed:
        say(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
