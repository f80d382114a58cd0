// The native API as the page uses it: JSON over fetch, the key in a header.
//
// The key is kept in sessionStorage (this tab only, gone when it closes) so a reload does
// not ask again; it is sent only in the Authorization header, never in a URL.

const KEY_SLOT = "parrot.apiKey";

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export class Api {
  constructor() {
    this.key = sessionStorage.getItem(KEY_SLOT) || null;
  }

  setKey(key) {
    this.key = key || null;
    if (this.key) sessionStorage.setItem(KEY_SLOT, this.key);
    else sessionStorage.removeItem(KEY_SLOT);
  }

  async request(method, path, body) {
    const headers = { Accept: "application/json" };
    if (this.key) headers.Authorization = `Bearer ${this.key}`;
    const init = { method, headers, cache: "no-store", credentials: "same-origin" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (err) {
      throw new ApiError(0, `network error: ${err.message}`, "network");
    }
    if (response.status === 204) return null;
    const text = await response.text();
    let data = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch {
      data = null;
    }
    if (!response.ok) {
      const error = data && data.error;
      throw new ApiError(response.status,
                         error ? error.message : `${response.status} ${response.statusText}`,
                         error ? error.code : null);
    }
    return data;
  }

  listRuns({ status = "", limit = 30, offset = 0 } = {}) {
    const query = new URLSearchParams({ limit: String(limit), offset: String(offset) });
    if (status) query.set("status", status);
    return this.request("GET", `/v1/runs?${query}`);
  }

  getRun(runId) {
    return this.request("GET", `/v1/runs/${encodeURIComponent(runId)}`);
  }

  createRun(spec) {
    return this.request("POST", "/v1/runs", spec);
  }

  replay(runId) {
    return this.request("POST", `/v1/runs/${encodeURIComponent(runId)}/replay`, {});
  }

  cancel(runId) {
    return this.request("POST", `/v1/runs/${encodeURIComponent(runId)}/cancel`);
  }

  // An events grant: a short-lived cookie for this run's event stream (EventSource
  // cannot send the Authorization header). Needed only when auth is on.
  grant(runId) {
    return this.request("POST", `/v1/runs/${encodeURIComponent(runId)}/events/grant`);
  }
}
