#!/usr/bin/env bash
# GPU checks of the fixed-shape decode step, for a machine with CUDA (see scripts/device_check.py): compiled
# step with and without CUDA graphs against eager (tokens, logits), no host sync, no recompiles, and decode
# tokens/s at batch 1/8/16 for eager, compiled, and compiled + CUDA graphs. Stops itself after $CHECK_SECONDS
# (7 minutes by default: a lent machine's 15 minutes must also hold its start and a second try). Arguments: the
# parts to run (all by default).
# Uses the machine's own torch (the project asks only for torch>=2.4); llguidance, fastapi and uvicorn are the
# only imports the engine may lack there: pass a folder of wheels as $WHEELS to install them first.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_LOGS="${TORCH_LOGS:-perf_hints}"  # inductor says there why a graph is not replayed as a CUDA graph
# A cold compile of the dynamic-batch step CUDA uses can take longer than a lent machine's time
# (docs/engine-speed.md#cuda-graphs); a warm inductor cache avoids most of it: INDUCTOR_CACHE=file.tgz restores
# inductor's cache from that file when it exists, and writes it back afterwards (carry it to the next machine).
cache_dir="${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(whoami)}"
if [ -n "${INDUCTOR_CACHE:-}" ] && [ -f "$INDUCTOR_CACHE" ]; then
    mkdir -p "$cache_dir" && tar xzf "$INDUCTOR_CACHE" -C "$cache_dir" \
        && echo "inductor cache restored from $INDUCTOR_CACHE"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout "${CHECK_SECONDS:-420}" python3 scripts/device_check.py "$@"
rc=$?
if [ -n "${INDUCTOR_CACHE:-}" ]; then
    tar czf "$INDUCTOR_CACHE" -C "$cache_dir" . && echo "inductor cache written to $INDUCTOR_CACHE"
fi
exit $rc
