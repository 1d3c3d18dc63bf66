"""Engine benchmark against transformers' ``generate`` on the same tiny V4 checkpoint.

    python -m flashserve.bench.engine [--quick] [--threads N]

Measures (a) decode tokens/s per agent at batch 1, (b) aggregate output tokens/s with 16 and 64 concurrent
requests, (c) prefill tokens/s on a 4K-token prompt: V4 (exact) against transformers, and V4.1 encoder-only
against exact prefill. Prints a table and the ratios. Not a test.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from .hf_reference import randomize_hf_v4

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


# The checkpoint shapes compared. "peers" is the tiny V4 that ../shared/notes/peers.md measured transformers and
# llama.cpp on (91M parameters, 53M active: vocab 32000, hidden 512, 8 layers, 16 experts top-4); "tiny" is
# shaped like the ``tiny-v4`` preset (1.4M parameters), where both engines measure mostly per-op overhead.
SHAPES = {
    "peers": dict(vocab_size=32000, hidden_size=512, moe_intermediate_size=256, num_attention_heads=8, head_dim=64,
                  q_lora_rank=128, n_routed_experts=16, num_experts_per_tok=4, sliding_window=32, o_lora_rank=128,
                  index_head_dim=64, index_topk=16),
    "tiny": dict(vocab_size=512, hidden_size=64, moe_intermediate_size=64, num_attention_heads=4, head_dim=64,
                 q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, sliding_window=16, o_lora_rank=32,
                 index_head_dim=32, index_topk=8),
}


def build_hf_v4(path: Path, shape: str = "peers", seed: int = 0):
    """A random ``DeepseekV4ForCausalLM`` of one of :data:`SHAPES`, saved with save_pretrained."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    dims = SHAPES[shape]
    layer_types = [SWA, SWA, CSA, HCA, CSA, HCA, CSA, SWA]
    cfg = DeepseekV4Config(
        **dims, num_hidden_layers=len(layer_types), partial_rotary_factor=16 / 64, n_shared_experts=1,
        layer_types=layer_types,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        mlp_layer_types=["hash_moe"] * 2 + ["moe"] * (len(layer_types) - 2),
        o_groups=2, index_n_heads=8, max_position_embeddings=8192, num_nextn_predict_layers=0,
        pad_token_id=2, eos_token_id=1, bos_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = randomize_hf_v4(DeepseekV4ForCausalLM(cfg).eval(), seed)
    model.save_pretrained(path)
    return model


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, 500, (n, length), generator=g).tolist()  # ids valid in every shape's vocabulary


# --------------------------------------------------------------------------- transformers
@torch.inference_mode()
def hf_generate_time(model, batch: list[list[int]], new: int) -> float:
    ids = torch.tensor(batch)
    t = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                   do_sample=False, pad_token_id=2)
    return time.perf_counter() - t


def hf_decode_rate(model, prompt_len: int, new: int) -> float:
    p = prompts(1, prompt_len, 1)
    hf_generate_time(model, p, 2)  # warm-up
    t_new = hf_generate_time(model, p, new)
    t_one = hf_generate_time(model, p, 1)
    return (new - 1) / max(t_new - t_one, 1e-9)


@torch.inference_mode()
def hf_prefill_rate(model, length: int, repeats: int = 2) -> float:
    model(torch.tensor(prompts(1, 64, 3)), logits_to_keep=1)
    best = 0.0
    for r in range(repeats):
        ids = torch.tensor(prompts(1, length, 4 + r))
        t = time.perf_counter()
        model(ids, logits_to_keep=1)
        best = max(best, length / (time.perf_counter() - t))
    return best


# --------------------------------------------------------------------------- flashserve
def engine_for(model, path: str, **kw):
    from ..engine import EngineConfig, LLMEngine

    kw.setdefault("kv_memory", "512MiB")
    return LLMEngine(EngineConfig(model=path, dtype="float32", **kw), model=model)


def fs_run(engine, batch: list[list[int]], new: int) -> tuple[float, float]:
    """(total wall time, decode-only time after every request's first token)."""
    from ..engine import SamplingParams

    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"b{i}-{t0}", p, sp)
    firsts = 0
    t_first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        for o in outs:
            if len(o.outputs[0].token_ids) == 1:
                firsts += 1
        if t_first is None and firsts == len(batch):
            t_first = time.perf_counter()
    t1 = time.perf_counter()
    return t1 - t0, t1 - (t_first or t0)


def fs_decode_rate(engine, prompt_len: int, new: int) -> float:
    p = prompts(1, prompt_len, 1)
    fs_run(engine, p, 4)
    _, dec = fs_run(engine, p, new)
    return (new - 1) / dec


def fs_prefill_rate(engine, length: int, repeats: int = 2) -> float:
    """Prompt tokens/s to the first token (best of ``repeats``, after a warm-up; prefix caching off)."""
    from ..engine import SamplingParams

    engine.scheduler.prefix = False
    best = 0.0
    for r in range(repeats + 1):
        p = prompts(1, length if r else 64, 3 + r)[0]
        t = time.perf_counter()
        engine.add_request(f"pf{t}", p, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        if r:
            best = max(best, length / (time.perf_counter() - t))
    return best


@torch.inference_mode()
def model_floor_rate(model, prompt_len: int, new: int) -> float:
    """Decode tokens/s of the bare model through its reference DenseState (no engine): the floor we sit on."""
    state = model.new_state(1)
    model(torch.tensor(prompts(1, prompt_len, 1)), state, logits_rows=1)
    tok = torch.tensor([[17]])
    t = time.perf_counter()
    for _ in range(new):
        model(tok, state, logits_rows=1)
    return new / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer tokens (smoke run)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="peers", help="the V4 checkpoint compared")
    ap.add_argument("--sweep-json", default=None, metavar="PATH",
                    help="also write the measured points as a bench sweep (PATH) and the checkpoint's config "
                         "(PATH.config.json), the input of `flashserve plan --calibrate`")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from ..model.loader import load_model

    new1, newb = (16, 8) if args.quick else (64, 32)
    plen = 128
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_hf_v4(Path(tmp), args.shape)
        print(f"checkpoint shape {args.shape!r}: {sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M parameters")
        ours = load_model(tmp, dtype=torch.float32, fake_quant=False, with_mtp=False)
        ids = torch.tensor(prompts(1, 40, 5))
        with torch.no_grad():
            rel = float((ours(ids).logits - hf(ids).logits).abs().max() / hf(ids).logits.abs().max())
        print(f"same checkpoint: flashserve vs transformers logits max rel diff {rel:.2e}")

        def table(name, ours_v, theirs_v, unit="tok/s"):
            ratio = ours_v / theirs_v if theirs_v else float("nan")
            rows.append((name, ours_v, theirs_v, ratio))
            print(f"{name:<34} flashserve {ours_v:10.1f} {unit}   transformers {theirs_v:10.1f} {unit}   "
                  f"ratio {ratio:6.2f}x", flush=True)

        eng = engine_for(ours, tmp, max_num_seqs=64)
        batch1 = fs_decode_rate(eng, plen, new1)
        table("decode per agent, batch 1", batch1, hf_decode_rate(hf, plen, new1))
        sweep = [{"concurrency": 1, "tokens_per_s_per_agent": batch1, "output_tokens_per_s_per_gpu": batch1}]
        floor = model_floor_rate(ours, plen, new1)
        print(f"{'  (bare model + DenseState, batch 1)':<34} {floor:10.1f} tok/s: the engine runs at "
              f"{rows[-1][1] / floor:.0%} of the model's own eager speed", flush=True)
        for b in (16, 64):
            batch = prompts(b, plen, 10 + b)
            fs_run(eng, batch[:2], 2)
            t_ours, _ = fs_run(eng, batch, newb)
            t_hf = hf_generate_time(hf, batch, newb)
            table(f"aggregate output, {b} concurrent", b * newb / t_ours, b * newb / t_hf)
            sweep.append({"concurrency": b, "tokens_per_s_per_agent": newb / t_ours,
                          "output_tokens_per_s_per_gpu": b * newb / t_ours})
        if args.sweep_json:
            import json
            import shutil

            out = Path(args.sweep_json)
            out.write_text(json.dumps({"hardware": "cpu-local", "context": plen + newb, "points": sweep}, indent=1))
            shutil.copy(Path(tmp) / "config.json", f"{out}.config.json")
            print(f"wrote {out} and {out}.config.json")
        L = args.prefill_len
        eng = engine_for(ours, tmp, max_num_seqs=4, max_model_len=8192)
        table(f"prefill {L} tokens (V4, exact)", fs_prefill_rate(eng, L), hf_prefill_rate(hf, L))
    v41 = load_model("tiny-v41", dtype=torch.float32, with_mtp=False)
    L = min(args.prefill_len, v41.cfg.max_position_embeddings - 8)
    enc = fs_prefill_rate(engine_for(v41, "tiny-v41", max_num_seqs=4), L)
    exact = fs_prefill_rate(engine_for(v41, "tiny-v41", max_num_seqs=4, exact_prefill=True), L)
    ratio = enc / exact
    print(f"{'prefill ' + str(L) + ' tokens (V4.1)':<34} encoder-only {enc:10.1f} tok/s   exact {exact:10.1f} tok/s   "
          f"ratio {ratio:6.2f}x", flush=True)
    print("bars: decode batch 1 >= 5x, aggregate at 64 >= 20x, V4.1 encoder-only prefill >= 1.6x exact")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
