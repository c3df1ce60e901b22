"""The import path of a change-stream relay's checkpoint before the lease had a home of its own:
the checkpoint is the relay's fenced lease, its resume token the data saved under the fence
(``mongo_outbox._relay.lease``)."""

from mongo_outbox._relay.lease import FencedLease, LeaseLost

Checkpoint = FencedLease

__all__ = ["Checkpoint", "LeaseLost"]
