"""How a relay group's members share the partitions: fairly, disjointly, completely."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mongo_outbox._relay.group.members import share


@given(
    members=st.sets(st.text(min_size=1, max_size=8), min_size=1, max_size=12),
    count=st.integers(min_value=1, max_value=64),
)
def test_members_that_agree_share_every_partition_once_and_fairly(
    members: set[str], count: int
) -> None:
    shares = {m: share(sorted(members), m, count) for m in members}
    taken = [k for mine in shares.values() for k in mine]
    assert sorted(taken) == list(range(count))  # each partition wanted by exactly one member
    sizes = {len(mine) for mine in shares.values()}
    assert sizes <= {count // len(members), -(-count // len(members))}  # floor or ceil


def test_a_member_counts_itself_even_before_its_heartbeat_is_read() -> None:
    assert share(["b"], "a", 4) == [0, 2] and share(["a"], "b", 4) == [1, 3]
