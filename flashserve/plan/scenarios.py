"""Published measurements the planner is checked against, each with the deployment assumed for it.

``metric`` says which planner output the published per-GPU figure corresponds to:
``decode`` = output tokens/s per decode GPU (prefill pool excluded), ``total`` = InferenceX's
``tput_per_gpu`` (prompt + output tokens over every GPU), ``none`` = no per-GPU figure.
``role`` is ``fit`` when the point set its hardware's efficiency profile, ``held_out`` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .inputs import PlanInputs

RF = "docs/reference-figures.md §3"


@dataclass(frozen=True)
class PublishedPoint:
    """One published (per-agent, per-GPU) point and the deployment the planner assumes for it."""

    name: str
    source: str
    inputs: PlanInputs
    tokens_per_s_per_agent: float
    tokens_per_s_per_gpu: float | None
    metric: str  # decode, total or none
    role: str  # fit or held_out
    assumptions: str
    agent_metric: str = "cycle"  # cycle: per-agent speed with the prefill share; step: AL / decode step (TPOT)


def _r1(**kw: object) -> PlanInputs:
    return PlanInputs(model="deepseek-r1", **kw)  # type: ignore[arg-type]


def _inferencex(per_user: float, per_gpu: float, gpus: int, **kw: object) -> PlanInputs:
    """InferenceX 1k/1k: concurrency implied by the point (tput_per_gpu / 2 output tokens per GPU per user)."""
    conc = round(per_gpu / 2 / per_user * gpus)
    return _r1(hardware="gb300-nvl72", gpus=gpus, weight_dtype="fp4", kv_dtype="fp8", concurrency=conc,
               prompt_len=1024, output_len=1024, **kw)


V41_STACK = "v41-vllm-sglang-2026-09"
INFERENCEX_PR = "https://github.com/SemiAnalysisAI/InferenceX/pull/"
GB300_VLLM_TPOT_MS = {1: 2.19, 2: 2.35, 4: 2.51, 8: 2.83, 16: 3.85}  # PR 3176, baseline 2026-09-15


def _v41_dspark(hardware: str, ep: int, concurrency: int) -> PlanInputs:
    """V4.1-Flash with five-token DSpark at InferenceX's committed acceptance length 3.51 on 4 GPUs in TP4.
    The agentic traces' context is not published per point: 64K with 90% prefix hits is assumed (V4.1's
    bounded reads make the step nearly independent of it at these concurrencies)."""
    return PlanInputs(model="deepseek-v41-flash", hardware=hardware, gpus=4, tp=4, ep=ep, weight_dtype="fp4",
                      concurrency=concurrency, context=65536, prompt_len=65536, output_len=1024,
                      accept_length=3.51, draft_tokens=5, prefix_hit_rate=0.9, stack=V41_STACK)


def _gb300_vllm(concurrency: int, role: str) -> PublishedPoint:
    tpot = GB300_VLLM_TPOT_MS[concurrency]
    return PublishedPoint(
        f"gb300-v41-dspark-vllm-c{concurrency}",
        f"{INFERENCEX_PR}3176 (InferenceX AgentX, vLLM, 4xGB300 TP4/EP1, baseline 2026-09-15: concurrency "
        f"{concurrency}, mean TPOT {tpot} ms, golden acceptance length 3.51)",
        _v41_dspark("gb300-nvl72", 1, concurrency), 1000.0 / tpot, None, "none", role,
        "per-agent decode speed = 1000 / TPOT; five-token DSpark, experts tensor-sharded (EP1)", "step")


PUBLISHED: tuple[PublishedPoint, ...] = (
    PublishedPoint(
        "b200-r1-batch1", f"{RF}: TensorRT-LLM tech blog 1 (8×B200, ISL 1k / OSL 2k, no MTP)",
        _r1(hardware="b200", gpus=8, tp=8, ep=8, weight_dtype="fp4", kv_dtype="fp8", concurrency=1,
            prompt_len=1024, output_len=2048),
        111.0, None, "none", "fit",
        "TP8 attention, FP4 experts on 8 EP ranks, FP8 KV; context = ISL + OSL/2"),
    PublishedPoint(
        "b200-r1-batch1-mtp3", f"{RF}: TensorRT-LLM tech blog 1 (MTP-3, acceptance length 2.82)",
        _r1(hardware="b200", gpus=8, tp=8, ep=8, weight_dtype="fp4", kv_dtype="fp8", concurrency=1,
            prompt_len=1024, output_len=2048, accept_length=2.82, draft_tokens=3),
        368.0, None, "none", "held_out",
        "as batch 1, plus three sequential MTP passes (one layer + head each) and 4 verified rows per step"),
    PublishedPoint(
        "b200-r1-batch1-mtp3-mar2025", f"{RF}: TensorRT-LLM tech blog 1, March 2025 figure (253 = 111 × 2.28, §4)",
        _r1(hardware="b200", gpus=8, tp=8, ep=8, weight_dtype="fp4", kv_dtype="fp8", concurrency=1,
            prompt_len=1024, output_len=2048, accept_length=2.82, draft_tokens=3),
        253.0, None, "none", "held_out",
        "the same software generation as the 111 point: MTP-3's 2.28x speed-up at AL 2.82 (§4)"),
    PublishedPoint(
        "h100-sglang-ep72", f"{RF}: SGLang on 96×H100 (LMSYS, May 2025), decode 9 nodes EP72",
        _r1(hardware="h100", gpus=72, ep=72, prefill_gpus=24, weight_dtype="fp8", kv_dtype="bf16",
            concurrency=20052, prompt_len=2000, output_len=100, context=2050),
        10.0, 2785.0, "decode", "fit",
        "9 decode nodes: attention DP72, DeepEP low-latency over RDMA, no MTP; 3 prefill nodes; "
        "ITL 100 ms → 10 tok/s/user; "
        "concurrency = 2,785 / 10 × 72 sequences"),
    PublishedPoint(
        "h800-deepseek-production", f"{RF}: DeepSeek inference system overview (open-infra-index day 6)",
        _r1(hardware="h800", gpus=144, ep=144, prefill_gpus=48, weight_dtype="fp8", kv_dtype="bf16",
            concurrency=13320, context=4989, accept_length=1.8, draft_tokens=1),
        20.0, 1850.0, "decode", "held_out",
        "decode EP144 with attention DP144 (separate prefill pool), MTP-1 at AL 1.8 (85-90% second-token "
        "acceptance), mean KV 4,989; "
        "concurrency = 1,850 / 20 × 144 sequences"),
    PublishedPoint(
        "gb300-inferencex-71", f"{RF}: InferenceX GB300 FP4 1k/1k (tput_per_gpu counts prompt + output tokens)",
        _inferencex(71.0, 11951.0, 72, ep=72),
        71.0, 11951.0, "total", "fit",
        "72 GPUs, attention DP72 + EP72, FP8 KV, no MTP, prefill sharing the GPUs"),
    PublishedPoint(
        "gb300-inferencex-128", f"{RF}: InferenceX GB300 FP4 1k/1k",
        _inferencex(128.0, 4793.0, 72, ep=72),
        128.0, 4793.0, "total", "held_out",
        "72 GPUs, attention DP72 + EP72, FP8 KV, no MTP, prefill sharing the GPUs"),
    PublishedPoint(
        "gb300-inferencex-184", f"{RF}: InferenceX GB300 FP4 1k/1k",
        _inferencex(184.0, 959.0, 72, tp=8, ep=72),
        184.0, 959.0, "total", "fit",
        "72 GPUs, TP8 attention groups (9 DP ranks), EP72, FP8 KV, no MTP, prefill sharing the GPUs"),
    _gb300_vllm(1, "fit"),
    PublishedPoint(
        "b200-v41-dspark-sglang-c1", f"{INFERENCEX_PR}3335 (InferenceX AgentX, SGLang dev-dsv41, 4xB200 "
        "TP4/EP4, baseline 2026-09-18: concurrency 1, mean TPOT 2.1 ms, golden acceptance length 3.51)",
        _v41_dspark("b200", 4, 1), 1000.0 / 2.1, None, "none", "held_out",
        "per-agent decode speed = 1000 / TPOT; five-token DSpark, EP4; another GPU and another stack", "step"),
    *(_gb300_vllm(c, "held_out") for c in (2, 4, 8, 16)),
)


# --------------------------------------------------------------------------- disaggregated prefill on Hopper
LMSYS_EP = "https://lmsys.org/blog/2025-05-05-large-scale-ep/"
DEEPSEEK_DAY6 = ("https://github.com/deepseek-ai/open-infra-index/blob/main/202502OpenSourceWeek/"
                 "day_6_one_more_thing_deepseekV3R1_inference_system_overview.md")
RTP_LLM = "https://github.com/alibaba/rtp-llm/blob/main/docs/RTP-LLM-DeepSeek-Replay-Tech-Report.md"

# DeepSeek's day-6 statistics: 608B input tokens (56.3% cache hits), 168B output tokens, mean KV length per
# output token 4,989. With P + D/2 = 4,989 and P/D = 608/168 the mean prompt is P = 4,989 / (1 + 168/1216).
DEEPSEEK_HIT_RATE = 0.563
DEEPSEEK_PROMPT = round(4989 / (1 + 168 / (2 * 608)))


@dataclass(frozen=True)
class PublishedPrefill:
    """A published prefill throughput per GPU (prompt tokens computed, cache hits excluded) and the
    deployment of the prefill instance assumed for it."""

    name: str
    source: str
    inputs: PlanInputs
    uncached_tokens_per_s_per_gpu: float
    role: str  # fit or held_out
    assumptions: str


def _prefill(hardware: str, prompt_len: int, hit_rate: float = 0.0) -> PlanInputs:
    """An EP32 prefill instance (4 nodes, attention DP32, FP8 weights, bf16 MLA cache) as all three used."""
    return _r1(hardware=hardware, gpus=32, ep=32, weight_dtype="fp8", kv_dtype="bf16", prompt_len=prompt_len,
               output_len=100, prefix_hit_rate=hit_rate)


PUBLISHED_PREFILL: tuple[PublishedPrefill, ...] = (
    PublishedPrefill(
        "h800-rtp-llm-prefill-4k", f"{RTP_LLM} (Prefill: one GPU runs two 4K requests in 1.5 s, 5,333 tokens/s)",
        _prefill("h800", 4096), 5333.0, "fit",
        "RTP-LLM on H800 RoCE, prefill instance of 4 nodes with EP32, 4K-token prompts, no cache hits"),
    PublishedPrefill(
        "h100-lmsys-prefill-2k", f"{LMSYS_EP} (52.3k input tokens/s per node for 2,000-token inputs)",
        _prefill("h100", 2000), 52300.0 / 8, "held_out",
        "SGLang on 8xH100 nodes, prefill on 4 nodes with EP32 and attention DP32, DeepEP normal kernels, "
        "two-batch overlap; random 2,000-token prompts, no cache hits"),
    PublishedPrefill(
        "h800-deepseek-prefill-production", f"{DEEPSEEK_DAY6} (~73.7k input tokens/s per node including cache "
        "hits, 56.3% of input tokens hit the on-disk cache)",
        _prefill("h800", DEEPSEEK_PROMPT, DEEPSEEK_HIT_RATE), 73700.0 * (1 - DEEPSEEK_HIT_RATE) / 8, "held_out",
        f"prefill units of 4 nodes with EP32 / DP32; mean prompt {DEEPSEEK_PROMPT} tokens derived from the day's "
        "token counts; a daily average of a production service, so prefill nodes are not always saturated"),
)


# --------------------------------------------------------------------------- speculation: with against without
SGLANG_DSPARK_PR = "https://github.com/sgl-project/sglang/pull/29538"
SGLANG_DSPARK_AL = ("https://github.com/sgl-project/sglang/issues/29488 (the PR's author: accept length "
                    "around 3.2 to 3.6 on 8xB200, greedy)")
DSPARK_AL = 3.4  # midpoint of the 3.2-3.6 the PR's author states for its greedy benchmarks


@dataclass(frozen=True)
class PublishedSpeedup:
    """A published speed-up of speculative decoding over the same server without it (same session, same
    workload, same concurrency), and the deployment the planner assumes for it."""

    name: str
    source: str
    inputs: PlanInputs
    speedup: float  # speed with the drafter / speed without, per agent (TPOT ratio)
    role: str  # fit, held_out, or not_reproduced (documented miss: a limit, not a check)
    assumptions: str


def _dspark_pair(concurrency: int, prompt_len: int, output_len: int) -> PlanInputs:
    """SGLang's DSpark pair ran DeepSeek-V4-Flash-DSpark on 8xB200 (TP8, EP8, FP4 experts). The planner has no
    V4-Flash DSpark drafter, so V4.1-Flash stands in on the same layout: its DSpark is the same design (three
    window-only stages drafting a 5-token block in one pass); what is transferred is the ratio of the
    speculative step to the plain step, not the absolute speed."""
    return PlanInputs(model="deepseek-v41-flash", hardware="b200", gpus=8, tp=8, ep=8, weight_dtype="fp4",
                      concurrency=concurrency, prompt_len=prompt_len, output_len=output_len,
                      accept_length=DSPARK_AL, draft_tokens=5, stack=V41_STACK)


def _pair(name: str, row: str, concurrency: int, prompt: int, output: int, speedup: float, role: str,
          note: str = "") -> PublishedSpeedup:
    return PublishedSpeedup(
        name, f"{SGLANG_DSPARK_PR} (DeepSeek-V4-Flash-DSpark on 8xB200, TP8/EP8, DSpark over no spec in the same "
        f"session: {row}); acceptance length {SGLANG_DSPARK_AL}",
        _dspark_pair(concurrency, prompt, output), speedup, role,
        f"V4.1-Flash on the same layout stands in for V4-Flash; acceptance length {DSPARK_AL} (midpoint of the "
        f"stated 3.2-3.6); context = prompt + output/2{note}")


PUBLISHED_SPEEDUP: tuple[PublishedSpeedup, ...] = (
    _pair("b200-dspark-speedup-random-c1", "random 256/512, concurrency 1, 2.08x", 1, 256, 512, 2.08, "fit"),
    _pair("b200-dspark-speedup-single-1k", "single stream 1024/1024, 2.31x", 1, 1024, 1024, 2.31, "held_out"),
    _pair("b200-dspark-speedup-single-512", "single stream 512/256, 1.97x", 1, 512, 256, 1.97, "held_out"),
    _pair("b200-dspark-speedup-sharegpt-c1", "ShareGPT, concurrency 1, 1.84x", 1, 512, 512, 1.84, "held_out",
          "; ShareGPT lengths not stated, 512/512 assumed"),
    _pair("b200-dspark-speedup-random-c32", "random 256/512, concurrency 32, 1.28x", 32, 256, 512, 1.28,
          "not_reproduced"),
    _pair("b200-dspark-speedup-sharegpt-c32", "ShareGPT, concurrency 32, 1.35x", 32, 512, 512, 1.35,
          "not_reproduced", "; ShareGPT lengths not stated, 512/512 assumed"),
)


# --------------------------------------------------------------------------- where drafting stops paying
VLLM_ADAPTIVE_BLOG = ("https://github.com/vllm-project/vllm-project.github.io/blob/main/_posts/"
                      "2026-08-14-dspark-adaptive-verification.md")
VLLM_ADAPTIVE_FIG = ("https://github.com/vllm-project/vllm-project.github.io/blob/main/assets/figures/"
                     "2026-08-14-dspark-adaptive-verification/fig3-pareto.svg")


@dataclass(frozen=True)
class PublishedSwitchOff:
    """A published sweep of one stack with and without DSpark: the last concurrency at which drafting still
    paid (``pays_at``) and the first at which it no longer did (``loses_at``); the planner's crossover for the
    deployment assumed should lie in between."""

    name: str
    source: str
    inputs: PlanInputs  # the deployment assumed, at concurrency 1 (the crossover is searched)
    pays_at: int
    loses_at: int
    role: str  # held_out, or not_reproduced (documented miss)
    assumptions: str


PUBLISHED_SWITCH_OFF: tuple[PublishedSwitchOff, ...] = (
    PublishedSwitchOff(
        "b300-v4pro-dspark-fixed5-switch-off",
        f"{VLLM_ADAPTIVE_BLOG} (DeepSeek-V4-Pro-0813 on 8xB300, TP8 + expert parallel, FP8 KV, fixed 5-token "
        "DSpark against no speculation, 512 output tokens, acceptance length flat near 3.4: at concurrency 256 "
        f"fixed k=5 is 26% below no speculation; per-concurrency values read from {VLLM_ADAPTIVE_FIG}: speed-up "
        "per user 1.78x at 16, 1.93x at 32, 1.77x at 64, 1.32x at 128, 0.66x at 256)",
        PlanInputs(model="deepseek-v41-flash", hardware="gb300-nvl72", gpus=8, tp=8, ep=8, weight_dtype="fp4",
                   kv_dtype="fp8", prompt_len=2048, output_len=512, accept_length=3.4, draft_tokens=5,
                   stack=V41_STACK),
        128, 256, "not_reproduced",
        "V4.1-Flash on the same layout stands in for V4-Pro (the planner has no V4-Pro DSpark drafter); B300 is "
        "the GB300 GPU; 2,048-token prompts assumed (speed-bench prompts, max_model_len 8,192); at 256 the "
        "1,536 verified tokens exceed the run's CUDA-graph capture size (1,024), so the upper end is partly "
        "software"),
)


# --------------------------------------------------------------------------- local machines (reference figures §7)
RF7 = "docs/reference-figures.md §7"
LOCAL_MACHINES = Path(__file__).with_name("local_machines")
FREETOKEN_444 = "https://github.com/FlashML-org/FreeToken/issues/444"
FREETOKEN_RESIDENT = 30  # experts per layer kept on the GPU: the issue does not state its hybrid split
OFFLOAD_3090 = "https://github.com/0xSero/dsv41-flash-offload"
OFFLOAD_RESIDENT = 10  # the VRAM expert cache: about 395 of 15,360 experts (D130), about 10 per layer
OFFLOAD_HIT = 2.5 / 6  # "only about 3.5 experts per layer miss the VRAM cache" of the 6 a token selects
DS4_1073 = "https://github.com/antirez/ds4/pull/1073"
DS4_1036 = "https://github.com/antirez/ds4/pull/1036"
# ds4's V4.1 "Q2" file (download target ds41f-q2): IQ2_XXS gate/up, Q2_K down (142.4 GiB of routed experts),
# Q8_0 attention, shared experts and head, engram rows raw FP8 on disk
DS4_Q2 = "iq2_xxs-q2_k"
DS4_Q2_BASIS = ("stated: ds4's published V4.1 Q2 file: IQ2_XXS routed gate/up, Q2_K routed down (2.25 bits per "
                "weight, 142.4 GiB of experts), Q8_0 dense parts (planned as FP8: 6% fewer dense bytes)")
# Strix Halo's dynamic expert cache: 88.88 GB of the 152.9 GB of routed experts at 2.25 bits, per layer of 384
STRIX_RESIDENT = int(88.88e9 / (543_581_798_400 * 2.25 / 8 / 384))  # 223


@dataclass(frozen=True)
class PublishedLocal:
    """A published decode speed of V4/V4.1-Flash on one local machine and the deployment the planner assumes
    for it. ``decode`` is tokens/s summed over the ``concurrency`` streams (decode timed apart from TTFT, as the
    reports time it). ``inputs`` is None when the planner cannot express the point; ``reason`` says why.
    ``role``: ``fit`` (sets a local profile's term), ``held_out`` (no term fitted to its decode speed; the
    machine's measured component rates its report gives, such as a CPU kernel's read rate, are machine facts),
    or ``not_predicted``. ``weight_dtype`` is the planner's expert width for the report's quantization
    (``dtypes.WEIGHT_BYTES``; None where the report states none) and ``weight_dtype_basis`` says whether the
    report states it or it is an assumption, and why."""

    name: str
    source: str
    setup: str
    decode: float
    concurrency: int
    role: str
    inputs: PlanInputs | None
    assumptions: str
    weight_dtype: str | None = None
    weight_dtype_basis: str = ""


def _local_machine(name: str) -> str:
    return str(LOCAL_MACHINES / f"{name}.json")


def _freetoken(concurrency: int, decode: float, row: str) -> PublishedLocal:
    return PublishedLocal(
        f"freetoken-5090-rome-v4flash-c{concurrency}",
        f"{RF7}: {FREETOKEN_444} (FreeToken hybrid backend, measured: {row})",
        "V4-Flash, RTX 5090 + EPYC Rome (8-ch DDR4-3200, 251 GiB), hybrid CPU/GPU experts", decode, concurrency,
        "held_out",
        PlanInputs(model="deepseek-v4-flash", hardware=_local_machine("rtx5090-epyc-rome-8ch-ddr4"), gpus=1,
                   weight_dtype="fp4", concurrency=concurrency, resident_experts=FREETOKEN_RESIDENT),
        f"released MXFP4 experts and FP8 dense weights; {FREETOKEN_RESIDENT} of 256 experts per layer on the GPU, "
        "the rest computed by the CPU expert kernel at its measured 110.3 GB/s (`ft bench bw`, same issue; the "
        "split is not published: 30 is within the 40 a layer the planner fits on the card beside the other weights "
        "and 8 sequences; between 0 and 36 resident the prediction moves -8% to +2% at one stream and -10% to +2% "
        "at eight); routing at V4-Flash's measured skew; "
        "prompt 1,024 and output 1,024 tokens assumed (not published)",
        "fp4", "stated: the released MXFP4 experts")


def _offload_3090(concurrency: int, decode: float) -> PublishedLocal:
    return PublishedLocal(
        f"vllm-3090-7443p-v41-c{concurrency}",
        f"{RF7}: {OFFLOAD_3090} (README, default run D141: 19.3 / 24.0 / 26.6 tok/s at 1 / 2 / 4 streams)",
        "V4.1, 1x RTX 3090 + EPYC 7443P (8-ch DDR4, 503 GiB) + NVMe, 3.0 bpw", decode, concurrency, "held_out",
        PlanInputs(model="deepseek-v41-flash", hardware=_local_machine("rtx3090-epyc-7443p-8ch-ddr4"), gpus=1,
                   weight_dtype="3.0bpw", concurrency=concurrency, resident_experts=OFFLOAD_RESIDENT,
                   expert_hit_rate=OFFLOAD_HIT),
        f"every routed expert in host memory (190.5 GiB, pinned), a VRAM cache of about {OFFLOAD_RESIDENT} per "
        f"layer (about 395 slots, D130) hit at {OFFLOAD_HIT:.3f} (\"only about 3.5 experts per layer miss\"); the "
        "CPU computes the misses at the rate its README states (3.5 experts of 13.3 MB in about 1 ms a layer: "
        "46.6 GB/s); engram rows from the page cache; prompt 1,024 and output 1,024 tokens assumed (the README "
        "gives no decode context for these figures)",
        "3.0bpw", "stated: EXL3 3.0 bits per weight")


def _not_predicted(name: str, setup: str, decode: float, concurrency: int, source: str, reason: str,
                   weight_dtype: str | None = None, basis: str = "") -> PublishedLocal:
    return PublishedLocal(name, f"{RF7}: {source}", setup, decode, concurrency, "not_predicted", None, reason,
                          weight_dtype, basis)


PUBLISHED_LOCAL: tuple[PublishedLocal, ...] = (
    _freetoken(1, 25.7, "24.5-26.9 tok/s single stream; midpoint 25.7"),
    _freetoken(8, 65.6, "65.6 tok/s aggregate at 8 concurrent"),
    _offload_3090(1, 19.3),
    _offload_3090(2, 24.0),
    _offload_3090(4, 26.6),
    PublishedLocal(
        "ds4-m3-ultra-v41-q2", f"{RF7}: {DS4_1073} (plain decode 37.12, 37.10, 37.08 tok/s, 200 tokens)",
        "V4.1, M3 Ultra 256 GB, Q2 (ds4, resident, engram on disk)", 37.1, 1, "fit",
        PlanInputs(model="deepseek-v41-flash", hardware=_local_machine("apple-m3-ultra-256gb"), gpus=1,
                   weight_dtype=DS4_Q2, concurrency=1, engram_tables="disk", memory_bound_only=True),
        "every weight resident in the unified memory, the engram tables on the internal SSD (ds4 keeps them "
        "disk-only; the rows' reads are not timed: Apple states no SSD bandwidth or IOPS); Apple publishes no GPU "
        "FLOP/s, so the step is timed by memory alone and the profile's eta_mem, fitted here, carries ds4's "
        "kernels; prompt 1,024 and output 1,024 tokens assumed (a short prompt in the report)",
        DS4_Q2, DS4_Q2_BASIS),
    PublishedLocal(
        "ds4-strix-halo-v41-q2-ssd", f"{RF7}: {DS4_1036} (decode ~9-10 tok/s; midpoint 9.5)",
        "V4.1, Strix Halo 128 GB, Q2, SSD streaming (ds4, RAID-0 of 3 NVMe, 13.5 GB/s)", 9.5, 1, "held_out",
        PlanInputs(model="deepseek-v41-flash", hardware=_local_machine("strix-halo-128gb-raid0"), gpus=1,
                   weight_dtype=DS4_Q2, concurrency=1, engram_tables="disk", memory_bound_only=True,
                   resident_experts=STRIX_RESIDENT, expert_cache="lru"),
        f"the dynamic expert cache of 88.88 GB holds {STRIX_RESIDENT} of 384 experts per layer, planned as an LRU "
        "cache of the selected experts (the report gives no hit rate; V4-Flash's measured routing skew carried "
        "over to V4.1); misses read from the RAID at its stated 13.5 GB/s; the tiers "
        "summed (whether ds4 overlaps its SSD reads with compute is not stated: overlapped, the prediction is "
        "+36%); engram tables disk-only; memory-bound (AMD publishes no FLOP/s for the Radeon 8060S) at the "
        "local-unified profile fitted on the M3 Ultra point (same engine and file)",
        DS4_Q2, DS4_Q2_BASIS),
    _not_predicted("llamacpp-5975wx-2gpu-v41", "V4.1, Threadripper 5975WX + 2 GPUs, experts on CPU", 17.7, 1,
                   "ggml-org/llama.cpp PR 28696 (measured on vcruz305/llama.cpp's runtime/deepseek41 branch)",
                   "the two GPUs, the memory channels and speed, and the quantization are not stated (a 32-core, "
                   "251 GB box; 17.7 without and 22.8 with DSpark block 3)"),
    _not_predicted("llamacpp-dgx-spark-v41-q2k", "V4.1, one DGX Spark, Q2_K over mmap", 2.8, 1,
                   "ggml-org/llama.cpp PR 28696",
                   "-cmoe with -lm mmap: the 246.3 GiB Q2_K file (engram tables included) pages from the NVMe "
                   "drive into 121.7 GiB of usable memory, so each token's speed is set by which pages the page "
                   "cache keeps and by the drive's random reads (3.5k IOPS at queue depth 1 measured on the same "
                   "box class, 0xSero/local-ai-registry); the planner models neither the page cache nor faulted "
                   "reads, and NVIDIA lists no read bandwidth for the drive nor FP8/BF16 FLOP/s for the GB10",
                   "q2_k", "stated: Q2_K"),
    _not_predicted("sglang-4x-dgx-spark-v41-tp4", "V4.1, 4x DGX Spark, TP4, DSpark, engram on NVMe", 39.4, 1,
                   "0xSero/local-ai-registry PR 55",
                   "four machines in TP4 over RoCE: the planner's machines are one box (no link between machines)"),
    _not_predicted("ktransformers-5090-2x6138-v4flash", "V4-Flash, RTX 5090 + 2x Xeon Gold 6138, ktransformers", 28.0,
                   1, "kvcache-ai/ktransformers PR 2088",
                   "the run routes each token to 4 experts instead of the model's 6 (the planner has no "
                   "routing override), and the memory channels populated for its 256 GB of DDR4-2400 are not "
                   "stated (local_machines/rtx5090-2x-xeon-gold-6138.json describes the sockets)"),
    _not_predicted("ik-llamacpp-epyc-9v45-v4flash", "V4-Flash, EPYC 9V45 (32 cores, ~186 GB/s triad), CPU only", 9.7,
                   1, "ikawrakow/ik_llama.cpp issue 1752",
                   "measured with mainline llama.cpp, which its author profiled as compute-bound (the memory bus "
                   "about 60% idle); the CPU's expert-kernel FLOP/s are not stated, and a memory-bound plan "
                   "(--memory-bound-only) is only an upper bound on that speed; the UD-Q4 mix (145 GB) has no "
                   "width of its own in the planner"),
    _not_predicted("llamacpp-pro6000-half-cpu-v4flash",
                   "V4-Flash, RTX PRO 6000 + 768 GB RAM, about half the expert layers on CPU", 42.4, 1,
                   "ggml-org/llama.cpp PR 25784",
                   "the host CPU and its memory channels and speed are not stated (NUMA NPS=4 suggests an EPYC): no "
                   "host bandwidth for the 19 of 43 layers whose experts run on the CPU"),
    _not_predicted("sglang-4x-h200-v4flash-dspark", "V4-Flash, 4x H200, DSpark, C1", 1000.0 / 1.72, 1,
                   "sgl-project/sglang PR 33109",
                   "the planner has no V4-Flash DSpark drafter (V4.1's stands in only for speed-up ratios)"),
)
