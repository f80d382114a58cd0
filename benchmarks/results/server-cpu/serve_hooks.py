"""`benchmarks/appbench/serve.py` plus two hooks for `map_reduce_cpu.py` (a probe, not a
product feature):

- every engine step's compute-thread wall time and CPU time (`time.thread_time`), written
  to `$PROBE_DIR/compute.json` on SIGUSR1;
- SIGUSR2 sets the token-flush interval of the server's write buffers to the number in
  `$PROBE_DIR/flush`.

Usage: PROBE_DIR=/tmp/x python serve_hooks.py --port 8123 [serve options...]
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "appbench"))
PROBE = Path(os.environ.get("PROBE_DIR", "/tmp"))

from parrot_backend.engine import step_loop  # noqa: E402
from parrot_backend.server.persist import buffer  # noqa: E402

RECORDS: list[tuple[float, float, float, int]] = []
BUFFERS: list = []
_compute = step_loop.StepLoop._compute
_init = buffer.WriteBuffer.__init__


def compute(self, batch):
    w0, c0 = time.perf_counter(), time.thread_time()
    out = _compute(self, batch)
    RECORDS.append((w0, time.perf_counter() - w0, time.thread_time() - c0, len(batch.ids)))
    return out


def init(self, *a, **kw):
    _init(self, *a, **kw)
    BUFFERS.append(self)


def dump(*_):
    (PROBE / "compute.json").write_text(json.dumps(RECORDS))


def set_flush(*_):
    for b in BUFFERS:
        b.flush_interval_s = float((PROBE / "flush").read_text())


step_loop.StepLoop._compute = compute
buffer.WriteBuffer.__init__ = init
signal.signal(signal.SIGUSR1, dump)
signal.signal(signal.SIGUSR2, set_flush)

import serve  # noqa: E402

raise SystemExit(serve.main(sys.argv[1:]))
