// A run's event stream in the browser: EventSource on /v1/runs/{id}/events, resumed
// after any drop from the last event id seen, so nothing is lost or repeated.
//
// Every error closes the EventSource and the page reconnects itself with `?after=<last
// seq>`, after a fresh events grant when auth is on (a grant is checked only when a
// stream connects, so it can be short-lived). Letting EventSource reconnect by itself
// would resend the URL's first `after`, which the server prefers to Last-Event-ID.
// Ids are the store's per-run seqs (1, 2, 3, ... without gaps): an id not above the
// last is a duplicate and dropped; a jump is counted as missing events.

export const EVENT_TYPES = [
  "run_created", "run_resumed", "objectives", "calls_added", "run_closed", "call_started",
  "token", "variable_ready", "variable_failed", "call_finished", "call_failed",
  "run_finished",
];

const RETRY_FIRST_MS = 300;
const RETRY_MAX_MS = 5000;

export class RunStream {
  // onEvent(type, data, seq) for each new event; onState(state, detail) with state one
  // of connecting, live, reconnecting, finished, ended, error.
  constructor(api, runId, { onEvent, onState }) {
    this.api = api;
    this.runId = runId;
    this.onEvent = onEvent;
    this.onState = onState;
    this.lastSeq = 0;
    this.es = null;
    this.closed = false;
    this.retryMs = RETRY_FIRST_MS;
    this.timer = null;
    this.eventsThisConnection = 0;
    this.emptyBefore = false;
    this.stats = {
      events: 0, tokens: 0, duplicates: 0, missing: 0, connections: 0, reconnects: 0,
      handlerCount: 0, handlerTotalMs: 0, handlerMaxMs: 0,
    };
  }

  start() {
    this.onState("connecting");
    this._connect();
  }

  close(state = "ended") {
    if (this.closed) return;
    this.closed = true;
    clearTimeout(this.timer);
    if (this.es) this.es.close();
    this.es = null;
    this.onState(state);
  }

  async _connect() {
    if (this.closed) return;
    if (this.api.key) {
      try {
        await this.api.grant(this.runId);
      } catch (err) {
        if (err.status === 401 || err.status === 404) {
          this.close("error");
          this.onState("error", err.message);
          return;
        }
        this._retry();  // the network, or the server restarting: try again
        return;
      }
      if (this.closed) return;
    }
    const after = this.lastSeq ? `?after=${this.lastSeq}` : "";
    const es = new EventSource(`/v1/runs/${encodeURIComponent(this.runId)}/events${after}`);
    this.es = es;
    this.eventsThisConnection = 0;
    es.onopen = () => {
      this.stats.connections += 1;
      if (this.stats.connections > 1) this.stats.reconnects += 1;
      this.retryMs = RETRY_FIRST_MS;
      this.onState("live");
    };
    es.onerror = () => {
      if (this.closed || this.es !== es) return;
      es.close();
      this.es = null;
      this._dropped();
    };
    for (const type of EVENT_TYPES) {
      es.addEventListener(type, (message) => this._handle(type, message));
    }
  }

  async _dropped() {
    // A stream that ends without run_finished twice in a row, delivering nothing, on a
    // run that is over: its end was already sent, or pruned. Stop instead of looping.
    if (this.eventsThisConnection === 0) {
      try {
        const detail = await this.api.getRun(this.runId);
        if (["done", "failed", "cancelled"].includes(detail.run.status) && this.emptyBefore) {
          this.close("ended");
          return;
        }
        this.emptyBefore = true;
      } catch (err) {
        // no such run (or not this key's): retrying would never end; say so and stop
        if (err.status === 401 || err.status === 404) {
          this.close("error");
          this.onState("error", err.message);
          return;
        }
        // otherwise unreachable now: keep retrying below
      }
    } else {
      this.emptyBefore = false;
    }
    this._retry();
  }

  _retry() {
    if (this.closed) return;
    this.onState("reconnecting");
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this._connect(), this.retryMs);
    this.retryMs = Math.min(this.retryMs * 2, RETRY_MAX_MS);
  }

  _handle(type, message) {
    const started = performance.now();
    const seq = Number(message.lastEventId);
    if (!(seq > this.lastSeq)) {
      this.stats.duplicates += 1;
      return;
    }
    if (seq !== this.lastSeq + 1) this.stats.missing += seq - this.lastSeq - 1;
    this.lastSeq = seq;
    this.eventsThisConnection += 1;
    this.stats.events += 1;
    if (type === "token") this.stats.tokens += 1;
    this.onEvent(type, JSON.parse(message.data), seq);
    if (type === "run_finished") this.close("finished");
    const took = performance.now() - started;
    this.stats.handlerCount += 1;
    this.stats.handlerTotalMs += took;
    if (took > this.stats.handlerMaxMs) this.stats.handlerMaxMs = took;
  }
}
