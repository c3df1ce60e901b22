"""An in-process broker for tests, demos and local runs (no extra): ``publisher``
(``MemoryPublisher``), a real ``Publisher`` that keeps what it was given, in order."""
