"""The relay side's implementation, behind the public fronts ``relay``, ``changestream``,
``group`` and ``tenants``: a round claims due events through the storage seam (``store``: one
store per outbox mode), publishes them in per-aggregate order (``rounds``), classifies what
failed (``failures``) and settles the claim; ``turns`` shares one publisher fairly between
relays, ``replay`` publishes already-published events again, ``lease`` is the fenced lease that
lets one process publish for a change-stream relay or a group's partition, and ``group`` holds
what a relay group is made of (members' heartbeats and the workers that run its partitions)."""
