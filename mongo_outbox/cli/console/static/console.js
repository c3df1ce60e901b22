// The console's live part: polls /api/history, /api/overview (and /api/outboxes for the table
// of several databases) every sample interval, and updates the chart, the backlog numbers and
// the table together, once all three answered. When one does not, it says so on top at once and
// marks what it shows as stale, with its age, never as zeros. The parts the server rendered once
// (relays, parked events, inbox failures) show when they were read, and are marked stale once
// the live numbers say they changed since. No framework, nothing to build.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 600, HEIGHT = 200, LEFT = 56, RIGHT = 56, BOTTOM = 36, TOP = 12;

function element(name, attributes) {
  const made = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) made.setAttribute(key, String(value));
  return made;
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 60) return seconds.toFixed(1) + "s";
  const minutes = Math.floor(seconds / 60), hours = Math.floor(minutes / 60);
  const days = Math.floor(hours / 24);
  const pad = (n) => String(n).padStart(2, "0");
  if (days) return days + "d" + pad(hours % 24) + "h";
  if (hours) return hours + "h" + pad(minutes % 60) + "m";
  return minutes + "m" + pad(Math.floor(seconds) % 60) + "s";
}

function utc(at) {
  return new Date(Date.parse(at)).toISOString().slice(11, 19);
}

function text(svg, content, attributes) {
  const label = element("text", attributes);
  label.textContent = content;
  svg.append(label);
  return label;
}

// A round top for an axis whose values reach ``high``: 1, 2 or 5 times a power of ten.
function roundTop(high) {
  if (high <= 0) return 1;
  const power = Math.pow(10, Math.floor(Math.log10(high)));
  for (const step of [1, 2, 5, 10]) if (step * power >= high) return step * power;
  return 10 * power;
}

function number(value) {
  return Number.isInteger(value) ? String(value) : value.toFixed(value < 10 ? 2 : 1);
}

// Pending events on the left axis (events), published events per second on the right one
// (events/s): two units, each with its own scale. Time runs along the bottom, in UTC. Each
// sample has a point whose tooltip (an SVG <title>, no script) tells its numbers.
function draw(svg, samples) {
  svg.replaceChildren();
  const pendingTop = roundTop(Math.max(...samples.map((s) => s.pending), 0));
  const rateTop = roundTop(Math.max(...samples.map((s) => s.per_second || 0), 0));
  const right = WIDTH - RIGHT, bottom = HEIGHT - BOTTOM;
  const x = (i) => LEFT + (samples.length < 2 ? 0 : (i * (right - LEFT)) / (samples.length - 1));
  const y = (v, top) => bottom - (v * (bottom - TOP)) / top;
  svg.append(element("line", { x1: LEFT, y1: bottom, x2: right, y2: bottom, class: "axis" }));
  svg.append(element("line", { x1: LEFT, y1: TOP, x2: LEFT, y2: bottom, class: "axis pending" }));
  svg.append(element("line", { x1: right, y1: TOP, x2: right, y2: bottom, class: "axis published" }));
  for (const fraction of [0, 0.5, 1]) {
    const at = y(fraction, 1) + 4;
    text(svg, number(pendingTop * fraction), { x: LEFT - 4, y: at, "text-anchor": "end", class: "tick" });
    text(svg, number(rateTop * fraction), { x: right + 4, y: at, "text-anchor": "start", class: "tick" });
    if (fraction) svg.append(element("line", { x1: LEFT, y1: at - 4, x2: right, y2: at - 4, class: "grid" }));
  }
  const middle = (TOP + bottom) / 2;
  text(svg, "pending (events)", {
    x: 12, y: middle, "text-anchor": "middle", class: "axis-label pending", id: "chart-y-label",
    transform: `rotate(-90 12 ${middle})`,
  });
  text(svg, "published (events/s)", {
    x: WIDTH - 8, y: middle, "text-anchor": "middle", class: "axis-label published",
    id: "chart-y2-label", transform: `rotate(90 ${WIDTH - 8} ${middle})`,
  });
  text(svg, "time (UTC)", {
    x: (LEFT + right) / 2, y: HEIGHT - 4, "text-anchor": "middle", class: "axis-label",
    id: "chart-x-label",
  });
  if (samples.length) {
    const last = samples.length - 1;
    const ends = samples.length > 1 ? [[0, "start"], [last, "end"]] : [[0, "start"]];
    for (const [i, anchor] of ends) {
      text(svg, utc(samples[i].at), { x: x(i), y: bottom + 14, "text-anchor": anchor, class: "tick" });
    }
  }
  const lines = [["pending", pendingTop], ["per_second", rateTop]];
  for (const [field, top] of lines) {
    const points = samples
      .map((s, i) => (s[field] === null ? null : x(i).toFixed(1) + "," + y(s[field], top).toFixed(1)))
      .filter((p) => p !== null);
    const name = field === "pending" ? "pending" : "published";
    if (points.length) svg.append(element("polyline", { points: points.join(" "), class: "line " + name }));
  }
  samples.forEach((s, i) => {
    const rate = s.per_second === null ? "no rate yet (first sample)"
      : number(s.per_second) + " published/s (" + s.published + " since the previous sample)";
    const point = element("circle", { cx: x(i), cy: y(s.pending, pendingTop), r: 3, class: "point pending" });
    const tip = element("title", {});
    tip.textContent = utc(s.at) + " UTC: " + s.pending + " pending, " + s.parked + " parked, " + rate;
    point.append(tip);
    svg.append(point);
  });
  svg.dataset.samples = String(samples.length);
}

const STALE = "stale";
let lastGood = null;  // when everything live was last updated (ms), null before the first poll

function clock(ms) {
  return new Date(ms).toISOString().slice(11, 19) + " UTC";
}

function ago(ms) {
  return age(Math.max(0, (Date.now() - ms) / 1000)) + " ago";
}

function set(id, text) {
  const found = document.getElementById(id);
  if (found) found.textContent = text;
}

// The relays and partitions as a text, built as the page builds its data-signature.
function signature(overview) {
  const rows = overview.relays.map((r) => [r.name, r.state, r.lease_holder ?? ""].join("|"));
  for (const g of overview.groups) {
    for (const p of g.partitions) rows.push([g.name, p.partition, p.state, p.lease_holder ?? ""].join("|"));
  }
  return rows.join(";");
}

async function fetchAll(paths) {
  // Every answer, or the first problem: a status other than 200, or no answer at all.
  const answers = await Promise.all(paths.map((path) =>
    fetch(path, { credentials: "same-origin" }).then(async (r) => ({ status: r.status, body: await r.json().catch(() => null) }))));
  const failed = answers.find((a) => a.status !== 200);
  if (failed) {
    const why = failed.body && failed.body.error ? failed.body.error : "status " + failed.status;
    throw new Error(failed.status === 503 ? "MongoDB did not answer: " + why : why);
  }
  return answers.map((a) => a.body);
}

function showOutage(problem) {
  const banner = document.getElementById("outage");
  if (!banner) return;
  const since = banner.dataset.since ? Number(banner.dataset.since) : Date.now();
  banner.dataset.since = String(since);
  const shown = lastGood === null ? Date.parse(document.body.dataset.readAt) : lastGood;
  banner.replaceChildren();
  const strong = document.createElement("strong");
  strong.textContent = problem;
  banner.append(strong, " (since " + clock(since) + "). The numbers below are from "
    + clock(shown) + ", " + ago(shown) + ", and are not updated.");
  if (banner.dataset.runbook) {
    const runbook = document.createElement("a");
    runbook.className = "runbook";
    runbook.href = banner.dataset.runbook;
    runbook.textContent = "runbook";
    banner.append(" ", runbook);
  }
  banner.hidden = false;
}

function clearOutage() {
  const banner = document.getElementById("outage");
  if (!banner) return;
  delete banner.dataset.since;
  if (document.body.dataset.unread) {
    // Loaded while MongoDB did not answer: the parts it could not read are not on the page.
    banner.replaceChildren("MongoDB answers again: ");
    const reload = document.createElement("a");
    reload.href = window.location.href;
    reload.textContent = "reload the page";
    banner.append(reload, " to read what could not be read.");
  } else {
    banner.hidden = true;
  }
}

function markLive(stale) {
  const when = lastGood === null ? Date.parse(document.body.dataset.readAt) : lastGood;
  for (const section of document.querySelectorAll("section.live")) {
    section.classList.toggle(STALE, stale);
    const caption = section.querySelector(".live-as-of");
    if (caption) caption.textContent = stale
      ? "stale: as of " + clock(when) + ", " + ago(when) + ", not updated since"
      : "live: updated at " + clock(when);
  }
}

function markReadOnce(overview) {
  const readAt = Date.parse(document.body.dataset.readAt);
  const failed = overview ? overview.inbox_failures.reduce((sum, f) => sum + f.failed, 0) : null;
  const now = { parked: overview ? overview.parked : null, inbox: failed,
                relays: overview ? signature(overview) : null };
  for (const section of document.querySelectorAll("section.read-once")) {
    const shown = section.id === "relays" ? section.dataset.signature : Number(section.dataset.total);
    const changed = now[section.id] !== null && now[section.id] !== undefined && now[section.id] !== shown;
    section.classList.toggle(STALE, changed);
    const caption = section.querySelector(".as-of");
    if (!caption) continue;
    caption.replaceChildren("read at " + clock(readAt) + ", " + ago(readAt));
    if (changed) {
      const reload = document.createElement("a");
      reload.href = window.location.href;
      reload.textContent = "reload";
      caption.append(" · stale: changed since (", reload, ")");
    }
  }
}

let lastOverview = null;

async function poll() {
  const svg = document.getElementById("chart");
  const status = document.getElementById("chart-status");
  const db = new URLSearchParams({ db: document.body.dataset.db || "" }).toString();
  const paths = ["/api/history?" + db, "/api/overview?" + db];
  const table = document.getElementById("outboxes");
  if (table) paths.push("/api/outboxes");
  try {
    const [history, overview, outboxes] = await fetchAll(paths);
    if (svg) draw(svg, history.samples);
    if (status) status.textContent = history.error ? "sampling failed: " + history.error
      : history.samples.length + " samples";
    set("pending", String(overview.pending));
    set("oldest", age(overview.oldest_pending_age_seconds));
    set("parked-count", String(overview.parked));
    const card = document.getElementById("parked-count");
    if (card) card.closest(".card").classList.toggle("bad", overview.parked > 0);
    const runbook = document.getElementById("parked-runbook");
    if (runbook) runbook.hidden = overview.parked === 0;
    if (table) {
      for (const o of outboxes.outboxes) {
        const row = [...table.querySelectorAll("tr.outbox")].find((r) => r.dataset.database === o.database);
        if (!row) continue;
        row.querySelector(".pending").textContent = String(o.pending);
        row.querySelector(".oldest").textContent = age(o.oldest_pending_age_seconds);
        row.querySelector(".parked").textContent = String(o.parked);
        row.querySelector(".parked").classList.toggle("bad", o.parked > 0);
      }
    }
    lastGood = Date.now();
    lastOverview = overview;
    clearOutage();
    markLive(false);
  } catch (problem) {
    const text = problem instanceof TypeError ? "the console does not answer" : problem.message;
    showOutage(text);
    markLive(true);
    if (status) status.textContent = "not updated: " + text;
  }
  markReadOnce(lastOverview);
}

document.addEventListener("DOMContentLoaded", () => {
  const every = Number(document.body.dataset.sampleEvery || "5") * 1000;
  poll();
  setInterval(poll, Math.max(1000, every));
});
