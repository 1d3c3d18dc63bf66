"""Speculative decoding benchmark: per-agent decode speed with each drafter against no speculation, same run.

``python -m flashserve.bench.spec`` runs the embedded model (or ``--model``) on held-out code prompts (functions
of standard-library files the model never trained on), greedy (or sampled at ``--temperature``, seeded per
prompt), at each batch size; for every configuration it
reports per-agent decode tokens/s (output tokens after the first / decode seconds, per sequence; ``--num-prompts``
prompts decoded batch-size at a time, so batch 1 is not one prompt's luck), the ratio to
no speculation at the same batch size measured in the same run, and the mean acceptance length. The medians of
``--repeats`` runs are reported; configurations alternate within each repeat, so drift on a shared machine hits
all of them alike. ``--out FILE`` writes the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

METHODS = ("none", "ngram", "mtp", "dspark")


def heldout_prompts(n: int, chars: int = 600) -> list[str]:
    """``n`` code prompts from held-out standard-library files: the text before and including a ``def`` line
    (up to ``chars`` characters), one per file, in path order."""
    from ..train.data import is_heldout, stdlib_files
    from ..train.settings import Recipe

    frac = Recipe().heldout_fraction
    out = []
    for rel, text in stdlib_files():
        if not is_heldout(rel, frac):
            continue
        lines = text.splitlines(keepends=True)
        pos = 0
        for line in lines:
            pos += len(line)
            if pos > chars // 2 and line.lstrip().startswith("def "):
                out.append(text[max(0, pos - chars):pos])
                break
        if len(out) == n:
            break
    return out


def run_once(engine, prompts: list[str], batch: int, max_tokens: int, temperature: float = 0.0) -> dict:
    """Decode ``prompts`` ``batch`` at a time; per-agent decode tokens/s (tokens after the first, over the time
    from every prompt of a group having its first token to the group's end) pooled over the groups."""
    from ..engine import SamplingParams

    before = dict(engine.spec_stats.as_dict()) if engine.spec is not None else None
    seconds = 0.0
    for g in range(0, len(prompts), batch):
        for i, p in enumerate(prompts[g:g + batch]):
            sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=g + i, ignore_eos=True)
            engine.add_request(f"b{g + i}", p, sp)
        while any(not s.prefill_done for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        seconds += time.perf_counter() - t0
    groups = -(-len(prompts) // batch)
    res = {"tok_s_per_agent": groups * (max_tokens - 1) / seconds}
    if before is not None:
        after = engine.spec_stats.as_dict()
        drafts = after["num_drafts"] - before["num_drafts"]
        acc = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        res["mean_acceptance_length"] = 1 + acc / drafts if drafts else 1.0
    return res


def make_engine(model: str | None, method: str, k: int, batch: int, threads: int, confidence: float = 0.0,
                enforce_eager: bool | None = None, draft_sample_method: str = "probabilistic"):
    from ..engine import EngineConfig, LLMEngine
    from ..models import resolve_model

    spec = None if method == "none" else {"method": method, "num_speculative_tokens": k,
                                          "disable_by_batch_size": None}
    if method == "dspark":
        spec.update(confidence_threshold=confidence, draft_sample_method=draft_sample_method)
    engine = LLMEngine(EngineConfig(model=resolve_model(model), max_num_seqs=max(batch, 1), threads=threads,
                                    kv_memory="256MiB", speculative_config=spec, enforce_eager=enforce_eager,
                                    max_num_batched_tokens=max(2048, batch * (k + 1))))
    engine.wait_compiled()  # measured compiled where it compiles, not while it compiles in the background
    return engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashserve.bench.spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset or checkpoint folder (default: the embedded model)")
    p.add_argument("--methods", default="none,ngram,dspark", help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--confidence-threshold", type=float, default=0.0,
                   help="dspark: end a block at the first draft its confidence head rates lower (default 0: off)")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--num-prompts", type=int, default=8,
                   help="prompts per measurement, decoded batch-size at a time (at least the batch size; default 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sampled, seeded")
    p.add_argument("--draft-sample-methods", default="probabilistic",
                   help="dspark's draft_sample_method, comma-separated: one dspark row per value")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="decode eagerly (default: the engine's, compiled; measured once the compile is done)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or "none" not in methods:
        p.error(f"--methods: need 'none' (the baseline) and only {', '.join(METHODS)}; got {a.methods!r}")
    draws = [d.strip() for d in a.draft_sample_methods.split(",") if d.strip()]
    if not draws or set(draws) - {"probabilistic", "greedy"}:
        p.error(f"--draft-sample-methods: probabilistic and/or greedy; got {a.draft_sample_methods!r}")
    if a.temperature < 0:
        p.error("--temperature must be at least 0")
    # each configuration: its label, method and dspark's draft_sample_method
    configs = [(m if m != "dspark" or len(draws) == 1 else f"dspark[{d}]", m, d)
               for m in methods for d in (draws if m == "dspark" else draws[:1])]
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    if a.num_prompts < 1 or a.max_tokens < 2 or min(sizes) < 1:
        p.error("--num-prompts and the batch sizes must be at least 1, --max-tokens at least 2")
    most = max(max(sizes), a.num_prompts)
    prompts_all = heldout_prompts(most)
    if len(prompts_all) < most:
        prompts_all = (prompts_all * most)[:most]
    results = []
    for B in sizes:
        prompts = prompts_all[:max(B, a.num_prompts) // B * B]  # whole groups of B
        engines = {label: make_engine(a.model, m, a.num_speculative_tokens, B, a.threads, a.confidence_threshold,
                                      a.enforce_eager, d)
                   for label, m, d in configs}
        for eng in engines.values():  # warm-up: first-call allocations out of the timing
            run_once(eng, prompts[:B], B, 4, a.temperature)
        runs: dict[str, list[dict]] = {label: [] for label in engines}
        for _ in range(a.repeats):
            for label, eng in engines.items():
                runs[label].append(run_once(eng, prompts, B, a.max_tokens, a.temperature))
        base = statistics.median(r["tok_s_per_agent"] for r in runs["none"])
        for m in engines:
            speed = statistics.median(r["tok_s_per_agent"] for r in runs[m])
            row = {"batch": B, "method": m, "tok_s_per_agent": round(speed, 2), "vs_none": round(speed / base, 3)}
            if m != "none":
                row["mean_acceptance_length"] = round(statistics.median(r["mean_acceptance_length"] for r in runs[m]), 3)
            results.append(row)
            print(json.dumps(row), flush=True)
    loses = {m: min((r["batch"] for r in results if r["method"] == m and r["vs_none"] < 1.0), default=None)
             for m in (label for label, _, _ in configs) if m != "none"}
    summary = {"k": a.num_speculative_tokens, "confidence_threshold": a.confidence_threshold,
               "temperature": a.temperature, "draft_sample_methods": draws,
               "max_tokens": a.max_tokens, "num_prompts": a.num_prompts, "repeats": a.repeats,
               "threads": a.threads, "results": results,
               "first_batch_size_where_speculation_loses": loses}
    if a.out:
        a.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
