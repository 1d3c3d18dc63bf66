#!/usr/bin/env bash
# GPU checks of the fixed-shape decode step, for a machine with CUDA (see scripts/device_check.py): compiled
# step with and without CUDA graphs against eager (tokens, logits), no host sync, no recompiles, and decode
# tokens/s at batch 1/8/16 for eager, compiled, and compiled + CUDA graphs. Stops itself after 7 minutes (a lent
# machine's 15 minutes must also hold its start and a second try). Arguments: the parts to run (all by default).
# Uses the machine's own torch (the project asks only for torch>=2.4); llguidance, fastapi and uvicorn are the
# only imports the engine may lack there: pass a folder of wheels as $WHEELS to install them first.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_LOGS="${TORCH_LOGS:-perf_hints}"  # inductor says there why a graph is not replayed as a CUDA graph
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 420 python3 scripts/device_check.py "$@"
