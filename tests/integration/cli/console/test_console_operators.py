"""``mongo-outbox console`` for a team of operators: named users of two roles signed in at once
(a reader is refused a requeue, an operator is not), the confirm step before a requeue of
everything (its token good for that action of that session only), the audit line of every
requeue, the links from each problem shown to its runbook in docs/operating.md, the favicon, and
a right-to-left override in a stored text shown escaped, yet sent back as stored."""

from __future__ import annotations

import logging
import re
import unicodedata
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from mongo_outbox import Event
from mongo_outbox.cli.console.app import RUNBOOK_URL, RUNBOOKS, SITE_URL
from mongo_outbox.cli.console.auth import Credentials, hash_secret, read_users
from mongo_outbox.events import utc_now
from tests.integration.cli.console.test_console import parked_ids
from tests.support.console import (
    TOKEN,
    console_of,
    csrf_of,
    dead_letter,
    hidden_fields,
    in_process,
    leases,
    park,
    park_one,
    park_type,
    post_form,
    served,
    visitor,
)
from tests.support.servers import MongoServer

ROOT = Path(__file__).resolve().parents[4]
ALICE, BOB = "alice-secret-0123", "bob-secret-456789"
AUDIT = "mongo_outbox.cli.console.audit"


def team() -> Credentials:
    """The shared token (an operator), alice (an operator) and bob (a reader)."""
    users = read_users([f"alice:operator:{hash_secret(ALICE)}", f"bob:reader:{hash_secret(BOB)}"])
    return Credentials(token=TOKEN, users=users)


async def sign_in_as(http: httpx.AsyncClient, user: str, password: str) -> str:
    """Sign in as ``user``; return the signed-in session's CSRF token."""
    form = {"csrf": csrf_of((await http.get("/")).text), "user": user, "password": password}
    answer = await http.post("/login", data=form)
    assert answer.status_code == 303, answer.text
    return csrf_of((await http.get("/")).text)


def audit_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == AUDIT]


async def test_two_users_of_two_roles_at_once_and_only_the_operator_requeues(
    client: Any, mongo: MongoServer, db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT)
    saved = await park(db)
    bad, a_first = saved["b"][0].id, saved["a"][0].id
    async with in_process(client, db, mongo, credentials=team(), require_sign_in=True) as alice:
        async with visitor(console_of(alice), "10.0.0.8") as bob:
            alice_csrf = await sign_in_as(alice, "alice", ALICE)
            bob_csrf = await sign_in_as(bob, "bob", BOB)
            bobs_page, alices_page = (await bob.get("/")).text, (await alice.get("/")).text

            # bob reads the page (it needs a sign-in here) but has nothing to click...
            assert "signed in as <bdi>bob</bdi> (reading only)" in bobs_page
            assert bad in bobs_page and "Requeue" not in bobs_page
            assert (
                "signed in as <bdi>alice</bdi>" in alices_page and "Requeue chosen" in alices_page
            )
            # ...and a requeue he sends anyway is refused, while alice's, at the same time, is not.
            refused = await bob.post("/parked/requeue", data={"csrf": bob_csrf, "event_id": bad})
            assert refused.status_code == 403 and "bob may only read" in refused.text
            assert bad in await parked_ids(db)
            again = {"csrf": bob_csrf, "consumer": "billing", "all": "1"}
            assert (await bob.post("/inbox/requeue", data=again)).status_code == 403
            done = await alice.post(
                "/parked/requeue", data={"csrf": alice_csrf, "event_id": a_first}
            )
            assert done.status_code == 303
            assert (await bob.get("/")).status_code == 200  # bob is still signed in
    assert a_first not in await parked_ids(db) and bad in await parked_ids(db)
    lines = audit_lines(caplog)
    assert lines == [
        '"bob" (reader) from 10.0.0.8 refused /parked/requeue: a reader may not requeue',
        '"bob" (reader) from 10.0.0.8 refused /inbox/requeue: a reader may not requeue',
        f'"alice" (operator) from 127.0.0.1 requeued 1 parked events in "{db.name}": '
        f'event ids ["{a_first}"]',
    ]


async def test_the_shared_token_still_signs_in_an_operator_whose_requeues_are_audited(
    client: Any, mongo: MongoServer, db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT)
    paid, placed = Event(type="order.paid"), Event(type="order.placed")
    await dead_letter(db, "billing", paid, placed)
    async with in_process(client, db, mongo, credentials=team()) as http:
        page = (await http.get("/")).text
        form = {"csrf": csrf_of(page), "token": TOKEN}
        assert (await http.post("/login", data=form)).status_code == 303
        page = (await http.get("/")).text
        assert "signed in as <bdi>token</bdi>" in page
        one = {"csrf": csrf_of(page), "consumer": "billing", "message_id": paid.id}
        assert (await http.post("/inbox/requeue", data=one)).status_code == 303
    assert audit_lines(caplog) == [
        f'"token" (operator) from 127.0.0.1 requeued 1 failed messages in "{db.name}": '
        f'message ids ["{paid.id}"] of consumer "billing"'
    ]


async def test_a_requeue_of_everything_asks_first_and_its_confirmation_fits_that_action_only(
    client: Any, mongo: MongoServer, db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT)
    saved = await park(db)
    await dead_letter(db, "billing", Event(type="order.paid"), Event(type="order.placed"))
    every = {e.id for events in saved.values() for e in events} - {saved["a"][1].id}
    async with in_process(client, db, mongo, credentials=team()) as http:
        csrf = await sign_in_as(http, "alice", ALICE)
        page = (await http.get("/", params={"type": "poison"})).text
        assert 'id="requeue-matching"' in page
        form = {"csrf": csrf, "matching": "1", "type": "poison"}
        asked = await http.post("/parked/requeue", data=form)
        # The confirm page asks, and nothing was requeued yet.
        assert asked.status_code == 200
        assert f"Requeue all 3 parked events of type poison in {db.name}?" in asked.text
        assert await parked_ids(db) == every
        fields = hidden_fields(asked.text)
        token = dict(fields)["confirm"]

        # A forged confirmation, or this one for another action (no filter: everything), or
        # another session's, only asks again.
        forged = [(k, "forged" if k == "confirm" else v) for k, v in fields]
        wider = [(k, v) for k, v in fields if k != "type"]
        for sent in (forged, wider):
            assert (await post_form(http, "/parked/requeue", sent)).status_code == 200
        async with visitor(console_of(http), "10.0.0.9") as other:
            other_csrf = await sign_in_as(other, "alice", ALICE)
            theirs = [(k, other_csrf if k == "csrf" else v) for k, v in fields]
            assert (await post_form(other, "/parked/requeue", theirs)).status_code == 200
        assert await parked_ids(db) == every

        done = await post_form(http, "/parked/requeue", fields)
        assert done.status_code == 303
        assert await parked_ids(db) == {saved["b"][0].id}

        # Every failed message of a consumer asks first too.
        inbox = {"csrf": csrf, "consumer": "billing", "all": "1"}
        asked = await http.post("/inbox/requeue", data=inbox)
        assert f"Requeue every failed message of billing in {db.name}?" in asked.text
        assert (
            await post_form(http, "/inbox/requeue", hidden_fields(asked.text))
        ).status_code == 303
    assert token and audit_lines(caplog) == [
        f'"alice" (operator) from 127.0.0.1 requeued 3 parked events in "{db.name}": '
        'every parked event with type in ["poison"]',
        f'"alice" (operator) from 127.0.0.1 requeued 2 failed messages in "{db.name}": '
        'every failed message of consumer "billing"',
    ]


async def test_a_confirmation_is_used_once_and_only_for_the_count_it_showed(
    client: Any, mongo: MongoServer, db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT)
    await park(db)
    async with in_process(client, db, mongo, credentials=team()) as http:
        csrf = await sign_in_as(http, "alice", ALICE)
        form = {"csrf": csrf, "matching": "1", "type": "poison"}
        # Two confirm pages of the same action, as two tabs would have them.
        first = hidden_fields((await http.post("/parked/requeue", data=form)).text)
        second = hidden_fields((await http.post("/parked/requeue", data=form)).text)
        assert dict(first)["confirm"] != dict(second)["confirm"]

        # One more poison event parked after the pages were shown: neither page's count
        # holds, so each asks again, with the new count, and nothing comes back.
        late = await park_one(db, "d")
        again = await post_form(http, "/parked/requeue", first)
        assert again.status_code == 200
        assert f"Requeue all 4 parked events of type poison in {db.name}?" in again.text
        assert (await post_form(http, "/parked/requeue", second)).status_code == 200
        assert late.id in await parked_ids(db)

        confirmed = hidden_fields(again.text)
        assert (await post_form(http, "/parked/requeue", confirmed)).status_code == 303
        assert late.id not in await parked_ids(db)

        # The same form sent again (a double click, a resend, a replay) only asks. Since then
        # park_one's relay parked the four again, and one more: all five stay parked.
        later = await park_one(db, "e")
        before = await parked_ids(db)
        assert later.id in before and late.id in before
        replayed = await post_form(http, "/parked/requeue", confirmed)
        assert replayed.status_code == 200
        assert f"Requeue all 5 parked events of type poison in {db.name}?" in replayed.text
        assert await parked_ids(db) == before
    assert len(audit_lines(caplog)) == 1


def slugify(heading: str) -> str:
    """A heading's anchor as Python-Markdown's toc (the docs site's) makes it, and GitHub's
    too for the plain headings docs/operating.md has."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def operating_anchors() -> dict[str, str]:
    """docs/operating.md's headings, by the anchor the docs site (and GitHub) gives each."""
    text = (ROOT / "docs" / "operating.md").read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # a "# comment" in a block is none
    headings = re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)
    return {slugify(h.replace("`", "")): h for h in headings}


def test_each_runbook_the_console_links_to_is_a_heading_of_operating_md() -> None:
    anchors = operating_anchors()
    for problem, (anchor, title) in RUNBOOKS.items():
        assert anchor in anchors, f"{problem}: no heading #{anchor} in docs/operating.md"
        assert anchors[anchor] == title


def test_the_runbooks_are_on_the_docs_site_if_it_has_an_address_else_in_docs() -> None:
    configured = re.search(r"^site_url:\s*(\S+)", (ROOT / "mkdocs.yml").read_text(), re.M)
    site = configured.group(1).strip("'\"") if configured else None
    if site is not None and not site.endswith("/"):
        site += "/"
    assert site == SITE_URL
    assert (f"{site}operating/" if site else "docs/operating.md") == RUNBOOK_URL


@pytest.mark.parametrize("where", [None, "https://docs.example.com/mongo-outbox/operating/"])
async def test_each_problem_on_the_page_links_to_its_runbook(
    client: Any, mongo: MongoServer, db: Any, where: str | None
) -> None:
    await park(db)
    await leases(db)  # partition 1 has no owner
    await dead_letter(db, "billing", Event(type="order.paid"))
    async with in_process(client, db, mongo, runbook_url=where or RUNBOOK_URL) as http:
        page = (await http.get("/")).text
    links = re.findall(r'<a class="runbook"[^>]* href="([^"]+)"', page)
    base = where or RUNBOOK_URL
    anchors = operating_anchors()
    assert {link.split("#")[1] for link in links} == {
        "runbook-parked-events",
        "inbox-dead-letters",
        "what-a-crash-costs",
    }
    for link in links:
        page_url, anchor = link.split("#")
        assert page_url == base and anchor in anchors


async def test_the_favicon_is_served_under_the_pages_policy(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    async with in_process(client, db, mongo) as http:
        icon = await http.get("/favicon.ico")
        page = (await http.get("/")).text
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    assert icon.content.startswith(b"<svg") and b"<script" not in icon.content
    assert "default-src 'none'" in icon.headers["content-security-policy"]
    assert '<link rel="icon" href="/favicon.ico"' in page


SPOOF = "t.\u202egnp.exe"
"""Shown raw, a browser draws it as ``t.exe.png``."""


async def test_a_right_to_left_override_is_shown_escaped_and_sent_back_as_stored(
    client: Any, mongo: MongoServer, db: Any
) -> None:
    spoof = await park_type(db, "s", SPOOF)
    plain = await park_type(db, "p", "order.paid")
    await dead_letter(db, "bill\u202eing", Event(type=SPOOF))
    held = utc_now() + timedelta(minutes=5)
    await db.outbox_relays.insert_one(
        {"_id": "rel\u202eay", "owner": "host\u2067-a", "lease_until": held}
    )
    async with in_process(client, db, mongo, credentials=team()) as http:
        await sign_in_as(http, "alice", ALICE)
        page = (await http.get("/")).text
        chosen = (await http.get("/", params={"type": SPOOF})).text
        overview = await http.get("/api/overview")
    # The JSON the page's script shows is escaped as the page is: the relays' signature the
    # page was made with is the one its script builds from the live overview.
    assert "\u202e" not in overview.text and "\u2067" not in overview.text
    relay = next(r for r in overview.json()["relays"] if r["name"].startswith("rel"))
    assert (relay["name"], relay["lease_holder"]) == ("rel\\u202eay", "host\\u2067-a")
    assert 'data-signature="rel\\u202eay|active|host\\u2067-a"' in page
    shown = re.sub(r'value="[^"]*"', "", page)  # what a form sends back is not shown
    assert "\u202e" not in shown
    assert '<td class="type"><bdi>t.\\u202egnp.exe</bdi></td>' in page
    assert "cannot encode t.\\u202egnp.exe" in page and "bill\\u202eing" in page
    # The filter's option and the forms' fields keep the stored text: choosing it finds it.
    assert f'<option value="{SPOOF}">t.\\u202egnp.exe</option>' in page
    assert 'name="consumer" value="bill\u202eing"' in page
    assert "1 of 2 parked events" in chosen and spoof.id in chosen and plain.id not in chosen


async def test_the_command_reads_its_users_file_and_refuses_a_malformed_one(
    mongo: MongoServer, db: Any, tmp_path: Path
) -> None:
    from tests.support.cli import cli, environment

    listed = tmp_path / "users"
    listed.write_text(f"alice:operator:{hash_secret(ALICE)}\nbob:reader:{hash_secret(BOB)}\n")
    await park(db)
    async with served(mongo, db, f"--users-file={listed}", "--require-sign-in") as (_service, url):
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/")).status_code == 401  # sign in first
            await sign_in_as(http, "bob", BOB)
            assert "(reading only)" in (await http.get("/")).text
    listed.write_text("alice:root:scrypt$x\n")
    where = [f"--uri={mongo.uri}", f"--db={db.name}", "--port=0", f"--users-file={listed}"]
    ran = await cli("console", *where, env=environment())
    assert ran.code == 1 and ran.err.strip() == (
        f"mongo-outbox: users file {listed}, line 1: the role must be reader or operator, "
        "not 'root'"
    )
