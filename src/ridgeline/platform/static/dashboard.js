"use strict";
// Every string the API returns (task ids, statuses, instructions, model output, events,
// errors, URLs) is untrusted: a tenant writes it, or a model a tenant prompted. So the page
// builds its DOM only with createElement, property assignment and text nodes (el() below):
// no innerHTML or other HTML-string sink, no inline handlers, no href from data. The
// server's Content-Security-Policy backs this up (script-src 'self', Trusted Types:
// an HTML-string sink would throw instead of parsing).
//
// The key lives in this tab's sessionStorage only; every call sends it as a Bearer token
// (the event stream is read with fetch, not EventSource, so no key ever goes in a URL).
let key = sessionStorage.getItem("ridgeline-key") || "";
let selected = null, streamAbort = null, lastRows = [];
const STATUSES = ["queued", "in_progress", "completed", "failed", "cancelled"];
const TERMINAL = ["completed", "failed", "cancelled"];
// Only these properties may be set by el(): none of them is parsed as markup or a URL.
const SAFE_PROPS = new Set(["className", "title", "type", "id", "colSpan"]);
const $ = (id) => document.getElementById(id);

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (name === "dataset") Object.assign(node.dataset, value);
    else if (SAFE_PROPS.has(name)) node[name] = value;
    else throw new Error(`el(): property ${name} is not allowed`);
  }
  // strings become text nodes: whatever they hold is shown, never parsed
  node.append(...children.filter((c) => c != null).map((c) => (c instanceof Node ? c : str(c))));
  return node;
}
function str(v) { return v == null ? "" : typeof v === "string" ? v : JSON.stringify(v); }
function statusClass(s) { return STATUSES.includes(s) ? s : ""; }
function when(t) { return typeof t === "number" ? new Date(t * 1000).toLocaleTimeString() : str(t); }
// A task id goes into API paths: only the server's own shape, so a crafted id cannot point
// the key-bearing request at another route ("..", "/", "?").
function usableId(id) { return typeof id === "string" && /^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}$/.test(id); }
// List entries are summaries (a possibly truncated `instruction`); details carry `request`.
function instructionOf(t) { return str(t.instruction ?? (t.request && t.request.instruction)); }

function api(path, opts = {}) {
  return fetch(path, {...opts, headers: {...(opts.headers || {}), "Authorization": "Bearer " + key}});
}
async function errorText(resp) {
  try { return str((await resp.json()).error.message); } catch { return `HTTP ${resp.status}`; }
}
function openButton(id, label) {
  const b = el("button", {type: "button", className: "link"}, label);
  if (usableId(id)) b.addEventListener("click", () => { follow(id); refresh(); });
  else b.disabled = true;
  return b;
}

async function refresh() {
  if (!key) return;
  try {
    const [tasks, stats] = await Promise.all([api("/v1/agent/tasks?limit=100"), api("/v1/platform/stats")]);
    if (!tasks.ok) { $("error").textContent = await errorText(tasks); return; }
    $("error").textContent = "";
    const rows = (await tasks.json()).data || [];
    lastRows = rows;
    $("task-rows").replaceChildren(...(rows.length ? rows.map(taskRow)
      : [el("tr", {}, el("td", {colSpan: 5, className: "muted"}, "No tasks yet."))]));
    if (stats.ok) renderStats(await stats.json());
  } catch (e) { $("error").textContent = String(e); }
}

function taskRow(t) {
  const id = str(t.id), status = str(t.status), instruction = instructionOf(t);
  return el("tr", {className: "task" + (t.parent_id ? " child" : "") + (id === selected ? " selected" : ""),
                   dataset: {id}},
    el("td", {title: instruction}, id),
    el("td", {className: "status " + statusClass(status)}, status),
    el("td", {}, str(t.kind)),
    el("td", {}, when(t.created_at)),
    el("td", {className: "instruction", title: instruction}, instruction));
}

function renderStats(s) {
  const parts = [];
  const group = (label, counts, empty) => {
    const items = Object.entries(counts && typeof counts === "object" ? counts : {}).filter(([, v]) => v > 0);
    parts.push(label + ": ");
    if (!items.length) parts.push(empty);
    items.forEach(([k, v], i) => parts.push(i ? ", " : "", k + " ", el("b", {}, str(v))));
  };
  group("tasks", s.tasks, "none");
  parts.push(" \u00b7 ");
  group("queue", s.queue, "empty");
  $("stats").replaceChildren(...parts);
}

// A step reads as "bash: <command> -> exit 0" and its output; other events as compact JSON.
function describe(ev) {
  const d = ev.data && typeof ev.data === "object" ? ev.data : {};
  if (ev.type === "task.step") {
    let head = `step ${str(d.step)}: `;
    if (d.action && typeof d.action === "object") {
      const args = d.action.args || {};
      head += `${str(d.action.tool)} ${str(args.command ?? args.path ?? args.summary ?? args)}`;
    } else if (d.format_error) {
      head += `format error: ${str(d.format_error)}`;
    }
    const obs = d.observation;
    if (obs) head += obs.ok ? "  \u2192 ok" : `  \u2192 failed${obs.exit_code != null ? " (exit " + str(obs.exit_code) + ")" : ""}`;
    return [el("div", {}, head), obs && obs.text ? el("pre", {}, str(obs.text)) : null];
  }
  const out = Object.keys(d).length ? [el("pre", {}, JSON.stringify(d))] : [];
  if (typeof d.task_id === "string" && d.task_id !== selected) out.push(openButton(d.task_id, "open " + d.task_id));
  return out;
}

// The task's fields as text; subtasks and the parent are buttons that open them in place.
async function showTask(id) {
  const resp = await api(`/v1/agent/tasks/${encodeURIComponent(id)}`);
  if (!resp.ok) { $("error").textContent = await errorText(resp); return null; }
  const task = await resp.json();
  if (selected !== id || !$("task-info")) return task;
  const request = task.request && typeof task.request === "object" ? task.request : {};
  const status = str(task.status);
  const rows = [["Status", el("span", {id: "task-status", className: "status " + statusClass(status)}, status),
                 TERMINAL.includes(status) ? null : " ",
                 TERMINAL.includes(status) ? null : el("button", {id: "cancel", type: "button"}, "Cancel")],
                ["Kind", str(task.kind)], ["Created", when(task.created_at)]];
  if (task.parent_id) rows.push(["Parent", openButton(task.parent_id, str(task.parent_id))]);
  if (request.node_id) rows.push(["Node", str(request.node_id)]);
  if (request.webhook && request.webhook.url) rows.push(["Webhook", str(request.webhook.url)]);
  if (task.error) rows.push(["Error", el("span", {className: "task-error"}, str(task.error))]);
  const children = new Map();
  for (const t of lastRows) if (t.parent_id === id) children.set(str(t.id), str(t.id));
  const nodes = task.result && typeof task.result.nodes === "object" ? task.result.nodes : {};
  for (const [node, n] of Object.entries(nodes || {})) {
    if (n && typeof n.task_id === "string") children.set(n.task_id, `${node}: ${n.task_id} (${str(n.status)})`);
  }
  if (children.size) {
    rows.push(["Subtasks", el("ul", {className: "children"},
      ...[...children].map(([cid, label]) => el("li", {}, openButton(cid, label))))]);
  }
  if (task.result) rows.push(["Result", el("pre", {className: "result"}, JSON.stringify(task.result, null, 2))]);
  $("task-info").replaceChildren(
    el("pre", {className: "instruction"}, str(request.instruction)),
    el("dl", {}, ...rows.flatMap(([label, ...value]) => [el("dt", {}, label), el("dd", {}, ...value)])));
  if ($("cancel")) {
    $("cancel").addEventListener("click", () =>
      api(`/v1/agent/tasks/${encodeURIComponent(id)}/cancel`, {method: "POST"}).then(refresh));
  }
  return task;
}

async function follow(id) {
  if (!usableId(id)) return;
  selected = id;
  if (streamAbort) streamAbort.abort();
  const abort = streamAbort = new AbortController();
  $("detail").replaceChildren(el("h2", {}, id), el("div", {id: "task-info"}), el("div", {id: "events"}));
  try {
    await showTask(id);
    const resp = await api(`/v1/agent/tasks/${encodeURIComponent(id)}/events`, {signal: abort.signal});
    if (!resp.ok) { $("error").textContent = await errorText(resp); return; }
    const reader = resp.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (data && selected === id) showEvent(id, JSON.parse(data));
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") $("error").textContent = String(e);
  }
}

function showEvent(id, ev) {
  const type = str(ev.type);
  const div = el("div", {className: "event", dataset: {type}},
    el("span", {className: "type"}, `#${str(ev.seq)} ${type}`), " ",
    el("span", {className: "muted"}, when(ev.created_at)), ...describe(ev));
  $("events").appendChild(div);
  const status = ev.data && typeof ev.data.status === "string" ? ev.data.status : null;
  if (status && $("task-status")) {
    $("task-status").textContent = status;
    $("task-status").className = "status " + statusClass(status);
    if (TERMINAL.includes(status)) {
      if ($("cancel")) $("cancel").remove();
      showTask(id);  // the error and result are known now
    }
  }
}

$("task-rows").addEventListener("click", (e) => {
  const row = e.target.closest("tr.task");
  if (row) { follow(row.dataset.id); refresh(); }
});
$("login").addEventListener("submit", (e) => {
  e.preventDefault();
  key = $("key").value.trim();
  sessionStorage.setItem("ridgeline-key", key);
  $("key").value = "";
  refresh();
});
refresh();
setInterval(refresh, 2000);
