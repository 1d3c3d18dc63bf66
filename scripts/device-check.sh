#!/usr/bin/env bash
# GPU checks of the fixed-shape decode step, for a machine with CUDA (see scripts/device_check.py): compiled
# step with and without CUDA graphs against eager (tokens, logits), no host sync, no recompiles, and decode
# tokens/s at batch 1/8/16 for eager, compiled, and compiled + CUDA graphs; with part 'hybrid' (or all parts) first
# the split experts' check below (--gpu-experts: tokens, overlap of the GPU's and the CPU's shares). Stops itself
# after $CHECK_SECONDS (7 minutes by default: a lent machine's 15 minutes must also hold its start and a second
# try). Arguments: the parts to run (all by default).
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
hybrid_rc=0
if [ $# -eq 0 ] || [[ " $* " == *" hybrid "* ]]; then
    # Routed experts split (flashserve/model/hybrid.py): (1) EngineConfig(gpu_experts=3) gives the greedy tokens of
    # every expert on the GPU; (2) one layer driven directly, its GPU share slowed by a spin kernel to the CPU share's
    # time: the split step takes well under the two shares' sum (the host computes while the GPU runs), its sums
    # are the CPU's, its staging buffers are pinned and reused. Exit status: the failed checks.
    timeout "${HYBRID_SECONDS:-120}" python3 - <<'PY'
import statistics
import sys
import time

import torch

sys.path.insert(0, "scripts")
from device_check import greedy, prompts  # noqa: E402
from flashserve.engine import EngineConfig, LLMEngine  # noqa: E402
from flashserve.model import hybrid  # noqa: E402
from flashserve.model.moe import Experts  # noqa: E402

failed = []


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        failed.append(name)


kw = dict(model="tiny-v41", device="cuda", dtype="float32", quantization="mxfp4", kv_memory="256MiB", max_num_seqs=8,
          enforce_eager=True, speculative_config=None)  # MXFP4 experts, as released
batch = prompts(3, 40, 4)
want = greedy(LLMEngine(EngineConfig(**kw)), batch, 16)
split = LLMEngine(EngineConfig(gpu_experts=3, **kw))
got = greedy(split, batch, 16)
check("tokens tiny-v41 mxfp4, gpu_experts=3 against every expert on the GPU", got == want,
      f"({split.stats()['hybrid_experts']})" + ("" if got == want else f" first rows {got[0]} against {want[0]}"))

torch.set_grad_enabled(False)
torch.manual_seed(0)
E, D, I, T = 8, 2048, 1024, 64
host = Experts(E, D, I, 10.0)
with torch.no_grad():
    for p in host.parameters():
        p.normal_(0, 0.02)
layer = hybrid.HybridExperts(host, 4)
layer.place([0, 1, 2, 3])
layer.cuda()
layer.steps = hybrid.REBALANCE_STEPS  # past the early rebalances: experts 0-3 stay on the GPU
x = torch.randn(T, D, device="cuda")
on_gpu, on_host = torch.randint(0, 4, (T, 1), device="cuda"), torch.randint(4, 8, (T, 1), device="cuda")
w = torch.rand(T, 2, device="cuda")
steps = {"gpu share": (on_gpu, w[:, :1]), "cpu share": (on_host, w[:, 1:]),
         "split": (torch.cat([on_gpu, on_host], 1), w)}


def ms(idx, wt, n=5):
    times = []
    for _ in range(n + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        layer(x, idx, wt)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[2:])


cpu_ms = ms(*steps["cpu share"])
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
torch.cuda._sleep(10**7)
end.record()
end.synchronize()
cycles = int(10**7 * cpu_ms / start.elapsed_time(end))  # a spin as long as the CPU share
launch = layer._launch_held


def slow_launch(*args):  # the GPU share starts with the spin
    torch.cuda._sleep(cycles)
    launch(*args)


layer._launch_held = slow_launch
t = {name: ms(*v) for name, v in steps.items()}
check("split step overlaps its GPU and CPU shares", t["split"] < 0.75 * (t["gpu share"] + t["cpu share"]),
      "(" + ", ".join(f"{n} {v:.1f} ms" for n, v in t.items()) + ")")
idx = steps["split"][0]
ref = host(x.cpu(), idx.cpu(), w.cpu())
grown = layer.staging.grown
err = (layer(x, idx, w).cpu() - ref).abs().max() / ref.abs().max()
layer(x[:8], idx[:8], w[:8])
check("split step's sums against the CPU's, float32", float(err) < 1e-4, f"(relative {float(err):.1e})")
check("staging buffers pinned and reused", layer.staging.grown == grown
      and all(b.is_pinned() for b in layer.staging.buffers.values()), f"({layer.staging.grown} allocated)")
sys.exit(len(failed))
PY
    hybrid_rc=$?
fi
left=$(( ${CHECK_SECONDS:-420} - SECONDS ))
timeout "$(( left > 60 ? left : 60 ))" python3 scripts/device_check.py "$@"
rc=$?
[ "$rc" -eq 0 ] && rc=$hybrid_rc
if [ -n "${INDUCTOR_CACHE:-}" ]; then
    tar czf "$INDUCTOR_CACHE" -C "$cache_dir" . && echo "inductor cache written to $INDUCTOR_CACHE"
fi
exit $rc
