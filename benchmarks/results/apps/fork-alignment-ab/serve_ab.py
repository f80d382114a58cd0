"""The bench server (benchmarks/appbench/serve.py) whose engine loop takes the old rule
(three event-loop passes after requests end, whatever came) or the new one (passes until
three in a row bring no new request, at most 16), by the word in the file MODE_FILE
(`old` or `new`), read before every plan: one server, so both rules share its warm state.

    .venv/bin/python benchmarks/results/apps/fork-alignment-ab/serve_ab.py --port 8313 \\
        --data-dir "$(mktemp -d)" --no-prefix-cache &
"""

import runpy
import sys
from pathlib import Path

import parrot_backend.engine.step_loop as step_loop

MODE_FILE = Path("/tmp/fork-alignment-mode")
_rule = step_loop.StepLoop._let_callers_run


async def _let(self) -> None:
    mode = MODE_FILE.read_text().strip() if MODE_FILE.exists() else "new"
    step_loop.MAX_YIELDS_AFTER_END = step_loop.YIELDS_AFTER_END if mode == "old" else 16
    await _rule(self)


step_loop.StepLoop._let_callers_run = _let
serve = Path(__file__).resolve().parents[3] / "appbench" / "serve.py"
sys.argv = [str(serve), *sys.argv[1:]]
runpy.run_path(str(serve), run_name="__main__")
