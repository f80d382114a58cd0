// The page: pick or paste a program, run it, watch it; run history; the API key.

import { Api } from "./api.js";
import { EXAMPLES, parseProgramText, programVariables } from "./program.js";
import { RunStream } from "./stream.js";
import { RunView } from "./view.js";

const $ = (selector) => document.querySelector(selector);
const DETAIL_EVERY_MS = 700;
const HISTORY_PAGE = 30;

const api = new Api();
const view = new RunView($("#run-panel"));
let stream = null;
let detailTimer = 0;
let historyOffset = 0;
let historyAsked = 0;  // the latest history request: answers to older ones are stale
let pasted = { inputs: undefined, outputs: undefined };

// Frame times while a stream is live: the gap between animation frames, i.e. how long
// the page could not paint (event handling, layout, painting all included).
const frames = { count: 0, maxMs: 0, over50ms: 0, gaps: [] };
let frameLoop = 0;
let lastFrame = 0;
const longTasks = { count: 0, totalMs: 0 };
if (typeof PerformanceObserver !== "undefined" &&
    (PerformanceObserver.supportedEntryTypes || []).includes("longtask")) {
  new PerformanceObserver((list) => {
    for (const entry of list.getEntries()) {
      longTasks.count += 1;
      longTasks.totalMs += entry.duration;
    }
  }).observe({ entryTypes: ["longtask"] });
}

function watchFrames(on) {
  cancelAnimationFrame(frameLoop);
  lastFrame = 0;
  if (!on) return;
  const tick = (now) => {
    if (lastFrame) {
      const gap = now - lastFrame;
      frames.count += 1;
      if (gap > frames.maxMs) frames.maxMs = gap;
      if (gap > 50) frames.over50ms += 1;
      if (frames.gaps.length < 20000) frames.gaps.push(gap);
    }
    lastFrame = now;
    frameLoop = requestAnimationFrame(tick);
  };
  frameLoop = requestAnimationFrame(tick);
}

function showError(selector, err) {
  $(selector).textContent = err ? (err.message || String(err)) : "";
}

// ---------------------------------------------------------------- auth

async function probe() {
  try {
    await api.listRuns({ limit: 1 });
  } catch (err) {
    if (err.status === 401) {
      const hadKey = Boolean(api.key);
      api.setKey(null);
      $("#auth").hidden = false;
      $("#signed-in").hidden = true;
      $("#server-note").textContent = "this server needs an API key";
      showError("#auth-error", hadKey ? err : null);
      document.body.dataset.auth = hadKey ? "rejected" : "needed";
      return false;
    }
    $("#server-note").textContent = err.message;
    return false;
  }
  $("#auth").hidden = true;
  showError("#auth-error", null);
  if (api.key) {
    $("#signed-in").hidden = false;
    $("#key-hint").textContent = `key …${api.key.slice(-4)}`;
    $("#server-note").textContent = "";
    document.body.dataset.auth = "accepted";
  } else {
    $("#signed-in").hidden = true;
    $("#server-note").textContent = "auth is off (loopback)";
    document.body.dataset.auth = "off";
  }
  loadHistory(true);
  return true;
}

$("#auth").addEventListener("submit", async (event) => {
  event.preventDefault();
  api.setKey($("#api-key").value.trim());
  $("#api-key").value = "";
  if (await probe()) openFromHash();  // a link to a run, opened before the key was given
});

$("#forget-key").addEventListener("click", () => {
  closeRun();  // what is shown belongs to the key's tenant: leave nothing of it on screen
  api.setKey(null);
  $("#history").replaceChildren();
  probe();
});

// ---------------------------------------------------------------- program form

function fillExamples() {
  const select = $("#example");
  for (const ex of EXAMPLES) select.append(new Option(ex.title, ex.id));
  select.append(new Option("Paste your own…", ""));
  select.addEventListener("change", () => loadExample(select.value));
  loadExample(EXAMPLES[0].id);
}

function loadExample(id) {
  const ex = EXAMPLES.find((e) => e.id === id);
  $("#example-about").textContent = ex ? ex.about : "Paste JSON or templates below.";
  $("#program-text").value = ex ? JSON.stringify(ex.run, null, 2) : "";
  $("#inputs").replaceChildren();
  parseForm();
}

function parseForm() {
  showError("#program-error", null);
  let parsed;
  try {
    parsed = parseProgramText($("#program-text").value, Number($("#max-tokens").value) || 64);
    if (!Array.isArray(parsed.program.calls) || !parsed.program.calls.length) {
      throw new Error("a program needs at least one call");
    }
    programVariables(parsed.program);
  } catch (err) {
    showError("#program-error", err);
    return null;
  }
  pasted = { inputs: parsed.inputs, outputs: parsed.outputs };
  const { inputs } = programVariables(parsed.program);
  const box = $("#inputs");
  const old = new Map([...box.querySelectorAll("textarea")].map((t) => [t.name, t.value]));
  const fields = inputs.map((name) => {
    const label = document.createElement("label");
    label.textContent = `input ${name}`;
    const area = document.createElement("textarea");
    area.name = name;
    area.rows = 2;
    area.dataset.input = name;
    area.value = old.get(name) ?? (parsed.inputs && parsed.inputs[name]) ?? "";
    label.append(area);
    return label;
  });
  box.replaceChildren(...fields);
  return parsed;
}

let parseTimer = 0;
$("#program-text").addEventListener("input", () => {
  clearTimeout(parseTimer);
  parseTimer = setTimeout(parseForm, 250);
});
$("#max-tokens").addEventListener("change", parseForm);

function runSpec() {
  const parsed = parseForm();
  if (!parsed) return null;
  // no inherited keys: a variable may be named "__proto__" or "constructor"
  const inputs = Object.create(null);
  for (const area of $("#inputs").querySelectorAll("textarea")) inputs[area.name] = area.value;
  let outputs = pasted.outputs;
  if (!outputs || !Object.keys(outputs).length) {
    outputs = Object.create(null);
    for (const name of programVariables(parsed.program).finals) {
      outputs[name] = $("#objective").value;
    }
  }
  return { program: parsed.program, inputs, outputs };
}

$("#run").addEventListener("click", async () => {
  const spec = runSpec();
  if (!spec) return;
  $("#run").disabled = true;
  try {
    const created = await api.createRun(spec);
    openRun(created.run_id);
  } catch (err) {
    showError("#program-error", err);
  } finally {
    $("#run").disabled = false;
  }
});

// ---------------------------------------------------------------- one run

const OVER = ["done", "failed", "cancelled"];

function setRunStatus(status) {
  const badge = $("#run-status");
  badge.textContent = status || "no run";
  badge.dataset.status = status || "";
  badge.className = `badge status-${status || "none"}`;
  const over = OVER.includes(status);
  $("#cancel").disabled = !status || over;
  $("#replay").disabled = !status;
}

function showStats() {
  if (!stream) return;
  const s = stream.stats;
  $("#stream-stats").textContent = `${s.events} events · ${s.tokens} tokens · ` +
    `${s.reconnects} reconnects · ${s.duplicates} duplicates dropped · ${s.missing} missing`;
}

async function refreshDetail() {
  detailTimer = 0;
  const runId = view.runId;
  if (!runId) return;
  try {
    const detail = await api.getRun(runId);
    if (view.runId !== runId) return;
    view.applyDetail(detail);
    setRunStatus(view.status);  // a detail older than the stream's end cannot undo it
    if (detail.run.error) showError("#run-error", { message: detail.run.error });
  } catch (err) {
    if (err.status !== 0) showError("#run-error", err);  // offline: the next one will do
    if (err.status === 404 && view.runId === runId) setRunStatus("");  // no such run
  }
}

function scheduleDetail(soon) {
  if (detailTimer && !soon) return;
  clearTimeout(detailTimer);
  detailTimer = setTimeout(refreshDetail, soon ? 0 : DETAIL_EVERY_MS);
}

// No run on screen (the page as first loaded).
function closeRun() {
  if (stream) stream.close("ended");
  stream = null;
  clearTimeout(detailTimer);
  detailTimer = 0;
  showError("#run-error", null);
  view.reset(null);
  $("#run-id").textContent = "–";
  $("#stream-state").textContent = "";
  $("#stream-state").dataset.state = "";
  $("#stream-stats").textContent = "";
  setRunStatus("");
}

function openRun(runId) {
  if (stream) stream.close("ended");
  clearTimeout(detailTimer);
  detailTimer = 0;
  showError("#run-error", null);
  view.reset(runId);
  $("#run-id").textContent = runId;
  if (location.hash !== `#run=${runId}`) history.replaceState(null, "", `#run=${runId}`);
  setRunStatus("pending");
  const current = new RunStream(api, runId, {
    onEvent(type, data) {
      view.apply(type, data);
      // (a stored run's log starts with run_created too: the view keeps a run that is over)
      if (type === "run_created") setRunStatus(view.status);
      if (type === "call_started" || type === "call_finished" || type === "call_failed") {
        scheduleDetail(false);
      }
      if (type === "run_finished") {
        setRunStatus(view.status);
        scheduleDetail(true);
        loadHistory(true);
      }
    },
    onState(state, detail) {
      if (stream !== current) return;
      $("#stream-state").textContent = `stream: ${state}`;
      $("#stream-state").dataset.state = state;
      if (state === "error" && detail) showError("#run-error", { message: detail });
      if (state === "live") watchFrames(true);
      if (state === "finished" || state === "ended" || state === "error") {
        watchFrames(false);
        showStats();
        scheduleDetail(true);
      }
    },
  });
  stream = current;
  current.start();
  scheduleDetail(true);
}

const statsTimer = setInterval(showStats, 400);

$("#replay").addEventListener("click", async () => {
  if (!view.runId) return;
  try {
    const created = await api.replay(view.runId);
    openRun(created.run_id);
  } catch (err) {
    showError("#run-error", err);
  }
});

$("#cancel").addEventListener("click", async () => {
  if (!view.runId) return;
  try {
    const summary = await api.cancel(view.runId);
    setRunStatus(summary.status);
  } catch (err) {
    showError("#run-error", err);
  }
});

// ---------------------------------------------------------------- history

function historyItem(run) {
  const li = document.createElement("li");
  const button = document.createElement("button");
  button.type = "button";
  button.className = "history-item";
  button.dataset.runId = run.run_id;
  button.dataset.status = run.status;
  const badge = document.createElement("span");
  badge.className = `badge status-${run.status}`;
  badge.textContent = run.status;
  const id = document.createElement("code");
  id.textContent = run.run_id.slice(0, 8);
  const when = document.createElement("span");
  when.className = "muted small";
  when.textContent = new Date(run.created_at).toLocaleString();
  const what = document.createElement("span");
  what.className = "muted small";
  what.textContent = Object.keys(run.outputs || {}).join(", ") +
    (run.replay_of ? ` · replay of ${run.replay_of.slice(0, 8)}` : "");
  button.append(badge, id, when, what);
  button.addEventListener("click", () => openRun(run.run_id));
  li.append(button);
  return li;
}

async function loadHistory(fromStart) {
  if (fromStart) historyOffset = 0;
  showError("#history-error", null);
  const asked = ++historyAsked;
  const status = $("#status-filter").value;
  try {
    const page = await api.listRuns({ status, limit: HISTORY_PAGE, offset: historyOffset });
    if (asked !== historyAsked) return;  // a newer filter or refresh is under way
    const items = page.runs.map(historyItem);
    if (fromStart) $("#history").replaceChildren(...items);
    else $("#history").append(...items);
    historyOffset += page.runs.length;
    $("#more").hidden = page.runs.length < HISTORY_PAGE;
    $("#history").dataset.loaded = status || "all";
  } catch (err) {
    if (asked === historyAsked) showError("#history-error", err);
  }
}

$("#status-filter").addEventListener("change", () => loadHistory(true));
$("#refresh").addEventListener("click", () => loadHistory(true));
$("#more").addEventListener("click", () => loadHistory(false));

// ---------------------------------------------------------------- start

window.parrotUI = {
  api,
  view,
  openRun,
  get stream() {
    return stream;
  },
  snapshot() {
    return {
      runId: view.runId,
      status: view.status,
      variables: view.snapshot(),
      dag: view.dag.states(),
      stream: stream ? { ...stream.stats, lastSeq: stream.lastSeq, closed: stream.closed }
        : null,
    };
  },
  perf() {
    const gaps = [...frames.gaps].sort((a, b) => a - b);
    const at = (q) => (gaps.length ? gaps[Math.min(gaps.length - 1,
      Math.floor(q * gaps.length))] : null);
    return {
      stream: stream ? { ...stream.stats } : null,
      flush: { ...view.perf },
      frames: { count: frames.count, maxMs: frames.maxMs, over50ms: frames.over50ms,
                p50Ms: at(0.5), p95Ms: at(0.95), p99Ms: at(0.99) },
      longTasks: { ...longTasks },
      domNodes: document.getElementsByTagName("*").length,
    };
  },
  resetPerf() {
    Object.assign(frames, { count: 0, maxMs: 0, over50ms: 0, gaps: [] });
    Object.assign(longTasks, { count: 0, totalMs: 0 });
    Object.assign(view.perf, { flushes: 0, flushTotalMs: 0, flushMaxMs: 0 });
  },
  statsTimer,
};

// A link to a run: `#run=<id>`, opened at load, once a key is accepted, and whenever
// the address's hash changes (an edited or pasted link, back and forward).
function openFromHash() {
  const hash = location.hash;
  if (!hash.startsWith("#run=")) return;
  let id = hash.slice(5);
  try {
    id = decodeURIComponent(id);
  } catch {
    // shown as it is
  }
  if (!/^[0-9a-f]{32}$/.test(id)) {
    closeRun();
    showError("#run-error", { message: `not a run id: ${JSON.stringify(id)} (a run id ` +
                                       "is 32 lowercase hex digits)" });
    return;
  }
  if (view.runId !== id) openRun(id);
}

window.addEventListener("hashchange", () => {
  if (document.body.dataset.auth === "off" || document.body.dataset.auth === "accepted") {
    openFromHash();
  }
});

fillExamples();
probe().then((ok) => {
  if (ok) openFromHash();
});
document.body.dataset.ready = "true";
