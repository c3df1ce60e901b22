// The console's live part: polls /api/history and /api/overview every sample interval and
// redraws the chart (inline SVG) and the backlog numbers. No framework, nothing to build.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 600, HEIGHT = 160, LEFT = 40, BOTTOM = 20, TOP = 10;

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

function draw(svg, samples) {
  svg.replaceChildren();
  const top = Math.max(1, ...samples.map((s) => Math.max(s.pending, s.published || 0)));
  const x = (i) => LEFT + (samples.length < 2 ? 0 : (i * (WIDTH - LEFT - 5)) / (samples.length - 1));
  const y = (v) => HEIGHT - BOTTOM - (v * (HEIGHT - BOTTOM - TOP)) / top;
  svg.append(element("line", { x1: LEFT, y1: y(0), x2: WIDTH, y2: y(0), class: "axis" }));
  for (const value of [0, top]) {
    const label = element("text", { x: LEFT - 4, y: y(value) + 4, "text-anchor": "end", class: "tick" });
    label.textContent = String(value);
    svg.append(label);
  }
  if (samples.length > 1) {
    const span = (Date.parse(samples[samples.length - 1].at) - Date.parse(samples[0].at)) / 1000;
    for (const [at, text, anchor] of [[x(0), "-" + age(span), "start"], [WIDTH - 5, "now", "end"]]) {
      const label = element("text", { x: at, y: HEIGHT - 5, "text-anchor": anchor, class: "tick" });
      label.textContent = text;
      svg.append(label);
    }
  }
  for (const [field, name] of [["pending", "pending"], ["published", "published"]]) {
    const points = samples
      .map((s, i) => (s[field] === null ? null : x(i).toFixed(1) + "," + y(s[field]).toFixed(1)))
      .filter((p) => p !== null);
    if (points.length) svg.append(element("polyline", { points: points.join(" "), class: "line " + name }));
  }
  svg.dataset.samples = String(samples.length);
}

async function poll() {
  const svg = document.getElementById("chart");
  const status = document.getElementById("chart-status");
  try {
    const db = new URLSearchParams({ db: document.body.dataset.db || "" }).toString();
    const [history, overview] = await Promise.all(
      ["/api/history?" + db, "/api/overview?" + db].map((path) =>
        fetch(path, { credentials: "same-origin" }).then((r) => r.json())),
    );
    if (svg) draw(svg, history.samples);
    if (status) status.textContent = history.error ? "sampling failed: " + history.error
      : history.samples.length + " samples";
    if (!overview.error) {
      const set = (id, text) => { const e = document.getElementById(id); if (e) e.textContent = text; };
      set("pending", String(overview.pending));
      set("oldest", age(overview.oldest_pending_age_seconds));
      set("parked-count", String(overview.parked));
    }
  } catch (problem) {
    if (status) status.textContent = "console unreachable";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const every = Number(document.body.dataset.sampleEvery || "5") * 1000;
  poll();
  setInterval(poll, Math.max(1000, every));
});
