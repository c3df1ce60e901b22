"""The web console in a real browser: Debian's chromium (``.ci/run`` installs it), driven by
Playwright through ``executable_path``, never a browser Playwright downloads. The real
``mongo-outbox console`` command serves the test MongoDB's outbox.

Every step waits for what it needs on the page (Playwright's auto-waiting selectors and
``expect``), never for a time. With ``MONGO_OUTBOX_CONSOLE_SCREENSHOT=path`` the signed-in page
is saved there (how docs/img/console.png is made).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mongo_outbox import Event, Inbox, Outbox
from mongo_outbox.admin import OutboxAdmin
from mongo_outbox.cli.console.auth import hash_secret
from tests.support.console import (
    TOKEN,
    dead_letter,
    leases,
    park,
    park_one,
    park_type,
    served,
)
from tests.support.hanging_mongo import HangingMongo
from tests.support.servers import MongoServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"),
    reason="no chromium here (apt-get install chromium); CI installs it and never skips",
)


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    assert CHROMIUM is not None, "chromium is missing: apt-get install chromium"
    async with async_playwright() as playwright:
        # --no-sandbox: CI runs as root, where chromium's sandbox cannot start.
        launched = await playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        yield launched
        await launched.close()


async def parked_ids(db: Any) -> set[str]:
    return {e.event_id for e in (await OutboxAdmin(Outbox(db)).parked()).entries}


@pytest.mark.slow
async def test_an_operator_filters_signs_in_and_requeues_in_the_browser(
    browser: Any, mongo: MongoServer, db: Any
) -> None:
    from playwright.async_api import expect

    # Generous deadlines for a loaded machine; each wait ends as soon as its condition holds.
    expect.set_options(timeout=15_000)
    saved = await park(db)
    outbox = Outbox(db)
    for i in range(3):  # a backlog, for the numbers and the chart
        await outbox.save_with_events(None, db.orders, {"_id": f"p{i}"}, [Event(type="placed")])
    await leases(db)
    paid = Event(type="order.paid")
    await dead_letter(db, "billing", paid)
    bad = saved["b"][0].id
    env = {"MONGO_OUTBOX_CONSOLE_TOKEN": TOKEN}
    async with served(mongo, db, "--sample-interval=0.5", env=env) as (_, url):
        context = await browser.new_context(viewport={"width": 1280, "height": 900})
        context.set_default_timeout(15_000)
        page = await context.new_page()
        await page.goto(url)

        # The page loads, and its script (allowed by the page's policy) polls and draws.
        await expect(page).to_have_title("mongo-outbox console")
        await expect(page.locator("#parked-count")).to_have_text("4")
        await expect(page.locator("#pending")).to_have_text("3")
        await expect(page.locator("#chart polyline.pending")).to_have_count(1)
        await expect(page.locator("#chart-status")).to_have_text(re.compile(r"^\d+ samples$"))
        await expect(page.locator("#relays")).to_contain_text("no owner")
        await expect(page.locator("#inbox")).to_contain_text("the bug")

        # The filter keeps one type.
        await page.select_option("#filter-type", "bad")
        await page.click("#filter button[type=submit]")
        await expect(page.locator("#parked-shown")).to_have_text("1 of 4 parked events")
        await expect(page.locator("tr.parked")).to_have_count(1)
        await expect(page.locator(f'tr.parked[data-event-id="{bad}"]')).to_have_count(1)

        # Not signed in: nothing to click, and a forged POST with the session's own CSRF
        # token is refused.
        await expect(page.locator("#requeue-chosen")).to_have_count(0)
        csrf = await page.locator("#login input[name=csrf]").get_attribute("value")
        refused = await page.request.post(
            url + "parked/requeue", form={"csrf": csrf, "event_id": bad}
        )
        assert refused.status == 401
        assert bad in await parked_ids(db)

        # Wrong token: refused; the right one signs in.
        await page.fill("#login input[name=token]", "not-the-token-at-all")
        await page.click("#login button[type=submit]")
        await expect(page.locator("#refused")).to_have_text("wrong credentials")
        await page.goto(url)
        await page.fill("#login input[name=token]", TOKEN)
        await page.click("#login button[type=submit]")
        await expect(page.locator("#notice")).to_have_text("signed in as token")

        # Signed in, a POST without the page's CSRF token is still refused.
        forged = await page.request.post(
            url + "parked/requeue", form={"csrf": "forged", "event_id": bad}
        )
        assert forged.status == 403
        assert bad in await parked_ids(db)

        if os.environ.get("MONGO_OUTBOX_CONSOLE_SCREENSHOT"):
            await expect(page.locator("#chart polyline.published")).to_have_count(1)
            await page.screenshot(
                path=os.environ["MONGO_OUTBOX_CONSOLE_SCREENSHOT"], full_page=True
            )

        # A requeue through the form changes the database.
        await page.goto(url + "?type=bad")
        await page.check(f'input[name=event_id][value="{bad}"]')
        await page.click("#requeue-chosen")
        await expect(page.locator("#notice")).to_have_text("requeued 1 parked events")
        assert bad not in await parked_ids(db)
        await expect(page.locator("#parked-count")).to_have_text("3")

        await page.click(f'tr.failed[data-message-id="{paid.id}"] button')
        await expect(page.locator("#notice")).to_contain_text("requeued 1 failed messages")
        assert await Inbox(db, consumer="billing").failed() == []
        await context.close()


@pytest.mark.slow
async def test_an_open_page_refreshes_what_it_shows_together_and_tells_an_outage_at_once(
    browser: Any, mongo: MongoServer, db: Any
) -> None:
    from playwright.async_api import expect

    expect.set_options(timeout=15_000)
    other = db.client[f"{db.name}_b"]
    try:
        await park(db)
        async with HangingMongo(mongo.uri) as path:
            names = f"--databases={db.name},{other.name}"
            async with served(mongo, db, names, "--sample-interval=0.5", uri=path.uri) as (
                _,
                url,
            ):
                page = await browser.new_page()
                await page.goto(url)
                await expect(page.locator("#parked-count")).to_have_text("4")
                await expect(page.locator("#outage")).to_be_hidden()
                await expect(page.locator("#backlog .live-as-of")).to_contain_text("live")
                row = page.locator(f'tr.outbox[data-database="{other.name}"]')
                await expect(row.locator(".pending")).to_have_text("0")

                # The table of databases follows the other database's backlog.
                await Outbox(other).save_with_events(
                    None, other.orders, {"_id": 1}, [Event(type="x")]
                )
                await expect(row.locator(".pending")).to_have_text("1")

                # The live count moves on; the list read with the page says it is stale.
                await expect(page.locator("#parked")).not_to_have_class(re.compile("stale"))
                await park_one(db, "d")
                await expect(page.locator("#parked-count")).to_have_text("5")
                await expect(page.locator("#parked")).to_have_class(re.compile("stale"))
                await expect(page.locator("#parked .as-of")).to_contain_text("changed since")
                await expect(page.locator("#parked-shown")).to_have_text("4 of 4 parked events")

                # MongoDB down: said on top at once; the numbers are marked stale, not zeroed.
                await path.cut()
                await expect(page.locator("#outage")).to_be_visible()
                await expect(page.locator("#outage")).to_contain_text("MongoDB did not answer")
                await expect(page.locator("#backlog")).to_have_class(re.compile("stale"))
                await expect(page.locator("#outboxes")).to_have_class(re.compile("stale"))
                await expect(page.locator("#backlog .live-as-of")).to_contain_text("stale: as of")
                await expect(page.locator("#parked-count")).to_have_text("5")

                # A fresh load says it too, and shows no number it could not read.
                fresh = await browser.new_page()
                await fresh.goto(url)
                await expect(fresh.locator("#outage")).to_contain_text("MongoDB did not answer")
                await expect(fresh.locator("#parked-count")).to_have_count(0)
                await expect(fresh.locator("#parked")).to_contain_text("Not read")
                await expect(fresh.locator("#inbox")).not_to_contain_text("No failed messages")

                await path.mend()
                await expect(page.locator("#outage")).to_be_hidden()
                await expect(page.locator("#backlog")).not_to_have_class(re.compile("stale"))
                await expect(fresh.locator("#outage")).to_contain_text("answers again")
    finally:
        await db.client.drop_database(other.name)


# The left edge of each character of an element's first text, in the order of the text: a text
# drawn as written has them increasing; a reordered one does not.
EDGES = """(element) => {
  const text = element.firstChild, edges = [];
  for (let i = 0; i < text.length; i++) {
    const range = document.createRange();
    range.setStart(text, i);
    range.setEnd(text, i + 1);
    edges.push(range.getBoundingClientRect().left);
  }
  return edges;
}"""

SPOOF = "t.\u202egnp.exe"


@pytest.mark.slow
async def test_a_right_to_left_override_is_drawn_escaped_in_order_and_nothing_fails_to_load(
    browser: Any, mongo: MongoServer, db: Any
) -> None:
    from playwright.async_api import expect

    expect.set_options(timeout=15_000)
    await park_type(db, "s", SPOOF)
    async with served(mongo, db) as (_, url):
        page = await browser.new_page()
        failed: list[str] = []
        page.on("response", lambda r: failed.append(r.url) if r.status >= 400 else None)
        page.on("console", lambda m: failed.append(m.text) if m.type == "error" else None)
        await page.goto(url)
        shown = page.locator("tr.parked td.type bdi")
        await expect(shown).to_have_text("t.\\u202egnp.exe")
        edges = await shown.evaluate(EDGES)
        assert edges == sorted(edges) and len(set(edges)) == len(edges), edges

        # The same measure on the raw text sees the override reorder it: it would catch one.
        raw = await page.evaluate(
            """(text) => {
              const span = document.createElement("span");
              span.id = "raw";
              span.textContent = text;
              document.body.append(span);
            }""",
            SPOOF,
        )
        assert raw is None
        raw_edges = await page.locator("#raw").evaluate(EDGES)
        assert raw_edges != sorted(raw_edges)

        icon = await page.request.get(url + "favicon.ico")
        assert icon.status == 200 and icon.headers["content-type"] == "image/svg+xml"
        await expect(page.locator("#chart-status")).to_have_text(re.compile(r"^\d+ samples$"))
        assert failed == []
        await page.close()


@pytest.mark.slow
async def test_a_reader_and_an_operator_at_once_and_a_requeue_of_everything_confirmed(
    browser: Any, mongo: MongoServer, db: Any, tmp_path: Path
) -> None:
    from playwright.async_api import expect

    expect.set_options(timeout=15_000)
    await park(db)
    users = tmp_path / "users"
    alice, bob = "alice-secret-0123", "bob-secret-456789"
    users.write_text(f"alice:operator:{hash_secret(alice)}\nbob:reader:{hash_secret(bob)}\n")
    async with served(mongo, db, f"--users-file={users}") as (service, url):
        pages = []
        for name, secret in (("bob", bob), ("alice", alice)):
            context = await browser.new_context()
            page = await context.new_page()
            await page.goto(url)
            await page.fill("#login input[name=user]", name)
            await page.fill("#login input[name=password]", secret)
            await page.click("#login button[type=submit]")
            pages.append(page)
        reader, operator = pages
        await expect(reader.locator("#notice")).to_have_text("signed in as bob (reading only)")
        await expect(reader.locator("#who")).to_contain_text("bob")
        await expect(reader.locator("#requeue-matching")).to_have_count(0)
        await expect(reader.locator("input[name=event_id]")).to_have_count(0)
        await expect(operator.locator("#notice")).to_have_text("signed in as alice")

        # A requeue of everything asks first, on a page of its own; nothing moved yet.
        await operator.click("#requeue-matching button")
        await expect(operator.locator("#asks")).to_have_text(
            f"Requeue all 4 parked events in {db.name}?"
        )
        assert len(await parked_ids(db)) == 4
        await operator.click("#confirm-requeue")
        await expect(operator.locator("#notice")).to_have_text("requeued 4 parked events")
        assert await parked_ids(db) == set()
        await reader.reload()
        await expect(reader.locator("#parked-count")).to_have_text("0")
        ran = await service.stop(signal.SIGTERM)
    assert ran.code == 0, ran.output
    assert (
        f'mongo_outbox.cli.console.audit: "alice" (operator) from 127.0.0.1 requeued 4 parked '
        f'events in "{db.name}": every parked event' in ran.output
    )


@pytest.mark.slow
async def test_a_detail_page_opens_from_the_list_and_the_chart_has_labelled_axes(
    browser: Any, mongo: MongoServer, db: Any
) -> None:
    from playwright.async_api import expect

    expect.set_options(timeout=15_000)
    saved = await park(db)
    bad = saved["b"][0]
    async with served(mongo, db, "--sample-interval=0.5") as (_, url):
        page = await browser.new_page()
        failed: list[str] = []
        page.on("response", lambda r: failed.append(r.url) if r.status >= 400 else None)
        page.on("console", lambda m: failed.append(m.text) if m.type == "error" else None)
        await page.goto(url)

        # The chart, drawn by the page's own script under its policy: both axes say what they
        # measure, the time axis too, and each sample's point has a tooltip.
        await expect(page.locator("#chart-y-label")).to_have_text("pending (events)")
        await expect(page.locator("#chart-y2-label")).to_have_text("published (events/s)")
        await expect(page.locator("#chart-x-label")).to_have_text("time (UTC)")
        tip = page.locator("#chart circle.point title").first
        await expect(tip).to_have_text(re.compile(r"^\d\d:\d\d:\d\d UTC: 0 pending, 4 parked, "))

        # The parked event's id opens its detail page.
        await page.click(f'tr.parked[data-event-id="{bad.id}"] a.event-link')
        await expect(page.locator("#event-type")).to_have_text("bad")
        await expect(page.locator("#event-status")).to_have_text("parked")
        await expect(page.locator("#event-error")).to_contain_text("cannot encode")
        await expect(page.locator("#broker-headers")).to_contain_text("aggregate-id")

        # The search box finds the aggregate's events.
        await page.fill("#search-q", "c")
        await page.click("#search button[type=submit]")
        await expect(page.locator("tr.listed")).to_have_count(2)
        assert failed == []
        await page.close()
