"""Guard a FastStream subscriber with an ``Inbox``: ``inbox_handler`` (see docs/faststream.md).

The public home of FastStream's consumer side, as ``mongo_outbox.publishers`` is of
``FastStreamPublisher``; both live with the rest of FastStream in
``mongo_outbox.brokers.faststream``. Importing this module needs the ``faststream`` extra.
"""

from mongo_outbox.brokers.faststream.consumer import FastStreamHandler, inbox_handler

__all__ = ["FastStreamHandler", "inbox_handler"]
