// One run on the page: its DAG, its variables filling with tokens, its call timeline.
//
// Tokens are buffered per variable and written once per animation frame, appended to
// one text node per variable (appendData): the work per token is constant, whatever the
// length of the text so far or the number of calls, so 10k tokens cost no more per token
// than 10.

import { DagView } from "./dag.js";
import { describeCalls, sharedPrefixes } from "./program.js";

const TERMINAL = new Set(["done", "failed", "cancelled"]);
const RANK = { queued: 0, running: 1, done: 2, failed: 2, cancelled: 2 };
const RUN_STATUS = { finished: "done", failed: "failed", cancelled: "cancelled" };

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function ms(a, b) {
  return a && b ? Date.parse(b) - Date.parse(a) : null;
}

function fmtMs(value) {
  if (value === null) return "–";
  return value >= 1000 ? `${(value / 1000).toFixed(2)} s` : `${Math.round(value)} ms`;
}

export class RunView {
  constructor(root) {
    this.root = root;
    this.dag = new DagView(root.querySelector("#dag"), root.querySelector("#prefix-legend"));
    this.varsBox = root.querySelector("#variables");
    this.timelineBox = root.querySelector("#timeline");
    this.perf = { flushes: 0, flushTotalMs: 0, flushMaxMs: 0 };
    this.reset(null);
  }

  reset(runId) {
    this.runId = runId;
    this.calls = [];
    this.programCalls = [];
    this.producer = new Map();
    this.starts = new Map();  // call -> call_started events seen (more: it ran again)
    // name -> {card, text (Text node), count (token events; the completion tokens once
    // its call finished), status, streamed[]}
    this.vars = new Map();
    this.pending = new Map();  // name -> [token texts not yet on screen]
    this.frame = 0;
    this.status = runId ? "pending" : "";
    this.varsBox.replaceChildren();
    this.timelineBox.replaceChildren(el("p", "muted", runId ? "waiting for calls…" : ""));
    this.dag.nodes.clear();
    this.dag.container.replaceChildren();
    this.dag.legend.replaceChildren();
  }

  // The program (from run_created or the run's detail): draw the DAG and the variables.
  setProgram(program, inputs = {}) {
    const known = [...this.dag.nodes].map(([name, node]) => [name, { ...node.info }]);
    this.programCalls = program.calls;
    this.calls = describeCalls(program);
    this.dag.build(this.calls, sharedPrefixes(this.calls));
    for (const [name, info] of known) this.dag.setCall(name, info);  // calls were added
    for (const call of this.calls) {
      for (const name of call.outputs) this.producer.set(name, call.name);
    }
    const names = [];
    for (const call of this.calls) {
      for (const name of [...call.inputs, ...call.outputs]) {
        if (!names.includes(name)) names.push(name);
      }
    }
    for (const name of names) this._variable(name);
    for (const [name, value] of Object.entries(inputs)) this._setValue(name, value, "ready");
  }

  _variable(name) {
    let v = this.vars.get(name);
    if (v) return v;
    const card = el("article", "variable");
    card.dataset.variable = name;
    const head = el("header");
    const title = el("h3", null, name);
    const from = this.producer.get(name);
    const source = el("span", "muted", from ? `from ${from}` : "input");
    const badge = el("span", "badge status-pending", "pending");
    const count = el("span", "count muted", "");
    head.append(title, source, badge, count);
    const body = el("pre", "value");
    const text = document.createTextNode("");
    body.append(text);
    card.append(head, body);
    this.varsBox.append(card);
    v = { card, text, badge, countEl: count, count: 0, status: "pending", streamed: [] };
    this.vars.set(name, v);
    return v;
  }

  _setValue(name, value, status, error) {
    const v = this._variable(name);
    this._flushOne(name);
    v.status = status;
    v.text.data = status === "failed" ? `failed: ${error}` : value;
    v.badge.className = `badge status-${status}`;
    v.badge.textContent = status;
    v.card.dataset.status = status;
  }

  // One event of the run's stream (stream.js has dropped duplicates already).
  apply(type, data) {
    switch (type) {
      case "run_created":
        this.setProgram(data.program, data.inputs || {});
        this._setStatus("running");
        break;
      case "calls_added":
        this.setProgram({ calls: [...this.programCalls, ...data.calls] });
        break;
      case "objectives":
        for (const [name, o] of Object.entries(data.calls || {})) {
          this.dag.setCall(name, { objective: o.objective, group: o.group });
        }
        break;
      case "call_started": {
        const attempts = (this.starts.get(data.call) || 0) + 1;
        this.starts.set(data.call, attempts);
        if (attempts > 1) this._restartCall(data.call);  // ran again after a restart
        this.dag.setCall(data.call, { state: "running", engine: data.engine,
                                      objective: data.objective, group: data.group,
                                      attempts });
        break;
      }
      case "token":
        this._token(data.variable, data.text);
        break;
      case "variable_ready":
        this._setValue(data.name, data.value, "ready");
        break;
      case "variable_failed":
        this._setValue(data.name, "", "failed", data.error);
        break;
      case "call_finished":
        this.dag.setCall(data.call, { state: "done" });
        this._completionTokens(data);
        break;
      case "call_failed":
        this.dag.setCall(data.call, { state: "failed", error: data.error });
        // its outputs failed with it (the log may carry no variable_failed for them)
        for (const call of this.calls) {
          if (call.name !== data.call) continue;
          for (const out of call.outputs) {
            const v = this._variable(out);
            if (v.status === "pending") this._setValue(out, "", "failed", data.error);
          }
        }
        break;
      case "run_resumed":
        for (const [name, node] of this.dag.nodes) {
          if (node.info.state === "running") this.dag.setCall(name, { state: "queued" });
        }
        break;
      case "run_finished":
        this._setStatus(RUN_STATUS[data.status] || data.status);
        this.flush();
        this._unfinished();
        break;
      default:
        break;
    }
  }

  // A run that is over stays over: a detail asked for before its end (answered after the
  // stream's run_finished) or a stored run's log starting again cannot make it running.
  _setStatus(status) {
    if (TERMINAL.has(this.status) && !TERMINAL.has(status)) return;
    this.status = status;
  }

  // A run that is over leaves no variable pending: those it never produced (a cancelled
  // run's) say so, keeping what streamed of them, instead of "streaming" or "pending".
  _unfinished() {
    if (!TERMINAL.has(this.status)) return;
    if (this.status === "cancelled") {  // the log has no event per cancelled call
      for (const [name, node] of this.dag.nodes) {
        if (!TERMINAL.has(node.info.state)) this.dag.setCall(name, { state: "cancelled" });
      }
    }
    const why = this.status === "cancelled" ? "cancelled" : "not produced";
    for (const [name, v] of this.vars) {
      if (v.status !== "pending") continue;
      this._flushOne(name);
      v.status = why;
      v.badge.className = `badge status-${this.status === "cancelled" ? "cancelled" : "none"}`;
      v.badge.textContent = why;
      v.card.dataset.status = why;
    }
  }

  _restartCall(name) {
    for (const call of this.calls) {
      if (call.name !== name) continue;
      for (const out of call.outputs) {
        const v = this._variable(out);
        this.pending.delete(out);
        v.streamed = [];
        v.count = 0;
        v.text.data = "";
        v.countEl.textContent = "";
      }
    }
  }

  _token(name, text) {
    const v = this._variable(name);
    v.streamed.push(text);
    v.count += 1;
    let queue = this.pending.get(name);
    if (!queue) {
      queue = [];
      this.pending.set(name, queue);
    }
    queue.push(text);
    if (!this.frame) this.frame = requestAnimationFrame(() => this.flush());
  }

  // A finished call's completion tokens per output replace the count of its token
  // events: tokens that carry no text (the EOS, a stop string's) have no event.
  _completionTokens(data) {
    let counts = data.output_tokens;
    if (!counts) {  // an end logged without them (older, or settled by recovery)
      const call = this.calls.find((c) => c.name === data.call);
      if (!call || call.outputs.length !== 1 || typeof data.completion_tokens !== "number") {
        return;
      }
      counts = { [call.outputs[0]]: data.completion_tokens };
    }
    for (const [name, n] of Object.entries(counts)) {
      const v = this._variable(name);
      this._flushOne(name);
      v.count = n;
      v.countEl.textContent = `${n} tokens`;
    }
  }

  _flushOne(name) {
    const queue = this.pending.get(name);
    if (!queue) return;
    this.pending.delete(name);
    const v = this.vars.get(name);
    if (v.status === "pending") {
      v.text.appendData(queue.join(""));
      if (v.badge.textContent !== "streaming") {
        v.badge.className = "badge status-streaming";
        v.badge.textContent = "streaming";
      }
    }
    v.countEl.textContent = `${v.count} tokens`;
  }

  // Put buffered tokens on screen (once per frame while tokens arrive).
  flush() {
    const started = performance.now();
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = 0;
    for (const name of [...this.pending.keys()]) this._flushOne(name);
    const took = performance.now() - started;
    this.perf.flushes += 1;
    this.perf.flushTotalMs += took;
    if (took > this.perf.flushMaxMs) this.perf.flushMaxMs = took;
  }

  // The run's detail (GET /v1/runs/{id}): statuses, engines, task groups, timings.
  applyDetail(detail) {
    if (!this.calls.length) this.setProgram(detail.program);
    this._setStatus(detail.run.status);
    for (const call of detail.calls) {
      const name = call.name ?? `#${call.idx}`;
      const node = this.dag.nodes.get(name);
      const status = call.status === "claimed" ? "running" : call.status;
      let state = status in RANK ? status : "queued";
      // the stream may be ahead of the detail (a call's end is written lazily)
      if (node && RANK[node.info.state] > RANK[state]) state = node.info.state;
      this.dag.setCall(name, { state, engine: call.engine, objective: call.objective,
                               group: call.task_group, error: call.error,
                               attempts: call.attempts });
    }
    for (const [name, v] of Object.entries(detail.variables)) {
      if (v.status !== "pending") this._setValue(name, v.value ?? "", v.status, v.error);
    }
    this.timeline(detail);
  }

  // Each call's queued -> started -> first token -> finished, on one time axis.
  timeline(detail) {
    const t0 = Date.parse(detail.run.created_at);
    const ends = detail.calls.map((c) => Date.parse(c.finished_at || c.first_token_at ||
      c.started_at || c.queued_at));
    const t1 = Math.max(t0 + 1, ...ends, Date.parse(detail.run.finished_at || 0) || 0);
    const span = t1 - t0;
    const pct = (iso) => `${(100 * (Date.parse(iso) - t0)) / span}%`;
    const rows = detail.calls.map((c) => {
      const row = el("div", "tl-row");
      row.dataset.call = c.name ?? `#${c.idx}`;
      const label = el("span", "tl-name", row.dataset.call);
      const track = el("div", "tl-track");
      const bar = (from, to, cls, what) => {
        if (!from) return;
        const b = el("span", `tl-bar ${cls}`);
        b.style.left = pct(from);
        b.style.width = `max(2px, calc(${pct(to || new Date(t1).toISOString())} - ` +
          `${pct(from)}))`;
        b.title = what;
        track.append(b);
      };
      bar(c.queued_at, c.started_at, "tl-wait", "queued, waiting for inputs or an engine");
      bar(c.started_at, c.first_token_at, "tl-prefill", "started, until the first token");
      bar(c.first_token_at, c.finished_at, "tl-decode", "decoding, until finished");
      const facts = el("span", "tl-facts muted",
        `wait ${fmtMs(ms(c.queued_at, c.started_at))} · first token ` +
        `${fmtMs(ms(c.started_at, c.first_token_at))} · decode ` +
        `${fmtMs(ms(c.first_token_at, c.finished_at))}` +
        (c.completion_tokens !== null ? ` · ${c.completion_tokens} tokens` : "") +
        (c.engine ? ` · ${c.engine}` : ""));
      row.append(label, track, facts);
      return row;
    });
    const axis = el("div", "tl-axis muted", `0 — ${fmtMs(span)} after the run was created`);
    this.timelineBox.replaceChildren(axis, ...rows);
  }

  isOver() {
    return TERMINAL.has(this.status);
  }

  // What the page shows, for tests and the console: streamed text and shown values.
  snapshot() {
    this.flush();
    const out = {};
    for (const [name, v] of this.vars) {
      out[name] = { status: v.status, shown: v.text.data, streamed: v.streamed.join(""),
                    tokens: v.count };
    }
    return out;
  }
}
