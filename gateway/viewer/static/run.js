// The run page: curves of a live run, redrawn from /ui/api/run every few seconds. Charts are
// inline SVG drawn here (no library: nothing to vendor, and a few dozen lines do it). Names from
// the run (tasks, groups, metric labels) reach the page through textContent only.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const POLL_MS = 3000;
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf"];
const TASK_MEAN_OF = 5;  // a task's line: the mean of its last 5 groups
let runTimer = null;

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function clock(t) {
  return new Date(t * 1000).toTimeString().slice(0, 8);
}

function niceNumber(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
  return a >= 100 ? v.toFixed(0) : a >= 1 ? v.toFixed(2) : v.toPrecision(2);
}

// series: [{name, points: [[t, v], ...], dots: bool}]; a figure with data-points (the number of
// points drawn) and data-series, which the browser test reads.
function chart(id, title, series, note) {
  const shown = series.filter((s) => s.points.length);
  const total = shown.reduce((n, s) => n + s.points.length, 0);
  const fig = el("figure", { class: "chart", id, "data-points": total,
    "data-series": shown.length }, el("figcaption", { text: title }));
  if (!total) {
    fig.append(el("p", { class: "muted", text: note || "no data yet" }));
    return fig;
  }
  const W = 640, H = 200, L = 52, R = 12, T = 8, B = 24;
  const all = shown.flatMap((s) => s.points);
  const x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  let y0 = Math.min(0, ...all.map((p) => p[1])), y1 = Math.max(...all.map((p) => p[1]));
  if (y1 === y0) y1 = y0 + 1;
  const sx = (t) => L + (x1 === x0 ? 0.5 : (t - x0) / (x1 - x0)) * (W - L - R);
  const sy = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  const root = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img" });
  root.append(svgEl("rect", { x: L, y: T, width: W - L - R, height: H - T - B, class: "plot" }));
  for (const v of [y0, (y0 + y1) / 2, y1]) {
    root.append(svgEl("line", { x1: L, x2: W - R, y1: sy(v), y2: sy(v), class: "grid" }));
    const label = svgEl("text", { x: L - 4, y: sy(v) + 4, "text-anchor": "end" });
    label.textContent = niceNumber(v);
    root.append(label);
  }
  for (const [t, anchor] of [[x0, "start"], [x1, "end"]]) {
    const label = svgEl("text", { x: sx(t), y: H - 6, "text-anchor": anchor });
    label.textContent = clock(t);
    root.append(label);
  }
  const legend = el("div", { class: "legend" });
  shown.forEach((s, k) => {
    const colour = s.colour || PALETTE[k % PALETTE.length];
    const g = svgEl("g", { "data-series": s.name });
    if (s.dots) {
      for (const [t, v] of s.points) {
        g.append(svgEl("circle", { cx: sx(t), cy: sy(v), r: 3, fill: colour }));
      }
    } else {
      g.append(svgEl("polyline", { fill: "none", stroke: colour, "stroke-width": 1.8,
        points: s.points.map(([t, v]) => sx(t).toFixed(1) + "," + sy(v).toFixed(1)).join(" ") }));
    }
    root.append(g);
    if (s.legend !== false) {
      const sw = el("span", { class: "swatch" });
      sw.style.backgroundColor = colour;
      legend.append(el("span", {}, sw, s.name));
    }
  });
  fig.append(root, legend);
  return fig;
}

function table(id, headers, rows) {
  return el("table", { class: "compact", id },
    el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", { text: h })))),
    el("tbody", {}, ...rows.map((r) => el("tr", {}, ...r.map((c) =>
      el("td", { class: typeof c === "number" ? "num" : "",
        text: Number.isInteger(c) ? String(c) : fmt(c, 3) }))))));
}

function rewardViews(groups) {
  const tasks = [...new Set(groups.map((g) => g.task ?? "–"))].sort();
  const colour = (task) => PALETTE[tasks.indexOf(task) % PALETTE.length];
  const scored = groups.filter((g) => g.reward !== null);
  const series = [];
  const rows = [];
  for (const task of tasks) {
    const mine = scored.filter((g) => (g.task ?? "–") === task);
    const line = mine.map((g, k) => {
      const last = mine.slice(Math.max(0, k + 1 - TASK_MEAN_OF), k + 1);
      return [g.t, last.reduce((a, b) => a + b.reward, 0) / last.length];
    });
    series.push({ name: task, points: line, colour: colour(task) });
    series.push({ name: task + " groups", points: mine.map((g) => [g.t, g.reward]), dots: true,
      colour: colour(task), legend: false });
    const all = groups.filter((g) => (g.task ?? "–") === task);
    rows.push([task, all.length, all.length - mine.length,
      mine.length ? mine.reduce((a, b) => a + b.reward, 0) / mine.length : null,
      mine.length ? mine[mine.length - 1].reward : null]);
  }
  return [
    chart("chart-reward", "Reward per group (dots) and per task (mean of its last " +
      TASK_MEAN_OF + " groups)", series),
    table("task-rewards", ["task", "groups", "unscored", "mean reward", "last group"], rows),
  ];
}

function tokenViews(tokens) {
  const series = tokens.columns.map((c, k) => ({ name: c,
    points: tokens.rows.map((r) => [r[0], r[k + 1]]) }));
  const last = tokens.rows.length ? tokens.rows[tokens.rows.length - 1] : null;
  return [
    chart("chart-tokens", "Tokens trained and excluded by cause (running totals; awaiting " +
      "trainer: merged, not taken yet)", series),
    last ? table("token-totals", ["where the tokens went", "tokens"],
      tokens.columns.map((c, k) => [c, last[k + 1]])) : "",
  ];
}

// The gauges' charts: a series goes to the first chart whose pattern matches its name; any
// watched series no pattern takes still shows, under "Other".
const METRIC_CHARTS = [
  ["chart-idle", "Trainer idle fraction", /^rolltap_(trainer|bridge)_idle/],
  ["chart-pool-queued", "Phases queued for a pool slot", /pool_(waiting|queued)/],
  ["chart-pool-wait", "Pool queue wait (a counter of seconds: per s, the mean queue length)",
    /queue_wait/],
  ["chart-pool-busy", "Pool slots in use", /pool_busy/],
  ["chart-engines", "Engines", /engine_/],
  ["chart-ended", "Rollouts ended, per second", /rollouts_ended/],
  ["chart-policy", "Policy version", /^rolltap_policy_version/],
];

function metricViews(metrics) {
  const left = new Set(Object.keys(metrics));
  const take = (re) => [...left].filter((k) => re.test(k)).sort().map((k) => {
    left.delete(k);
    return { name: k, points: metrics[k] };
  });
  const charts = METRIC_CHARTS.map(([id, title, re]) => chart(id, title, take(re),
    "not reported: no " + re.source + " series in the gateway's metrics or its --run-metrics"));
  if (left.size) charts.push(chart("chart-other", "Other", take(/.*/)));
  return charts;
}

function runPicker(data) {
  const pick = el("select", { id: "run-select" },
    el("option", { value: "", text: "newest rollouts of any run" }));
  for (const r of data.runs) {
    const opt = el("option", { value: r, text: "run " + r });
    if (r === data.run) opt.selected = true;
    pick.append(opt);
  }
  pick.addEventListener("change", () => {
    location.hash = "#/run" + (pick.value ? "?run=" + encodeURIComponent(pick.value) : "");
  });
  return el("label", {}, "show ", pick);
}

function drawRun(app, data) {
  const status = el("p", { class: "muted", id: "run-status", text: data.rollouts +
    " rollouts (newest " + data.window + " at most), " + data.running + " running, " +
    data.groups.length + " groups ended · updated " + clock(data.now) });
  app.replaceChildren(
    el("h1", { text: "Run" }), runPicker(data), status,
    el("h2", { text: "Reward" }), ...rewardViews(data.groups),
    el("h2", { text: "Tokens" }), ...tokenViews(data.tokens),
    el("h2", { text: "Staleness" }),
    chart("chart-staleness", "Seconds from a rollout's end to the trainer taking it",
      [{ name: "rollouts", points: data.staleness, dots: true }],
      "no rollout taken by a trainer yet"),
    el("h2", { text: "Where the time goes" }), ...metricViews(data.metrics),
    ...Object.entries(data.unreachable).map(([url, why]) => el("p", { class: "error",
      text: "run metrics from " + url + " unreachable: " + why })));
}

function stopRun() {
  if (runTimer !== null) clearTimeout(runTimer);
  runTimer = null;
}

async function showRun(app, query) {
  stopRun();
  const run = new URLSearchParams(query).get("run");
  const url = "/ui/api/run" + (run ? "?run=" + encodeURIComponent(run) : "");
  const hash = location.hash;
  async function poll() {
    try {
      const data = await getJSON(url);
      if (location.hash !== hash) return;  // another page took over while this one waited
      drawRun(app, data);
    } catch (err) {
      showError(app, err);
    }
    if (location.hash === hash) runTimer = setTimeout(poll, POLL_MS);
  }
  drawRun(app, await getJSON(url));
  runTimer = setTimeout(poll, POLL_MS);
}
