"""What a relay group is made of: each member's heartbeat and its share of the partitions
(``members``), and the worker that runs one partition, polling or on a change stream
(``workers``). ``mongo_outbox.group.RelayGroup`` drives them."""
