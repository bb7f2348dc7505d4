// The rolltap trace viewer. Every recorded string reaches the page through textContent or
// attribute setters only: bodies come from agents that may be hostile.
"use strict";

// Colours of the token modes; the legend shows the same values, and the browser test reads them.
const MASK_COLOURS = { 1: "rgb(171, 239, 198)", 0: "rgb(234, 236, 240)" };
const PAGE = 50;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function fmt(x, digits) {
  if (x === null || x === undefined) return "–";
  return typeof x === "number" ? x.toFixed(digits === undefined ? 1 : digits) : String(x);
}

async function getJSON(url) {
  const resp = await fetch(url, { credentials: "same-origin", cache: "no-store" });
  if (resp.status === 401 || resp.status === 403) { location.reload(); throw new Error("login"); }
  const body = await resp.json();
  if (!resp.ok) throw new Error((body.error && body.error.message) || resp.statusText);
  return body;
}

function showError(app, err) {
  app.replaceChildren(el("p", { class: "error", text: String(err.message || err) }));
}

// ---- the list ------------------------------------------------------------------------------

const FILTERS = ["task", "group", "status", "harness", "min_reward", "max_reward"];

function listParams() {
  const q = new URLSearchParams(location.hash.replace(/^#\/?\??/, ""));
  return Object.fromEntries(FILTERS.filter((f) => q.get(f)).map((f) => [f, q.get(f)]));
}

async function showList(app) {
  const params = listParams();
  const form = el("form", { class: "filters", id: "filters" });
  const field = (name, label, input) => form.append(el("label", {}, label, input));
  for (const [name, label] of [["task", "task"], ["group", "group"], ["harness", "harness"]]) {
    field(name, label, el("input", { name, id: "f-" + name, value: params[name] || "" }));
  }
  const status = el("select", { name: "status", id: "f-status" });
  for (const s of ["", "running", "finished", "failed", "timeout"]) {
    const opt = el("option", { value: s, text: s || "any" });
    if (s === (params.status || "")) opt.selected = true;
    status.append(opt);
  }
  field("status", "status", status);
  field("min_reward", "reward ≥", el("input", { name: "min_reward", id: "f-min_reward",
    type: "number", step: "any", value: params.min_reward || "" }));
  field("max_reward", "reward ≤", el("input", { name: "max_reward", id: "f-max_reward",
    type: "number", step: "any", value: params.max_reward || "" }));
  form.append(el("button", { type: "submit", id: "apply-filters", text: "Filter" }));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const q = new URLSearchParams();
    for (const f of FILTERS) { const v = form.elements[f].value.trim(); if (v) q.set(f, v); }
    location.hash = "#/?" + q.toString();
  });
  const body = el("tbody", { id: "rollout-rows" });
  const table = el("table", { id: "rollouts" },
    el("thead", {}, el("tr", {}, ...["rollout", "task", "group", "harness", "status", "reward",
      "calls", "sequences", "trained tokens", "created"].map((h) => el("th", { text: h })))),
    body);
  const pager = el("div", { class: "pager" });
  app.replaceChildren(el("h1", { text: "Rollouts" }), form, table, pager);

  const cursors = [null];
  async function load(i) {
    const q = new URLSearchParams({ ...params, limit: String(PAGE) });
    if (cursors[i]) q.set("after", cursors[i]);
    const data = await getJSON("/ui/api/rollouts?" + q.toString());
    cursors[i + 1] = data.next;
    body.replaceChildren(...data.rollouts.map((r) => el("tr", { "data-rollout": r.rollout_id },
      el("td", {}, el("a", { href: "#/rollout/" + r.rollout_id, text: r.rollout_id.slice(0, 8) })),
      el("td", { text: r.task_id ?? "–" }), el("td", { text: r.group_id ?? "–" }),
      el("td", { text: r.harness ?? "–" }),
      el("td", { class: "status-" + r.status, text: r.status }),
      el("td", { class: "num", text: fmt(r.reward, 3) }),
      el("td", { class: "num", text: r.calls }),
      el("td", { class: "num", text: r.sequences ?? "–" }),
      el("td", { class: "num", text: r.trained_tokens ?? "–" }),
      el("td", { class: "muted", text: r.created_at.replace("T", " ").slice(0, 19) }))));
    if (!data.rollouts.length) body.append(el("tr", {}, el("td", { colspan: 10,
      class: "muted", text: "no rollouts match" })));
    pager.replaceChildren(
      el("span", { class: "muted", text: "page " + (i + 1) }),
      i > 0 ? el("button", { id: "prev-page", text: "← newer", onclick: () => load(i - 1) }) : "",
      data.next ? el("button", { id: "next-page", text: "older →", onclick: () => load(i + 1) }) : "");
  }
  await load(0);
}

// ---- one rollout ---------------------------------------------------------------------------

function scalar(v) {
  return v === null || typeof v !== "object";
}

function scalarText(v) {
  return typeof v === "string" ? v : JSON.stringify(v);
}

// A recorded value: a dict as a table of its keys (nested ones too), a list of dicts as a table
// with a column per key, a list of scalars as one line, a scalar as itself.
function valueNode(v) {
  if (scalar(v)) return el("span", { class: "val", text: scalarText(v) });
  if (Array.isArray(v)) {
    if (v.every(scalar)) {
      return el("span", { class: "val", text: v.map(scalarText).join(", ") || "[]" });
    }
    if (v.every((x) => !scalar(x) && !Array.isArray(x))) {
      const keys = [...new Set(v.flatMap(Object.keys))];
      return el("table", { class: "dict" },
        el("thead", {}, el("tr", {}, ...keys.map((k) => el("th", { text: k })))),
        el("tbody", {}, ...v.map((row) => el("tr", {}, ...keys.map((k) =>
          el("td", {}, k in row ? valueNode(row[k]) : "–"))))));
    }
    return el("span", { class: "val", text: JSON.stringify(v) });
  }
  const keys = Object.keys(v);
  if (!keys.length) return el("span", { class: "val muted", text: "none" });
  return el("table", { class: "dict" }, el("tbody", {}, ...keys.map((k) =>
    el("tr", { "data-key": k }, el("th", { text: k }), el("td", {}, valueNode(v[k]))))));
}

function kv(obj) {
  const dl = el("dl", { class: "kv" });
  for (const [k, v] of Object.entries(obj || {})) {
    dl.append(el("dt", { text: k }), el("dd", { "data-key": k }, valueNode(v)));
  }
  return dl;
}

function timeline(calls) {
  if (!calls.length) return el("p", { class: "muted", id: "timeline", text: "no calls" });
  const spans = calls.map((c) => {
    const end = Date.parse(c.created_at);
    return { c, start: end - (c.latency_ms || 0), end };
  });
  const t0 = Math.min(...spans.map((s) => s.start));
  const total = Math.max(1, Math.max(...spans.map((s) => s.end)) - t0);
  const rows = spans.map(({ c, start }) => {
    const track = el("div", { class: "track" });
    const bar = el("div", { class: "bar st-" + c.status });
    bar.style.left = ((start - t0) / total * 100) + "%";
    bar.style.width = ((c.latency_ms || 0) / total * 100) + "%";
    track.append(bar);
    if (c.ttft_ms !== null && c.ttft_ms !== undefined) {
      const tick = el("div", { class: "ttft", title: "first token" });
      tick.style.left = ((start - t0 + c.ttft_ms) / total * 100) + "%";
      track.append(tick);
    }
    const cont = c.continuation || {};
    return el("tr", { "data-call": c.call_id },
      el("td", { class: "num", text: c.seq }), el("td", { class: "bar-cell" }, track),
      el("td", { class: "num", text: fmt(c.latency_ms, 0) }),
      el("td", { class: "num", text: fmt(c.ttft_ms, 0) }),
      el("td", { class: "num", text: c.prompt_tokens }),
      el("td", { class: "num", text: c.completion_tokens }),
      el("td", { text: [cont.path, cont.reason].filter(Boolean).join(": ") || "–" }),
      el("td", { text: c.upstream ?? "–" }),
      el("td", { class: "status-" + (c.status === "ok" ? "finished" : "failed"), text: c.status }),
      el("td", { text: c.finish_reason ?? "–" }));
  });
  return el("table", { class: "timeline", id: "timeline" },
    el("thead", {}, el("tr", {}, ...["call", "time", "latency ms", "TTFT ms", "prompt",
      "completion", "continuation", "replica", "status", "finish"].map((h) => el("th", { text: h })))),
    el("tbody", {}, ...rows));
}

function versionColour(v) {
  return "hsl(" + ((v * 67 + 200) % 360) + ", 70%, 80%)";
}

function logprobColour(lp, mask) {
  if (!mask) return "rgb(255, 255, 255)";
  const p = Math.exp(Math.max(lp, -20));  // 1 = certain (white), 0 = surprising (red)
  return "hsl(0, 85%, " + (60 + 40 * p).toFixed(1) + "%)";
}

function tokenColour(mode, seq, i) {
  if (mode === "mask") return MASK_COLOURS[seq.loss_mask[i] ? 1 : 0];
  if (mode === "version") return versionColour(seq.versions[i]);
  return logprobColour(seq.logprobs[i], seq.loss_mask[i]);
}

function legend(mode, sequences) {
  const box = el("div", { class: "legend", id: "legend" });
  const item = (colour, label, attrs) => {
    const sw = el("span", { class: "swatch", ...attrs });
    sw.style.backgroundColor = colour;
    box.append(el("span", {}, sw, label));
  };
  if (mode === "mask") {
    item(MASK_COLOURS[1], "trained (loss mask 1)", { "data-mask": 1 });
    item(MASK_COLOURS[0], "context (loss mask 0)", { "data-mask": 0 });
  } else if (mode === "version") {
    const versions = new Set();
    for (const s of sequences) for (const v of s.versions) versions.add(v);
    for (const v of [...versions].sort((a, b) => a - b)) {
      item(versionColour(v), "policy v" + v, { "data-version": v });
    }
  } else {
    for (const lp of [0, -1, -3, -8]) item(logprobColour(lp, 1), "logprob " + lp, {});
    item(logprobColour(0, 0), "context", {});
  }
  return box;
}

function renderTokens(container, seq, texts, mode) {
  const starts = new Map(), ends = new Map();
  for (const b of seq.boundaries) { starts.set(b.start, b.seq); ends.set(b.end, b.seq); }
  const frag = document.createDocumentFragment();
  const n = seq.input_ids.length;
  for (let i = 0; i <= n; i++) {
    if (ends.has(i) && i > 0) frag.append(el("span", { class: "boundary end",
      text: "end of call " + ends.get(i) }));
    if (i === n) break;
    if (starts.has(i)) frag.append(el("span", { class: "boundary",
      text: "call " + starts.get(i) + " samples" }));
    const id = seq.input_ids[i];
    const text = texts ? texts[id] : null;
    const tok = el("span", { class: "tok", "data-i": i, "data-id": id,
      "data-mask": seq.loss_mask[i], "data-version": seq.versions[i],
      title: "#" + i + " id " + id + " · mask " + seq.loss_mask[i] + " · v" + seq.versions[i] +
        " · logprob " + fmt(seq.logprobs[i], 3),
      text: text === null || text === undefined ? "⟨" + id + "⟩" : text });
    if (text && /^<\|.*\|>$|^<\/?tool_call>$/.test(text)) tok.classList.add("special");
    tok.style.backgroundColor = tokenColour(mode, seq, i);
    frag.append(tok);
  }
  container.replaceChildren(frag);
}

function sequences(data) {
  const box = el("div", { id: "sequences" });
  const seqs = data.sequences;
  if (!data.merged) {
    return el("p", { class: "muted", text: "not merged yet: traces exist once the rollout ends" });
  }
  let mode = "mask";
  const modes = el("div", { class: "modes", id: "modes" }, el("span", { text: "colour by:" }));
  const holder = el("div");
  for (const [m, label] of [["mask", "loss mask"], ["logprob", "logprob"], ["version", "policy version"]]) {
    const radio = el("input", { type: "radio", name: "mode", value: m, id: "mode-" + m });
    if (m === mode) radio.checked = true;
    radio.addEventListener("change", () => { mode = m; draw(); });
    modes.append(el("label", {}, radio, " " + label));
  }
  const blocks = seqs.map((s, k) => {
    const tokens = el("div", { class: "tokens", "data-sequence": k });
    const head = el("div", { class: "head" },
      el("strong", { text: "sequence " + k }),
      el("span", { class: "badge cause", "data-cause": s.cause, text: "fork cause: " + s.cause }),
      s.auxiliary ? el("span", { class: "badge", text: "auxiliary" }) : null,
      s.excluded ? el("span", { class: "badge", text: "excluded from training" }) : null,
      el("span", { class: "muted", text: "  " + s.input_ids.length + " tokens, " +
        s.loss_mask.reduce((a, b) => a + b, 0) + " trained, calls " +
        s.boundaries.map((b) => b.seq).join(", ") }));
    return { s, tokens, node: el("div", { class: "sequence" }, head, tokens) };
  });
  function draw() {
    holder.replaceChildren(legend(mode, seqs));
    for (const b of blocks) renderTokens(b.tokens, b.s, data.token_text, mode);
  }
  draw();
  box.append(modes, holder);
  if (data.tokenizer_note) box.append(el("p", { class: "muted", text: data.tokenizer_note }));
  for (const b of blocks) box.append(b.node);
  return box;
}

function partText(part) {
  if (typeof part === "string") return part;
  if (part && typeof part.text === "string") return part.text;
  return JSON.stringify(part, null, 1);
}

function contentText(content) {
  if (content === null || content === undefined) return "";
  if (Array.isArray(content)) return content.map(partText).join("\n");
  return partText(content);
}

function messageNode(role, text, cls) {
  return el("div", { class: "msg " + (cls || role) }, el("div", { class: "role", text: role }),
    el("pre", { text }));
}

// A request in any protocol (chat, Responses, Anthropic), as the harness sent it.
function requestMessages(req) {
  const out = [];
  if (!req) return [messageNode("(body not recorded)", "", "muted")];
  if (req.system) out.push(messageNode("system", contentText(req.system)));
  if (req.instructions) out.push(messageNode("instructions", contentText(req.instructions)));
  const items = req.messages || (typeof req.input === "string" ? [{ role: "user",
    content: req.input }] : req.input) || (req.prompt !== undefined ? [{ role: "prompt",
    content: req.prompt }] : []);
  for (const m of items) {
    const role = m.role || m.type || "item";
    let text = contentText(m.content);
    if (m.tool_calls) text += (text ? "\n" : "") + JSON.stringify(m.tool_calls, null, 1);
    if (m.type && m.type !== "message" && m.content === undefined) {
      const { type, ...rest } = m; text = JSON.stringify(rest, null, 1);
    }
    out.push(messageNode(role, text, m.role || "item"));
  }
  if (req.tools) {
    out.push(el("details", {}, el("summary", { text: req.tools.length + " tools offered" }),
      el("pre", { class: "raw", text: JSON.stringify(req.tools, null, 1) })));
  }
  return out;
}

function conversation(calls) {
  const box = el("div", { id: "conversation" });
  calls.forEach((c, k) => {
    const d = el("details", { class: "call", "data-call": c.call_id });
    if (k === calls.length - 1) d.open = true;
    d.append(el("summary", { text: "call " + c.seq + " · " + c.protocol + " · " + c.status +
      (c.error ? " · " + c.error : "") }));
    d.append(...requestMessages(c.request));
    const reply = c.response && c.response.message;
    if (reply) {
      let text = contentText(reply.content);
      if (reply.reasoning_content) text = "[reasoning] " + reply.reasoning_content + "\n" + text;
      if (reply.tool_calls) text += (text ? "\n" : "") + JSON.stringify(reply.tool_calls, null, 1);
      d.append(messageNode("reply (" + (c.finish_reason || "?") + ")", text, "reply"));
    }
    const raw = el("details", {}, el("summary", { text: "raw request and response JSON" }));
    raw.addEventListener("toggle", () => {
      if (raw.childElementCount > 1) return;
      raw.append(el("pre", { class: "raw", text: JSON.stringify({ request: c.request,
        response: c.response }, null, 1) }));
    });
    d.append(raw);
    box.append(d);
  });
  return box;
}

async function showRollout(app, id) {
  const data = await getJSON("/ui/api/rollouts/" + encodeURIComponent(id));
  const r = data.rollout;
  app.replaceChildren(
    el("p", {}, el("a", { href: "#/", text: "← all rollouts" })),
    el("h1", { id: "rollout-title", text: "Rollout " + r.rollout_id }),
    kv({ task: r.task_id ?? "–", group: r.group_id ?? "–", harness: r.harness ?? "–",
      status: r.status, reward: r.reward === null ? "none (unscorable)" : String(r.reward),
      created: r.created_at, finished: r.finished_at ?? "–" }),
    el("h2", { text: "Verifier output" }),
    r.metrics ? el("div", { id: "verifier" }, kv(r.metrics))
      : el("p", { class: "muted", id: "verifier", text: "none recorded" }),
    el("h2", { text: "Merge" }),
    r.trained_nothing ? el("p", { id: "trained-nothing", text: r.trained_nothing }) : "",
    r.merge_stats ? el("div", { id: "merge-stats" }, kv(r.merge_stats))
      : el("p", { class: "muted", text: "not merged" }),
    r.ledger ? el("div", { id: "ledger" }, el("h3", { text: "Given to the trainer" }),
      kv({ trained_tokens: r.ledger.trained_tokens, ...r.ledger.excluded_tokens })) : "",
    el("h2", { text: "Calls" }), timeline(data.calls),
    el("h2", { text: "Merged sequences" }), sequences(data),
    el("h2", { text: "Conversation as the harness sent it" }), conversation(data.calls));
}

async function route() {
  const app = document.getElementById("app");
  const m = location.hash.match(/^#\/rollout\/([0-9a-fA-F-]+)/);
  const run = location.hash.match(/^#\/run(?:\?(.*))?$/);
  stopRun();  // run.js: the run page polls only while it is shown
  try {
    if (m) await showRollout(app, m[1]);
    else if (run) await showRun(app, run[1] || "");
    else await showList(app);
    document.body.dataset.ready = location.hash || "#/";
  } catch (err) {
    showError(app, err);
  }
}

window.addEventListener("hashchange", route);
document.addEventListener("DOMContentLoaded", route);
