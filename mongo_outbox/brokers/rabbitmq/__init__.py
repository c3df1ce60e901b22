"""RabbitMQ through aio-pika and aiormq (the ``rabbitmq`` extra): ``publisher``
(``RabbitMQPublisher``), ``consumer`` (``consume_rabbitmq``, ``handle_rabbitmq_message``, with
the retry queues of ``_retry_queues``) and ``errors``, the one classification of its errors,
which FastStream's ``RabbitBroker`` path uses too. Importing this package imports no client."""
