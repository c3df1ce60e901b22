"""Serve the mongoeco MongoDB emulator on 127.0.0.1, change streams included, until killed.

    python -m mongo_outbox.testing.emulator [PORT] [--stop-on-eof]    # PORT 0 or none: any free

It prints ``ready PORT MONGOECO_VERSION`` once it listens (``start_emulator()`` waits for that
line), or ``error: REASON`` and exits with status 1 when this interpreter cannot run it. With
``--stop-on-eof`` it stops when its standard input closes: ``start_emulator()`` holds the other
end of that pipe, so an emulator does not outlive a test run that was killed. It needs
Python >= 3.13 and ``mongo-outbox[testing]``; what it cannot prove is listed in
``mongo_outbox.testing``.

This module imports mongoeco only when it serves, so it is importable anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
from importlib.metadata import version

# The server's error codes, at this module's import path of before they got a leaf of their own.
from mongo_outbox.testing._server_codes import (  # noqa: F401
    CHANGE_STREAM_HISTORY_LOST,
    CURSOR_NOT_FOUND,
    INVALID_RESUME_TOKEN,
    server_error_code,
)

NEEDS = "pip install 'mongo-outbox[testing]' (mongoeco[wire], Python >= 3.13)"


def unable_to_serve() -> str | None:
    """Why this interpreter cannot run the emulator, or None when it can."""
    if sys.version_info < (3, 13):
        found = ".".join(map(str, sys.version_info[:3]))
        return (
            f"{sys.executable} is Python {found}; the emulator needs Python >= 3.13 with "
            "mongo-outbox[testing] (pass one as python= or MONGOECO_PYTHON)"
        )
    try:
        import mongoeco.wire  # noqa: F401
    except ImportError as error:
        return f"mongoeco is not installed for {sys.executable} ({error}): {NEEDS}"
    return None


async def serve(port: int = 0, *, stop_on_eof: bool = False) -> None:
    """Listen on ``port`` and announce it on stdout; return when cancelled or, with
    ``stop_on_eof``, when standard input closes."""
    from mongoeco.wire import AsyncMongoEcoProxyServer

    from mongo_outbox.testing._changestreams import ChangeStreamsOverWire

    closed = asyncio.Event()
    if stop_on_eof:
        loop = asyncio.get_running_loop()

        def wait_for_eof() -> None:
            while sys.stdin.buffer.read(4096):
                pass
            loop.call_soon_threadsafe(closed.set)

        # A daemon thread: a blocking read must not hold up the interpreter's exit.
        threading.Thread(target=wait_for_eof, daemon=True).start()
    async with AsyncMongoEcoProxyServer(host="127.0.0.1", port=port) as server:
        ChangeStreamsOverWire(server)
        print("ready", server.address.port, version("mongoeco"), flush=True)
        await closed.wait()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mongo_outbox.testing.emulator", description=__doc__.splitlines()[0]
    )
    parser.add_argument("port", type=int, nargs="?", default=0, help="0 (default): a free port")
    parser.add_argument("--stop-on-eof", action="store_true", help="stop when stdin closes")
    args = parser.parse_args(argv)
    reason = unable_to_serve()
    if reason is not None:
        print("error:", reason, flush=True)
        return 1
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a person stops it
        asyncio.run(serve(args.port, stop_on_eof=args.stop_on_eof))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
