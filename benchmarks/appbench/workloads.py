"""The paper's applications as DAGs of calls, one definition for every mode.

A workload is a list of calls; each call is a template whose inputs are `{{input:x}}`
placeholders and which ends with its one `{{output:y}}`. Parrot mode submits the calls as
one program (`POST /v1/runs`); request-level mode renders each template with its input
values (the prompt is everything before the output placeholder) and sends it to
`/v1/completions` once those values exist. Texts are seeded (`texts.py`): every
repetition and mode gets its own seed, so no run finds another run's prompt in a cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from . import texts

INPUT = re.compile(r"\{\{input:([A-Za-z0-9_.-]+)\}\}")
OUTPUT = re.compile(r"\{\{output:([A-Za-z0-9_.-]+)\}\}$")


@dataclass
class Call:
    name: str
    template: str
    max_tokens: int
    # generate max_tokens whatever the model says (both modes): equal lengths where the
    # texts differ between modes, as they must (no run may find another's prompt cached)
    ignore_eos: bool = False

    @property
    def output(self) -> str:
        return OUTPUT.search(self.template).group(1)

    @property
    def inputs(self) -> list[str]:
        return list(dict.fromkeys(INPUT.findall(self.template)))

    def render(self, values: dict[str, str]) -> str:
        """The prompt: the template up to its output, with the input values in place."""
        head = self.template[: OUTPUT.search(self.template).start()]
        return INPUT.sub(lambda m: values[m.group(1)], head)

    def spec(self) -> dict:
        config: dict = {"max_tokens": self.max_tokens, "temperature": 0}
        if self.ignore_eos:
            config["ignore_eos"] = True
        return {"name": self.name, "template": self.template, "outputs": {self.output: config}}


@dataclass
class Workload:
    name: str
    calls: list[Call]
    inputs: dict[str, str]
    outputs: list[str]  # what the client waits for
    criterion: str = "latency"
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for c in self.calls:
            if OUTPUT.search(c.template) is None:
                raise ValueError(f"{c.name}: a template must end with its output")


def _n(template: str, i: int) -> str:
    """Number a template's names: `#` becomes i, `+` becomes i + 1."""
    return template.replace("#", str(i)).replace("+}", f"{i + 1}}}")


def _safe(text: str) -> str:
    return text.replace("{", "(").replace("}", ")")


# name -> (default CPU size, --quick size)
SIZES = {
    "shared_prompt": (
        {"users": 8, "prompt": 1024, "gen": 16},
        {"users": 3, "prompt": 96, "gen": 4},
    ),
    "chain_summary": ({"parts": 5, "part": 160, "gen": 24}, {"parts": 2, "part": 32, "gen": 4}),
    "map_reduce": (
        {"docs": 8, "doc": 160, "gen": 24, "reduce": 32},
        {"docs": 3, "doc": 32, "gen": 4, "reduce": 4},
    ),
    "multi_agent": (
        {"engineers": 4, "design": 128, "gen": 32, "review": 16},
        {"engineers": 2, "design": 8, "gen": 4, "review": 4},
    ),
}


def shared_prompt(
    seed: int, users: int, prompt: int, gen: int, ignore_eos: bool = False
) -> Workload:
    """N users ask one assistant whose long system prompt is the shared prefix."""
    system = _safe(texts.system_prompt(seed, prompt))
    turn = "\n\nUser: {{input:q#}}\nAssistant: {{output:a#}}"
    calls = [Call(f"user{i}", system + _n(turn, i), gen, ignore_eos) for i in range(users)]
    inputs = {f"q{i}": texts.question(seed * 100 + i) for i in range(users)}
    return Workload(
        "shared_prompt",
        calls,
        inputs,
        [f"a{i}" for i in range(users)],
        info={"users": users, "prompt_tokens": prompt, "gen": gen},
    )


def chain_summary(seed: int, parts: int, part: int, gen: int) -> Workload:
    """Summary so far + next part -> updated summary, one step after another."""
    chunks = texts.chunks(seed, parts, part)
    calls, inputs = [], {"s0": "(nothing yet)"}
    for i, chunk in enumerate(chunks):
        inputs[f"part{i}"] = _safe(chunk)
        calls.append(
            Call(
                f"step{i}",
                _n(
                    "You keep a running summary of a long document.\n"
                    "Summary so far: {{input:s#}}\nNext part:\n"
                    "{{input:part#}}\nUpdated summary: {{output:s+}}",
                    i,
                ),
                gen,
            )
        )
    return Workload(
        "chain_summary",
        calls,
        inputs,
        [f"s{parts}"],
        info={"parts": parts, "part_tokens": part, "gen": gen},
    )


def map_reduce(seed: int, docs: int, doc: int, gen: int, reduce: int) -> Workload:
    """Summarise each document in parallel (map), then combine the summaries (reduce)."""
    head = "You summarise documents for a busy reader. Keep only the main point.\n"
    inputs = {f"doc{i}": _safe(texts.document(seed * 100 + i, doc)) for i in range(docs)}
    calls = [
        Call(f"map{i}", head + _n("Document:\n{{input:doc#}}\nSummary: {{output:m#}}", i), gen)
        for i in range(docs)
    ]
    joined = "\n".join(_n("- {{input:m#}}", i) for i in range(docs))
    calls.append(
        Call(
            "reduce",
            head + "Combine these summaries:\n" + joined + "\nCombined summary: {{output:final}}",
            reduce,
        )
    )
    return Workload(
        "map_reduce",
        calls,
        inputs,
        ["final"],
        info={"docs": docs, "doc_tokens": doc, "gen": gen, "reduce": reduce},
    )


def multi_agent(seed: int, engineers: int, design: int, gen: int, review: int) -> Workload:
    """An architect's generated design is the shared prefix of N engineers; a reviewer
    reads each engineer's code (MetaGPT-style, one round)."""
    task = f"a small command-line tool about {texts.TOPICS[seed % len(texts.TOPICS)]}"
    calls = [
        Call(
            "architect",
            "You are the architect of a software team.\nTask: "
            "{{input:task}}\nWrite the design: modules and their functions.\n"
            "Design:\n{{output:design}}",
            design,
        )
    ]
    inputs = {"task": task}
    for i in range(engineers):
        inputs[f"file{i}"] = f"module_{i}.py, part {i + 1} of the design"
        calls.append(
            Call(
                f"engineer{i}",
                _n(
                    "You are an engineer on the team. Task: {{input:task}}\n"
                    "The architect's design:\n"
                    "{{input:design}}\nYour file: {{input:file#}}\nCode:\n{{output:code#}}",
                    i,
                ),
                gen,
            )
        )
        calls.append(
            Call(
                f"review{i}",
                _n(
                    "You review code against its design.\nDesign:\n{{input:design}}\nCode:\n"
                    "{{input:code#}}\nThe main problem: {{output:review#}}",
                    i,
                ),
                review,
            )
        )
    return Workload(
        "multi_agent",
        calls,
        inputs,
        [f"review{i}" for i in range(engineers)],
        info={"engineers": engineers, "design_tokens": design, "gen": gen},
    )


BUILDERS = {
    "shared_prompt": shared_prompt,
    "chain_summary": chain_summary,
    "map_reduce": map_reduce,
    "multi_agent": multi_agent,
}


# name -> --gpu size: the paper's scale (a ~6k-token shared prompt, 1k-token chunks,
# a several-hundred-token generated design), for an engine that decodes in milliseconds
GPU_SIZES = {
    "shared_prompt": {"users": 64, "prompt": 6144, "gen": 64},
    "chain_summary": {"parts": 12, "part": 1024, "gen": 64},
    "map_reduce": {"docs": 32, "doc": 1024, "gen": 64, "reduce": 128},
    "multi_agent": {"engineers": 8, "design": 512, "gen": 256, "review": 64},
}


def build(name: str, seed: int, quick: bool = False, gpu: bool = False, **over) -> Workload:
    """Workload `name` at its CPU size, `--quick` size or `--gpu` size, with overrides."""
    size = dict(GPU_SIZES[name] if gpu else SIZES[name][1 if quick else 0])
    size.update({k: v for k, v in over.items() if k in size and v is not None})
    return BUILDERS[name](seed, **size)
