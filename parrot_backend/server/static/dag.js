// The run's DAG as SVG: calls in layers (a call sits right of every call it reads from),
// input variables on the left, edges labelled with the variable they carry.
//
// Built once per program (and again when calls are added to an open run); a call's state
// change touches only its own node, so a run of many calls costs no re-layout per event.

const SVG = "http://www.w3.org/2000/svg";
const NODE_W = 190;
const NODE_H = 60;
const INPUT_H = 28;
const GAP_X = 64;
const GAP_Y = 14;
const PAD = 12;
const MAX_EDGE_LABELS = 30;
export const PREFIX_COLORS = ["#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d", "#4b5563"];

// Names cut to fit their boxes (SVG text neither wraps nor clips); the full name is in
// a title. Measured once the SVG is in the page, only for names long enough to matter.
function fitTexts(items) {
  for (const [el, full, maxPx] of items) {
    if (full.length <= 12 || el.getComputedTextLength() <= maxPx) continue;
    let lo = 1;
    let hi = full.length - 1;
    while (lo < hi) {
      const mid = Math.ceil((lo + hi) / 2);
      el.textContent = `${full.slice(0, mid)}…`;
      if (el.getComputedTextLength() <= maxPx) lo = mid;
      else hi = mid - 1;
    }
    el.textContent = `${full.slice(0, lo)}…`;
  }
}

function svg(tag, attrs = {}, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

// Layers by longest path from the sources, then a few barycenter sweeps to cut crossings.
function layout(vertices, edges) {
  const preds = new Map(vertices.map((v) => [v.id, []]));
  const succs = new Map(vertices.map((v) => [v.id, []]));
  for (const e of edges) {
    preds.get(e.to).push(e.from);
    succs.get(e.from).push(e.to);
  }
  const layer = new Map();
  const visiting = new Set();
  const depth = (id) => {
    if (layer.has(id)) return layer.get(id);
    if (visiting.has(id)) return 0;  // not a DAG (the server rejects those): do not hang
    visiting.add(id);
    let d = 0;
    for (const p of preds.get(id)) d = Math.max(d, depth(p) + 1);
    visiting.delete(id);
    layer.set(id, d);
    return d;
  };
  for (const v of vertices) depth(v.id);
  const layers = [];
  for (const v of vertices) (layers[layer.get(v.id)] ||= []).push(v.id);
  const pos = new Map();
  const index = () => layers.forEach((ids) => ids.forEach((id, i) => pos.set(id, i)));
  index();
  const center = (ids) => ids.reduce((s, id) => s + pos.get(id), 0) / ids.length;
  for (let sweep = 0; sweep < 4; sweep++) {
    const down = sweep % 2 === 0;
    const order = down ? layers.slice(1) : layers.slice(0, -1).reverse();
    for (const ids of order) {
      const score = new Map(ids.map((id) => {
        const near = (down ? preds : succs).get(id);
        return [id, near.length ? center(near) : pos.get(id)];
      }));
      ids.sort((a, b) => score.get(a) - score.get(b));
      ids.forEach((id, i) => pos.set(id, i));
    }
  }
  index();
  return layers;
}

export class DagView {
  constructor(container, legend) {
    this.container = container;
    this.legend = legend;
    this.nodes = new Map();  // call name -> {g, state, engine, objective, group elements}
  }

  // calls: [{name, inputs, outputs}] (program.describeCalls); prefixes: sharedPrefixes().
  build(calls, prefixes) {
    this.nodes.clear();
    const producer = new Map();
    for (const c of calls) for (const o of c.outputs) producer.set(o, c.name);
    const vertices = [];
    const edges = [];
    const inputs = new Set();
    for (const c of calls) {
      for (const v of c.inputs) {
        if (producer.has(v)) {
          edges.push({ from: `c:${producer.get(v)}`, to: `c:${c.name}`, label: v });
        } else {
          if (!inputs.has(v)) vertices.push({ id: `v:${v}`, kind: "input", name: v });
          inputs.add(v);
          edges.push({ from: `v:${v}`, to: `c:${c.name}`, label: v });
        }
      }
    }
    for (const c of calls) vertices.push({ id: `c:${c.name}`, kind: "call", name: c.name });
    const layers = layout(vertices, edges);
    const byId = new Map(vertices.map((v) => [v.id, v]));
    const place = new Map();
    const colHeight = (ids) => ids.reduce(
      (h, id) => h + (byId.get(id).kind === "input" ? INPUT_H : NODE_H) + GAP_Y, -GAP_Y);
    const tallest = Math.max(...layers.map(colHeight));
    layers.forEach((ids, col) => {
      let y = PAD + (tallest - colHeight(ids)) / 2;
      for (const id of ids) {
        const h = byId.get(id).kind === "input" ? INPUT_H : NODE_H;
        place.set(id, { x: PAD + col * (NODE_W + GAP_X), y, h });
        y += h + GAP_Y;
      }
    });
    const width = PAD * 2 + layers.length * NODE_W + (layers.length - 1) * GAP_X;
    const root = svg("svg", { width, height: tallest + PAD * 2, class: "dag-svg",
                              role: "img", "aria-label": "DAG of the run's calls" });
    const edgeLayer = svg("g", { class: "edges" });
    const toFit = [];  // [text element, full text, width it may take]
    root.append(edgeLayer);
    for (const e of edges) {
      const a = place.get(e.from);
      const b = place.get(e.to);
      const x1 = a.x + NODE_W;
      const y1 = a.y + a.h / 2;
      const x2 = b.x;
      const y2 = b.y + b.h / 2;
      const mid = (x1 + x2) / 2;
      const path = svg("path", { d: `M${x1},${y1} C${mid},${y1} ${mid},${y2} ${x2},${y2}`,
                                 class: "edge" });
      path.append(svg("title", {}, e.label));
      edgeLayer.append(path);
      if (edges.length <= MAX_EDGE_LABELS) {
        const label = svg("text", { x: mid, y: (y1 + y2) / 2 - 3, class: "edge-label",
                                    "text-anchor": "middle" }, e.label);
        toFit.push([label, e.label, GAP_X - 6]);
        edgeLayer.append(label);
      }
    }
    const colorOf = new Map(prefixes.prefixes.map((p, i) => [p.id, PREFIX_COLORS[i %
      PREFIX_COLORS.length]]));
    for (const v of vertices) {
      const p = place.get(v.id);
      const g = svg("g", { transform: `translate(${p.x},${p.y})` });
      if (v.kind === "input") {
        g.setAttribute("class", "node input");
        g.append(svg("rect", { width: NODE_W, height: INPUT_H, rx: 14 }));
        const label = svg("text", { x: 12, y: 18, class: "input-name" }, `input ${v.name}`);
        toFit.push([label, `input ${v.name}`, NODE_W - 20]);
        g.append(label, svg("title", {}, `input ${v.name}`));
        root.append(g);
        continue;
      }
      g.setAttribute("class", "node call state-queued");
      g.setAttribute("data-call", v.name);
      g.setAttribute("data-state", "queued");
      g.append(svg("rect", { width: NODE_W, height: NODE_H, rx: 6, class: "box" }));
      const prefix = prefixes.byCall[v.name];
      if (prefix) {
        g.setAttribute("data-prefix", prefix);
        g.append(svg("rect", { width: 6, height: NODE_H, rx: 3, fill: colorOf.get(prefix),
                               class: "prefix-stripe" }));
        g.append(svg("text", { x: NODE_W - 8, y: 17, "text-anchor": "end", class: "prefix-tag",
                               fill: colorOf.get(prefix) }, prefix));
      }
      const name = svg("text", { x: 14, y: 17, class: "call-name" }, v.name);
      toFit.push([name, v.name, NODE_W - 14 - (prefix ? 36 : 8)]);
      const state = svg("text", { x: 14, y: 35, class: "call-state" }, "queued");
      const meta = svg("text", { x: 14, y: 52, class: "call-meta" }, "");
      const title = svg("title", {}, v.name);
      g.append(name, state, meta, title);
      root.append(g);
      this.nodes.set(v.name, { g, state, meta, title, info: { state: "queued" } });
    }
    this.container.replaceChildren(root);
    fitTexts(toFit);
    this._legend(prefixes, colorOf);
  }

  _legend(prefixes, colorOf) {
    const items = prefixes.prefixes.map((p) => {
      const li = document.createElement("li");
      const chip = document.createElement("span");
      chip.className = "chip";
      chip.style.background = colorOf.get(p.id);
      chip.textContent = p.id;
      const what = p.kind === "static"
        ? `shared static prefix (${p.chars} chars of text)`
        : `shared prefix through {{input:${p.through.join("}}, {{input:")}}} (a value ` +
          "known at run time)";
      li.append(chip, ` ${what}: ${p.calls.join(", ")}`);
      return li;
    });
    if (!items.length) {
      const li = document.createElement("li");
      li.textContent = "no prefix is shared by two calls";
      items.push(li);
    }
    this.legend.replaceChildren(...items);
  }

  // Update one call: any of state, engine, objective, group, error, attempts.
  setCall(name, change) {
    const node = this.nodes.get(name);
    if (!node) return;
    const info = Object.assign(node.info, change);
    node.g.setAttribute("class", `node call state-${info.state}`);
    node.g.setAttribute("data-state", info.state);
    node.state.textContent = info.engine ? `${info.state} · ${info.engine}` : info.state;
    const meta = [];
    if (info.objective) meta.push(info.objective);
    if (info.group !== undefined && info.group !== null) meta.push(`group ${info.group}`);
    if (info.attempts > 1) meta.push(`attempt ${info.attempts}`);
    node.meta.textContent = meta.join(" · ");
    node.title.textContent = info.error ? `${name}: ${info.error}` : name;
  }

  states() {
    return Object.fromEntries([...this.nodes].map(([name, n]) => [name, n.info.state]));
  }
}
