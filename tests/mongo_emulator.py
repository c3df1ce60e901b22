"""Serve mongoeco's MongoDB wire-protocol emulator on 127.0.0.1 until killed.

Usage: python tests/mongo_emulator.py PORT   (prints "ready PORT" once it accepts connections)
"""

import asyncio
import sys

from mongoeco.wire import AsyncMongoEcoProxyServer


async def main(port: int) -> None:
    async with AsyncMongoEcoProxyServer(host="127.0.0.1", port=port) as server:
        from importlib.metadata import version

        print("ready", server.address.port, version("mongoeco"), flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
