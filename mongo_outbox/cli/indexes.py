"""``mongo-outbox ensure-indexes``: the indexes the relay, the TTL pruning and (with
``--inbox``) the inbox need, created before the first relay or consumer starts. Idempotent.

Building an index on a large collection takes a while: the progress line counts the documents
of the collections whose indexes are done (MongoDB's estimate, read before), and its time moves
on while a build runs.
"""

from __future__ import annotations

import click

from mongo_outbox.cli.common import Target, connected, option, run, say, target_options
from mongo_outbox.cli.progress import progress
from mongo_outbox.errors import DuplicateSequenceError
from mongo_outbox.inbox import Inbox


@click.command("ensure-indexes")
@target_options
@click.option("--inbox", "with_inbox", is_flag=True, help="Create the inbox's indexes too.")
@option("--inbox-collection", default="inbox", show_default=True, help="The inbox collection.")
def ensure_indexes(target: Target, with_inbox: bool, inbox_collection: str) -> None:
    """Create the outbox's indexes (and the inbox's)."""
    for line in run(_ensure(target, with_inbox, inbox_collection)):
        say(line)


async def _ensure(target: Target, with_inbox: bool, inbox_collection: str) -> list[str]:
    async with connected(target) as conn:
        outbox = conn.outbox
        if outbox.mode == "embedded":
            collections = [conn.db[name] for name in outbox.collections] + [outbox.event_ids]
        else:
            collections = [outbox.collection]
        # The indexes are the collection's, whichever consumer asks for them.
        box = Inbox(conn.db, consumer="mongo-outbox", collection=inbox_collection)
        inbox = [box.collection] if with_inbox else []
        sizes = {c.name: await c.estimated_document_count() for c in collections + inbox}
        refused: DuplicateSequenceError | None = None
        async with progress("ensure-indexes", "documents", total=sum(sizes.values())) as shown:
            try:
                await outbox.ensure_indexes()
            except DuplicateSequenceError as error:
                # The outbox's others are built: the inbox's too, then the duplicates are named.
                refused = error
            shown.add(sum(sizes[c.name] for c in collections))
            if with_inbox:
                await box.ensure_indexes()
                shown.add(sizes[box.collection.name])
        if refused is not None:
            raise refused
        collections += inbox
        lines = []
        for coll in collections:
            names = sorted(name for name in await coll.index_information() if name != "_id_")
            lines.append(f"{conn.db.name}.{coll.name}: {', '.join(names)}")
        return lines
