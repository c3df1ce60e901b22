"""The relay layer behind the public fronts ``relay``, ``changestream`` and ``group``."""
