// Programs on the page: built-in examples, parsing what the user pastes (JSON or plain
// templates), the placeholders of a template, and which calls share a prefix.
//
// The server checks every program again; this code only needs the variable names (for
// the input fields) and the segments (for the DAG and its shared-prefix marks).

const NAME = "[A-Za-z_][A-Za-z0-9_.-]*";
const PLACEHOLDER = new RegExp(`(\\\\*)\\{\\{(input|output):(${NAME})\\}\\}`, "g");

// Split a template into segments: {text}, {input: name}, {output: name}. A `{{` after an
// odd run of backslashes is literal text (the server's escape rule); an even run halves.
export function parseTemplate(template) {
  const segments = [];
  let text = "";
  let pos = 0;
  PLACEHOLDER.lastIndex = 0;
  for (let m = PLACEHOLDER.exec(template); m !== null; m = PLACEHOLDER.exec(template)) {
    const slashes = m[1].length;
    text += template.slice(pos, m.index) + "\\".repeat(Math.floor(slashes / 2));
    pos = m.index + m[0].length;
    if (slashes % 2 === 1) {
      text += m[0].slice(slashes);
      continue;
    }
    if (text) segments.push({ text });
    text = "";
    segments.push(m[2] === "input" ? { input: m[3] } : { output: m[3] });
  }
  text += template.slice(pos);
  if (text) segments.push({ text });
  return segments;
}

// The segments of a call: its template, or its chat messages one after the other (the
// server renders those with the model's chat template; names are what matter here).
export function callSegments(call) {
  if (typeof call.template === "string") return parseTemplate(call.template);
  const out = [];
  for (const message of call.messages || []) {
    out.push({ text: `[${message.role}] ` }, ...parseTemplate(String(message.content)));
  }
  return out;
}

// Calls with names, inputs and outputs, in program order (unnamed ones get `#<index>`).
export function describeCalls(program) {
  return program.calls.map((call, i) => {
    const segments = callSegments(call);
    return {
      name: call.name ?? `#${i}`,
      segments,
      inputs: [...new Set(segments.filter((s) => s.input).map((s) => s.input))],
      outputs: segments.filter((s) => s.output).map((s) => s.output),
    };
  });
}

// Input variables (read, never produced) and final outputs (produced, never read).
export function programVariables(program) {
  const calls = describeCalls(program);
  const produced = new Set(calls.flatMap((c) => c.outputs));
  const read = new Set(calls.flatMap((c) => c.inputs));
  const inputs = [...new Set(calls.flatMap((c) => c.inputs))].filter((n) => !produced.has(n));
  const finals = calls.flatMap((c) => c.outputs).filter((n) => !read.has(n));
  return { calls, inputs, finals };
}

// What the user pasted: a run (`{"program": ...}`), a program (`{"calls": [...]}`), a
// list of calls, or plain templates, one call per block between lines of `---`.
// Returns {program, inputs, outputs} (inputs/outputs only when the paste gave them).
export function parseProgramText(text, maxTokens) {
  const trimmed = text.trim();
  if (!trimmed) throw new Error("the program is empty");
  if (trimmed.startsWith("{") || trimmed.startsWith("[")) {
    let value;
    try {
      value = JSON.parse(trimmed);
    } catch (err) {
      // not JSON, but a template that starts with a placeholder or a bracket
      PLACEHOLDER.lastIndex = 0;
      if (PLACEHOLDER.test(trimmed)) return parseTemplates(trimmed, maxTokens);
      throw new Error(`not valid JSON: ${err.message}`);
    }
    if (Array.isArray(value)) return { program: { calls: value } };
    if (value && typeof value === "object" && value.program) {
      return { program: value.program, inputs: value.inputs, outputs: value.outputs };
    }
    if (value && Array.isArray(value.calls)) return { program: value };
    throw new Error('JSON must be a run {"program": ...}, a program {"calls": [...]} ' +
                    "or a list of calls");
  }
  return parseTemplates(trimmed, maxTokens);
}

// Plain templates, one call per block between lines of `---`.
function parseTemplates(trimmed, maxTokens) {
  const blocks = trimmed.split(/^\s*---\s*$/m).map((b) => b.trim()).filter(Boolean);
  const calls = blocks.map((template, i) => {
    const outputs = Object.create(null);  // a variable may be named "__proto__"
    for (const s of parseTemplate(template)) {
      if (s.output) outputs[s.output] = { max_tokens: maxTokens };
    }
    if (!Object.keys(outputs).length) {
      throw new Error(`call ${i + 1} generates nothing: give it an {{output:NAME}}`);
    }
    return { name: `call${i + 1}`, template, outputs };
  });
  return { program: { calls } };
}

// The shareable prefix ends of a call, as segment counts (the server's boundaries):
// after its leading text, after each input before its first output, and at that output.
function boundaries(segments) {
  let end = segments.findIndex((s) => s.output !== undefined);
  const hasOutput = end >= 0;
  if (!hasOutput) end = segments.length;
  const cuts = new Set();
  if (end > 1 && segments[0].text !== undefined) cuts.add(1);
  for (let i = 0; i < end; i++) if (segments[i].input !== undefined) cuts.add(i + 1);
  if (hasOutput && end > 0) cuts.add(end);
  return [...cuts].sort((a, b) => a - b);
}

// Prefixes that two or more calls of the run have: the same text, and the same input
// variables at the same places (one run: equal names mean equal values). Each call is
// marked with its longest one. Returns {byCall: {name: id}, prefixes: [{id, kind,
// chars, through, calls}]}; ids are P1, P2, ... in program order.
export function sharedPrefixes(calls) {
  const keysOf = new Map();
  const counts = new Map();
  for (const call of calls) {
    const keys = boundaries(call.segments).map((k) => JSON.stringify(call.segments.slice(0, k)));
    keysOf.set(call.name, keys);
    for (const key of new Set(keys)) counts.set(key, (counts.get(key) || 0) + 1);
  }
  const ids = new Map();
  const prefixes = [];
  const byCall = Object.create(null);  // no inherited keys: a call may be named "constructor"
  for (const call of calls) {
    const shared = keysOf.get(call.name).filter((k) => counts.get(k) >= 2);
    if (!shared.length) continue;
    const key = shared[shared.length - 1];
    if (!ids.has(key)) {
      const segments = JSON.parse(key);
      const inputs = segments.filter((s) => s.input).map((s) => s.input);
      const prefix = {
        id: `P${prefixes.length + 1}`,
        kind: inputs.length ? "dynamic" : "static",
        chars: segments.reduce((n, s) => n + (s.text ? s.text.length : 0), 0),
        through: inputs,
        calls: [],
      };
      ids.set(key, prefix);
      prefixes.push(prefix);
    }
    ids.get(key).calls.push(call.name);
    byCall[call.name] = ids.get(key).id;
  }
  return { byCall, prefixes };
}

const SYSTEM = "You are a concise analyst. You read carefully, you never invent facts, " +
  "and you answer in plain sentences without lists.";

function chat(name, system, user, output, maxTokens) {
  return {
    name,
    messages: [
      { role: "system", content: system },
      { role: "user", content: user },
      { role: "assistant", content: `{{output:${output}}}` },
    ],
    outputs: { [output]: { max_tokens: maxTokens } },
  };
}

const CHUNKS = [
  "Parrots are found in most tropical and subtropical regions, with the greatest " +
    "diversity in South America and Australasia.",
  "Many parrots can imitate human speech; the African grey is known for associating " +
    "words with their meanings.",
  "Parrots eat seeds, fruit, nuts and buds, and their strong curved beaks crack " +
    "hard shells easily.",
  "Several parrot species are endangered because of habitat loss and trapping for " +
    "the pet trade.",
];

const ROLES = ["optimist", "skeptic", "engineer"];

// The built-in examples: {id, title, about, run: {program, inputs, outputs}}.
export const EXAMPLES = [
  {
    id: "chain",
    title: "Chain: plan, then write",
    about: "Two calls; the second reads the plan the first generates.",
    run: {
      program: {
        calls: [
          chat("plan", "You are a helpful assistant.",
               "Write a one-line plan to {{input:task}}.", "plan", 48),
          chat("write", "You are a helpful assistant.",
               "Follow this plan: {{input:plan}}\nAnswer in two sentences.", "answer", 64),
        ],
      },
      inputs: { task: "explain why parrots can talk" },
      outputs: { answer: "latency" },
    },
  },
  {
    id: "map-reduce",
    title: "Map-reduce with a shared system prompt",
    about: "Four summaries in parallel (one task group, one shared system prompt), " +
      "then one call combines them.",
    run: {
      program: {
        calls: [
          ...CHUNKS.map((_, i) => chat(`map${i + 1}`, SYSTEM,
            `Summarize this passage in one sentence:\n{{input:chunk${i + 1}}}`,
            `summary${i + 1}`, 40)),
          chat("reduce", SYSTEM, "Combine these summaries into one short paragraph:\n" +
               CHUNKS.map((_, i) => `- {{input:summary${i + 1}}}`).join("\n"),
               "digest", 80),
        ],
      },
      inputs: Object.fromEntries(CHUNKS.map((c, i) => [`chunk${i + 1}`, c])),
      outputs: { digest: "latency" },
    },
  },
  {
    id: "multi-agent",
    title: "Multi-agent fan-out",
    about: "One call writes a question; three agents read it (a prefix generated at run " +
      "time, shared by all three), and a moderator sums up.",
    run: {
      program: {
        calls: [
          chat("host", "You are a debate host.",
               "Ask one short, open question about {{input:theme}}.", "question", 32),
          ...ROLES.map((role) => chat(role,
            "You are one of three agents discussing a question. Answer in two sentences.",
            `Question: {{input:question}}\nYou speak as the ${role}.`, `${role}_view`, 48)),
          chat("moderator", "You are a fair moderator.",
               "Question: {{input:question}}\n" +
               ROLES.map((r) => `The ${r} said: {{input:${r}_view}}`).join("\n") +
               "\nGive a one-sentence verdict.", "verdict", 48),
        ],
      },
      inputs: { theme: "cities built for birds" },
      outputs: { verdict: "latency" },
    },
  },
];
