"""Redis Streams through redis-py (the ``redis`` extra): ``publisher``
(``RedisStreamsPublisher``), ``consumer`` (``consume_redis``, over the entry commands of
``_entries``) and ``errors``, the one classification of its errors, which FastStream's
``RedisBroker`` path uses too. Importing this package imports no client."""
