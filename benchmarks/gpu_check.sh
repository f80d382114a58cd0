#!/usr/bin/env bash
# The device run's one command: bash benchmarks/gpu_check.sh "$OUT" [gpu_check.py options]
#
# Runs benchmarks/gpu_check.py with the machine's own python3 (the GPU image's, which holds
# torch, triton and transformers; nothing can be installed there) and the working tree on
# PYTHONPATH, and tees everything it prints into OUT/log.txt. Wheels carried in .whl/
# (see benchmarks/kernels/README.md) are installed into /tmp/site first.
# Locally, `bash benchmarks/gpu_check.sh /tmp/out --cpu-dry-run` uses .venv's python.
set -u -o pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [--cpu-dry-run] [gpu_check.py options]}
shift
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out"

py=${PYTHON:-}
if [ -z "$py" ]; then
    py=python3
    # .venv is built on the development machine (a CPU torch): only the dry run may use it
    case " $* " in *" --cpu-dry-run "*) [ -x .venv/bin/python ] && py=.venv/bin/python ;; esac
fi

if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

"$py" benchmarks/gpu_check.py "$out" "$@" 2>&1 | tee "$out/log.txt"
exit "${PIPESTATUS[0]}"
