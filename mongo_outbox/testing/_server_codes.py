"""The codes a replica set member answers with where mongoeco raises uncoded errors: shared by
the emulator's change streams (``_changestreams``) and the tests' sources, and importable
without mongoeco (the Python 3.10 leg has none)."""

from __future__ import annotations

CURSOR_NOT_FOUND = 43
CURSOR_IN_USE = 292
INVALID_RESUME_TOKEN = 260
CHANGE_STREAM_FATAL = 280
UNRECOGNIZED_STAGE = 40324
CHANGE_STREAM_HISTORY_LOST = 286


def server_error_code(error: Exception) -> int | None:
    """The code a server would answer mongoeco's uncoded change-stream error with."""
    text = str(error)
    if "no longer available" in text:
        return CHANGE_STREAM_HISTORY_LOST
    if "resume token" in text:
        return INVALID_RESUME_TOKEN
    return None
