"""The change-stream relay: ``ChangeStreamRelay`` follows an outbox's change stream and
publishes within milliseconds of a commit.

Two modules, one concern each: ``source`` adapts the driver's change streams (and triages
their errors), ``relay`` is the loop. Its checkpoint, the resume token and leader lease, is the
relay's fenced lease (``mongo_outbox._relay.lease``).
"""

from mongo_outbox.changestream.relay import ChangeStreamRelay
from mongo_outbox.changestream.source import (
    ChangeBatch,
    ChangeSource,
    ChangeStream,
    WatchSource,
    triage,
)
from mongo_outbox.status import RelayStatus

__all__ = [
    "ChangeBatch",
    "ChangeSource",
    "ChangeStream",
    "ChangeStreamRelay",
    "RelayStatus",
    "WatchSource",
    "triage",
]
