// The Shinken viewer: every page of /ui. No build step, no dependencies.
// Safety rule: every string from the server goes into the DOM through textContent, a property
// (title, href/src built with encodeURIComponent) or a data attribute; never innerHTML.
"use strict";

const UI = "/ui";
const app = document.getElementById("app");
const viewer = (window.__viewer = { ready: false, page: document.body.dataset.page });

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key === "style") node.style.cssText = value;  // CSSOM: allowed by the page's CSP, unlike a style attribute
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key in node && typeof value !== "string") node[key] = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

function setReady() {
  viewer.ready = true;
  document.body.dataset.ready = "1";
  performance.mark("viewer-interactive");
}

async function getJSON(url) {
  const response = await fetch(url, { credentials: "same-origin", cache: "no-store" });
  if (response.status === 401) { location.assign(UI + "/login?next=" + encodeURIComponent(location.pathname)); throw new Error("401"); }
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(typeof body.error === "string" ? body.error : "HTTP " + response.status);
  return body;
}

function fmtTime(t) {
  if (t === null || t === undefined) return "—";
  return new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19);
}

function showError(where, err) {
  where.replaceChildren(el("p", { class: "error", text: String(err && err.message ? err.message : err) }));
}

function sessionPath(id) { return UI + "/sessions/" + encodeURIComponent(id); }
function imageURL(sessionId, sha) {
  return UI + "/api/sessions/" + encodeURIComponent(sessionId) + "/images/" + encodeURIComponent(sha);
}

// -- login --------------------------------------------------------------------------------------

function loginPage() {
  const nav = performance.getEntriesByType("navigation")[0];
  const failed = nav && nav.responseStatus === 401 && location.pathname === UI + "/login";
  const params = new URLSearchParams(location.search);
  const next = location.pathname === UI + "/login" ? (params.get("next") || UI + "/") : location.pathname + location.search;
  app.replaceChildren(
    el("h1", { text: "Log in to the viewer" }),
    el("p", { class: "muted", text: "The server's API key (as in Authorization: Bearer <key>)." }),
    failed ? el("p", { class: "error", id: "login-error", text: "Wrong key." }) : null,
    el("form", { class: "login", method: "post", action: UI + "/login" },
      el("input", { type: "password", name: "key", id: "key", autocomplete: "current-password", placeholder: "API key", autofocus: "" }),
      el("input", { type: "hidden", name: "next", value: next }),
      el("button", { type: "submit", text: "Log in" })));
  setReady();
}

// -- sessions list ------------------------------------------------------------------------------

const COLUMNS = [
  ["session_id", "id"], ["turns", "turns"], ["tokens", "tokens"], ["images", "images"],
  ["created", "created"], ["last_turn", "last turn"], ["status", "status"], ["instance", "instance"],
];
const SORTABLE = new Set(["session_id", "turns", "tokens", "images", "created", "last_turn"]);

function sessionsPage() {
  const params = new URLSearchParams(location.search);
  const state = { sort: params.get("sort") || "created", order: params.get("order") || "desc",
                  prefix: params.get("prefix") || "", offset: Number(params.get("offset") || 0), limit: 50 };
  const prefix = el("input", { type: "search", id: "prefix", placeholder: "filter by id prefix", value: state.prefix });
  const info = el("span", { class: "muted", id: "count" });
  const prev = el("button", { text: "‹ prev", id: "prev" });
  const next = el("button", { text: "next ›", id: "next" });
  const table = el("table", { class: "list", id: "sessions" });
  const problems = el("p", { class: "error" });
  app.replaceChildren(el("h1", { text: "Sessions" }), el("div", { class: "controls" }, prefix, prev, next, info), problems, table);

  async function load() {
    const q = new URLSearchParams({ sort: state.sort, order: state.order, offset: state.offset, limit: state.limit, prefix: state.prefix });
    history.replaceState(null, "", location.pathname + "?" + q);
    let data;
    try { data = await getJSON(UI + "/api/sessions?" + q); } catch (err) { showError(problems, err); return; }
    problems.textContent = data.unavailable.length ? "Not listed: " + data.unavailable.join("; ") : "";
    const head = el("tr", {}, ...COLUMNS.map(([key, label]) => el("th", {
      text: label + (state.sort === key ? (state.order === "desc" ? " ▾" : " ▴") : ""),
      onclick: SORTABLE.has(key) ? () => { state.order = state.sort === key && state.order === "desc" ? "asc" : "desc"; state.sort = key; state.offset = 0; load(); } : null,
    })));
    const rows = data.sessions.map((s) => el("tr", { "data-session": s.session_id },
      el("td", { class: "id" }, el("a", { href: sessionPath(s.session_id), text: s.session_id })),
      el("td", { text: String(s.turns) }), el("td", { text: String(s.tokens) }), el("td", { text: String(s.images) }),
      el("td", { text: fmtTime(s.created) }), el("td", { text: fmtTime(s.last_turn) }),
      el("td", { text: s.status }), el("td", { text: s.instance === null ? "—" : String(s.instance) })));
    table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...rows));
    info.textContent = data.total ? `${data.offset + 1}–${data.offset + data.sessions.length} of ${data.total}` : "no sessions";
    prev.disabled = data.offset === 0;
    next.disabled = data.offset + data.sessions.length >= data.total;
    if (!viewer.ready) setReady();
  }
  let typing = null;
  prefix.addEventListener("input", () => { clearTimeout(typing); typing = setTimeout(() => { state.prefix = prefix.value; state.offset = 0; load(); }, 200); });
  prev.addEventListener("click", () => { state.offset = Math.max(0, state.offset - state.limit); load(); });
  next.addEventListener("click", () => { state.offset += state.limit; load(); });
  load();
  setInterval(load, 5000);
}

// -- one session --------------------------------------------------------------------------------

function partsNode(sessionId, parts, images) {
  const box = el("div", {});
  for (const part of parts) {
    if ("text" in part) box.append(el("pre", { text: part.text }));
    else if ("image" in part) {
      const meta = images[part.image] || {};
      const w = meta.width || 320, h = meta.height || 180;
      const shown = Math.min(360, w);
      box.append(el("img", { class: "shot", loading: "lazy", decoding: "async", alt: "screenshot " + part.image.slice(0, 12),
                             width: String(shown), height: String(Math.round((h * shown) / w)), src: imageURL(sessionId, part.image),
                             "data-sha256": part.image }));
    }
  }
  return box;
}

function messageNode(sessionId, m, images) {
  const node = el("div", { class: "msg" }, el("div", { class: "role", text: m.role + (m.name ? " · " + m.name : "") }),
                  partsNode(sessionId, m.parts, images));
  for (const call of m.tool_calls || []) {
    node.append(el("pre", { text: "tool call " + String(call.name) + " " + (typeof call.arguments === "string" ? call.arguments : JSON.stringify(call.arguments)) }));
  }
  return node;
}

function turnNode(data, turn) {
  const head = el("div", { class: "head" }, el("b", { text: "Turn " + (turn.index + 1) }),
    turn.rollback ? el("span", { class: "badge rb", text: "rollback: replaced the previous reply" }) : null,
    el("span", { class: "badge", text: "finish " + String(turn.finish_reason) }),
    el("span", { class: "badge", text: Math.round(turn.latency * 1000) + " ms" }),
    el("span", { class: "badge", text: turn.prompt_tokens + " prompt / " + turn.output_tokens + " output tokens" }),
    turn.context_messages ? el("span", { class: "muted", text: "+ " + turn.context_messages + " earlier messages" }) : null);
  const card = el("section", { class: "turn" + (turn.rollback ? " rollback" : ""), id: "turn-" + turn.index, "data-turn": String(turn.index) }, head);
  for (const m of turn.messages) card.append(messageNode(data.session_id, m, data.images));
  const reply = el("div", { class: "reply" }, el("div", { class: "role", text: "model reply" }), partsNode(data.session_id, turn.reply.parts, data.images));
  for (const call of turn.reply.tool_calls || []) reply.append(el("pre", { text: "tool call " + String(call.name) + " " + String(call.arguments) }));
  card.append(reply);
  card.append(el("div", { class: "action" }, el("div", { class: "role", text: "parsed action" }),
                 el("pre", { text: turn.action === null ? "(none)" : JSON.stringify(turn.action) })));
  return card;
}

// Probability -> colour of a trained token: red (unlikely) to green (certain).
function logprobColour(lp) {
  const p = Math.exp(Math.max(-20, lp));
  return `hsl(${Math.round(120 * p)}, 70%, 78%)`;
}

const ROW_H = 20, IMAGE_ROW_H = 64, ROW_CHARS = 110;

// The token view: rows laid out once (text breaks at newlines, at ROW_CHARS, at each turn's
// output start; an image pad run is one taller row), then only the rows in view are in the DOM.
function tokenView(data, holder) {
  const t = data.tokens;
  const runs = t.image_runs;
  const outputStarts = new Map(t.turn_starts.map((pos, i) => [pos, i]));
  const rows = [];
  let row = null, pos = 0, chars = 0;
  const open = (i, label, cls) => { row = { from: i, to: i, top: 0, h: ROW_H, pos, label, cls }; rows.push(row); chars = 0; };
  for (let i = 0; i < t.ids.length; i++) {
    const id = t.ids[i];
    const turn = outputStarts.get(pos);
    if (id < 0) {
      open(i, "", "");
      row.h = IMAGE_ROW_H; row.to = i + 1;
      pos += runs[-id - 1].count;
      row = null;
      continue;
    }
    if (turn !== undefined) open(i, "turn " + (turn + 1), "turnstart" + (data.turns[turn] && data.turns[turn].rollback ? " rb" : ""));
    else if (row === null || chars >= ROW_CHARS) open(i, "", "");
    const text = t.vocab[id] || "";
    row.to = i + 1; chars += text.length; pos += 1;
    if (text.includes("\n")) row = null;
  }
  let top = 0;
  for (const r of rows) { r.top = top; top += r.h; }
  const spacer = el("div", { style: `height:${top}px` });
  const box = el("div", { class: "tokens", id: "tokens" }, spacer);
  holder.append(box);
  const positions = new Int32Array(t.ids.length + 1);  // entry -> its first position in the sequence
  for (let i = 0, p = 0; i < t.ids.length; i++) { positions[i] = p; p += t.ids[i] < 0 ? runs[-t.ids[i] - 1].count : 1; }

  function tokenNode(i) {
    const id = t.ids[i], kind = t.kinds[i], lp = t.logprobs[i];
    if (id < 0) {
      const run = runs[-id - 1];
      const node = el("span", { class: "tok img k" + kind, "data-pos": String(positions[i]), "data-kind": kind,
                                title: `positions ${run.start}–${run.start + run.count - 1}: ${run.count} image pad tokens` });
      if (run.sha256) node.append(el("img", { loading: "lazy", alt: "image " + run.sha256.slice(0, 12), src: imageURL(data.session_id, run.sha256), "data-sha256": run.sha256 }));
      node.append(el("span", { text: `[image × ${run.count} tokens]` }));
      return node;
    }
    const text = (t.vocab[id] || "").replace(/\n/g, "↵");
    const node = el("span", { class: "tok k" + kind, text, "data-pos": String(positions[i]), "data-kind": kind,
                              title: `pos ${positions[i]} · id ${id}` + (lp === null ? "" : ` · logprob ${lp}`) +
                                     (kind === "1" ? " · trained" : kind === "2" ? " · model token, not in the sample" : " · masked") });
    if (kind === "1") node.style.backgroundColor = logprobColour(lp === null ? 0 : lp);
    return node;
  }

  let shown = "";
  function render() {
    const y0 = box.scrollTop - 200, y1 = box.scrollTop + box.clientHeight + 200;
    let lo = 0, hi = rows.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (rows[mid].top + rows[mid].h < y0) lo = mid + 1; else hi = mid; }
    let end = lo;
    while (end < rows.length && rows[end].top < y1) end++;
    const key = lo + ":" + end;
    if (key === shown) return;
    shown = key;
    const nodes = [];
    for (let r = lo; r < end; r++) {
      const spec = rows[r];
      const line = el("div", { class: "row " + spec.cls, style: `top:${spec.top}px;height:${spec.h}px` },
                      el("span", { class: "gutter", text: spec.label || String(spec.pos) }));
      for (let i = spec.from; i < spec.to; i++) line.append(tokenNode(i));
      nodes.push(line);
    }
    box.replaceChildren(spacer, ...nodes);
  }
  box.addEventListener("scroll", () => requestAnimationFrame(render), { passive: true });
  render();
  viewer.tokenRows = rows.length;
  viewer.scrollToPos = (p) => {  // tests and links: bring a sequence position into view
    let i = 0;
    while (i + 1 < t.ids.length && positions[i + 1] <= p) i++;
    const r = rows.find((x) => x.from <= i && i < x.to);
    if (r) { box.scrollTop = r.top; shown = ""; render(); }
  };
}

async function sessionPage() {
  const id = decodeURIComponent(location.pathname.slice((UI + "/sessions/").length));
  app.replaceChildren(el("h1", { text: "Session " + id }), el("p", { class: "muted", text: "loading…" }));
  let data;
  try { data = await getJSON(UI + "/api/sessions/" + encodeURIComponent(id) + "/timeline"); } catch (err) { showError(app, err); return; }
  viewer.timeline = { turns: data.turns.length, tokens: data.tokens.length };
  const s = data.summary, sample = data.sample;
  const stats = el("div", { class: "stats", id: "stats" },
    el("span", {}, el("b", { text: "turns " }), el("span", { id: "turn-count", text: String(data.turns.length) })),
    el("span", {}, el("b", { text: "tokens " }), String(s.tokens)),
    el("span", {}, el("b", { text: "images " }), String(s.images)),
    el("span", {}, el("b", { text: "rollbacks " }), String(data.rollbacks)),
    el("span", {}, el("b", { text: "created " }), fmtTime(s.created)),
    el("span", {}, el("b", { text: "tokenizer " }), String(data.tokenizer)),
    el("span", { id: "sample" }, el("b", { text: "/samples " }),
       sample.status === null ? "no sample (" + String(sample.empty_reason) + ")"
         : `trains on ${sample.trained_tokens} of ${sample.tokens} tokens (${sample.status}; response ${sample.response_length})`));
  const turns = el("div", { class: "turns", id: "turns" });
  const tokensPane = el("div", {});
  const legend = el("div", { class: "legend" },
    el("span", { class: "tok k0", text: "observation (mask 0)" }),
    el("span", { class: "tok k1", style: `background-color:${logprobColour(-0.01)}`, text: "trained, likely" }),
    el("span", { class: "tok k1", style: `background-color:${logprobColour(-3)}`, text: "trained, unlikely" }),
    el("span", { class: "tok k2", text: "model token not in the sample" }));
  app.replaceChildren(el("h1", { text: "Session " + data.session_id }), stats,
    el("div", { class: "layout" },
      el("div", {}, el("h2", { text: "Timeline" }), turns),
      el("div", {}, el("h2", { text: "Final sequence" }), legend, tokensPane)));
  // Cards go in batches so the first screen paints before the 200th card is built.
  const first = data.turns.slice(0, 20).map((turn) => turnNode(data, turn));
  turns.append(...first);
  tokenView(data, tokensPane);
  await new Promise((resolve) => requestAnimationFrame(resolve));
  for (let i = 20; i < data.turns.length; i += 50) turns.append(...data.turns.slice(i, i + 50).map((turn) => turnNode(data, turn)));
  setReady();
  // Follow a running session: a cheap summary poll, the timeline again only when it changed.
  setInterval(async () => {
    try {
      const now = await getJSON(UI + "/api/sessions/" + encodeURIComponent(id));
      if (now.turns !== s.turns || now.rollbacks !== s.rollbacks) location.reload();
    } catch (err) { /* the next poll retries */ }
  }, 3000);
}

function notFoundPage() {
  const what = location.pathname.startsWith(UI + "/fleet/") ? "fleet" : "session";
  const id = decodeURIComponent(location.pathname.split("/").pop());
  app.replaceChildren(el("h1", { id: "notfound", text: "Not found" }),
                      el("p", { text: `No ${what} ${id} on this server (deleted, expired, or never created).` }),
                      el("p", {}, el("a", { href: UI + "/", text: "All sessions" })));
  setReady();
}

// -- live fleet ---------------------------------------------------------------------------------

async function fleetsPage() {
  const list = el("ul", { id: "fleets" });
  app.replaceChildren(el("h1", { text: "Live fleets" }),
    el("p", { class: "muted", text: "Fleets registered by a running `shinken demo --view` (or any FleetPublisher)." }), list);
  async function load() {
    let data;
    try { data = await getJSON(UI + "/api/fleets"); } catch (err) { showError(list, err); return; }
    list.replaceChildren(...(data.fleets.length ? data.fleets.map((f) => el("li", {},
      el("a", { href: UI + "/fleet/" + encodeURIComponent(f.fleet_id), text: f.name }),
      ` — ${f.tiles} sandboxes, since ${fmtTime(f.created)}`)) : [el("li", { class: "muted", text: "none registered" })]));
    if (!viewer.ready) setReady();
  }
  load();
  setInterval(load, 2000);
}

function frameURL(fleetId, tileId) {
  return UI + "/api/fleets/" + encodeURIComponent(fleetId) + "/tiles/" + encodeURIComponent(tileId) + "/frame";
}

async function fleetPage() {
  const fleetId = decodeURIComponent(location.pathname.slice((UI + "/fleet/").length));
  const grid = el("div", { class: "grid", id: "grid" });
  const title = el("h1", { text: "Fleet" });
  app.replaceChildren(title, el("p", { class: "muted", text: "Low-rate frames; click a sandbox for its full-rate stream." }), grid);
  const tiles = new Map();
  let focused = null;
  // Only tiles in view reload: a large fleet's off-screen screens cost no requests or decodes.
  const inView = new Set();
  const observer = new IntersectionObserver((entries) => {
    for (const e of entries) {
      const id = e.target.dataset.tile;
      if (e.isIntersecting) inView.add(id); else inView.delete(id);
    }
  });

  async function openTile(tile) {
    const img = el("img", { alt: tile.label, id: "live" });
    const caption = el("div", { text: tile.label });
    const overlay = el("div", { class: "overlay", id: "overlay" }, caption, img,
                       el("button", { text: "close", onclick: () => { focused = null; overlay.remove(); } }));
    document.body.append(overlay);
    focused = tile.tile_id;
    let seq = -1, url = null;
    while (focused === tile.tile_id) {
      try {
        const response = await fetch(frameURL(fleetId, tile.tile_id) + `?live=1&wait=5&after=${seq}`, { cache: "no-store" });
        if (!response.ok) throw new Error("HTTP " + response.status);
        const got = Number(response.headers.get("X-Frame-Seq") || 0);
        if (response.status === 200 && got > seq) {
          const next = URL.createObjectURL(await response.blob());
          img.src = next;
          if (url) URL.revokeObjectURL(url);
          url = next;
          seq = got;
          viewer.liveSeq = seq;
        }
      } catch (err) {
        caption.textContent = tile.label + " — " + String(err.message || err);
        await new Promise((resolve) => setTimeout(resolve, 1000));
      }
    }
    if (url) URL.revokeObjectURL(url);
  }

  async function load() {
    let data;
    try { data = await getJSON(UI + "/api/fleets/" + encodeURIComponent(fleetId)); } catch (err) { showError(grid, err); return; }
    title.textContent = "Fleet " + data.name + " · " + data.tiles.length + " sandboxes";
    for (const tile of data.tiles) {
      let entry = tiles.get(tile.tile_id);
      if (!entry) {
        const img = el("img", { alt: tile.label, width: "320", height: "180" });
        const node = el("div", { class: "tile", "data-tile": tile.tile_id, onclick: () => openTile(tile) }, img, el("div", { class: "label", text: tile.label }));
        grid.append(node);
        observer.observe(node);
        entry = { img, seq: 0 };
        tiles.set(tile.tile_id, entry);
      }
      // While a tile is open, its overlay covers the grid: the grid waits (no reloads, no repaints).
      if (tile.seq > entry.seq && (entry.seq === 0 || (focused === null && inView.has(tile.tile_id)))) {
        entry.seq = tile.seq;
        entry.img.src = frameURL(fleetId, tile.tile_id) + "?seq=" + tile.seq;
      }
    }
    if (!viewer.ready) setReady();
  }
  await load();
  setInterval(load, 1000);
}

const PAGES = { login: loginPage, sessions: sessionsPage, session: sessionPage, notfound: notFoundPage,
                fleets: fleetsPage, fleet: fleetPage };
(PAGES[viewer.page] || notFoundPage)();
