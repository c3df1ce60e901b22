"""Publish to the real RabbitMQ a message with no ``message_id`` property at all.

aiormq gives every message it publishes a random message_id, so no aio-pika (or FastStream)
producer can send one without; other AMQP clients can. This speaks AMQP 0-9-1 itself through
pamqp (aiormq's frame codec): connect, open a channel, publish, close the channel (RabbitMQ
answers the close only after the publish before it is routed) and the connection.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import unquote, urlparse

from pamqp import body as content
from pamqp import commands, frame, header


async def publish_without_message_id(
    url: str, exchange: str, routing_key: str, data: bytes
) -> None:
    parts = urlparse(url)
    user, password = unquote(parts.username or "guest"), unquote(parts.password or "guest")
    vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 5672)
    buffer = b""

    async def receive(expected: type[Any]) -> Any:
        nonlocal buffer
        while True:
            if buffer:
                try:
                    used, _, value = frame.unmarshal(buffer)
                except Exception:  # noqa: BLE001 - an incomplete frame: read more
                    used = 0
                if used:
                    buffer = buffer[used:]
                    if isinstance(value, expected):
                        return value
                    continue
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            if not chunk:
                raise ConnectionError(f"RabbitMQ closed the connection before {expected}")
            buffer += chunk

    def send(value: Any, channel: int = 0) -> None:
        writer.write(frame.marshal(value, channel))

    try:
        writer.write(frame.marshal(header.ProtocolHeader(), 0))
        await receive(commands.Connection.Start)
        send(
            commands.Connection.StartOk(
                client_properties={}, mechanism="PLAIN", response=f"\0{user}\0{password}"
            )
        )
        tune = await receive(commands.Connection.Tune)
        send(commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))
        send(commands.Connection.Open(vhost))
        await receive(commands.Connection.OpenOk)
        send(commands.Channel.Open(), 1)
        await receive(commands.Channel.OpenOk)
        send(commands.Basic.Publish(exchange=exchange, routing_key=routing_key), 1)
        send(header.ContentHeader(0, len(data), commands.Basic.Properties()), 1)
        send(content.ContentBody(data), 1)
        send(commands.Channel.Close(200, "done", 0, 0), 1)
        await receive(commands.Channel.CloseOk)
        send(commands.Connection.Close(200, "done", 0, 0))
        await receive(commands.Connection.CloseOk)
    finally:
        writer.close()
        await writer.wait_closed()
