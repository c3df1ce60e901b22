"""How the values one command names are sliced (``_commands.chunked``): by count, and by size
for long values, in order."""

from __future__ import annotations

import pytest

from mongo_outbox import _commands
from mongo_outbox._commands import chunked


def test_values_are_sliced_by_count_in_order() -> None:
    values = list(range(2500))
    chunks = chunked(values)
    assert [len(c) for c in chunks] == [1000, 1000, 500]
    assert [v for c in chunks for v in c] == values
    assert chunked([]) == []


def test_long_values_are_sliced_by_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_commands, "BYTES_PER_COMMAND", 1000)
    chunks = chunked(["x" * 100] * 5 + ["y" * 2000] + ["z"])
    # 408 bytes each (at most 4 a character): two fit, the third does not; a value larger
    # than a command alone goes on its own.
    assert [len(c) for c in chunks] == [2, 2, 1, 1, 1]
    assert chunks[3] == ["y" * 2000]


def test_values_bson_cannot_encode_are_sliced_too() -> None:
    import uuid

    values = [uuid.uuid4() for _ in range(3)]
    assert chunked(values) == [values]
