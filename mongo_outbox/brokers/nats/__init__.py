"""NATS JetStream through nats-py (the ``nats`` extra): ``publisher`` (``NatsPublisher``),
``consumer`` (``consume_nats``, ``handle_nats_message``) and ``errors``, the one classification
of its errors, which FastStream's ``NatsBroker`` path uses too. Importing this package imports
no client."""
