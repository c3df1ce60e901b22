"""FastStream (the ``faststream`` extra), through a broker the application already runs:
``publisher`` (``FastStreamPublisher``), ``consumer`` (``inbox_handler``, public as
``mongo_outbox.faststream``) and ``errors``, which classifies a FastStream broker's errors with
the classification of the broker underneath (``brokers.<name>.errors``), and Kafka's, reached
only through FastStream. Importing this package imports no client."""
