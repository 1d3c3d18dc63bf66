"""Scheduler and engine edge cases: encoder-only preemption, equal-length chunks ending at different
positions, a sequence that outgrows the whole cache, budget/batch consistency, withdrawn batches."""

from __future__ import annotations

import pytest

from engine_helpers import make_engine, prompt_of, run_greedy
from flashserve import LLM
from flashserve.engine import RequestError, SamplingParams

V41 = "tiny-v41"


def test_encoder_only_preemption_gives_the_same_tokens(models):
    """Recomputing after preemption must replay the prompt encoder-only and the generated tokens exactly."""
    model = models(V41)
    prompts = [prompt_of(20 + 7 * i, seed=20 + i) for i in range(4)]
    ample = run_greedy(make_engine(model, V41), prompts, 40)
    engine = make_engine(model, V41, block_size=16, num_pages=10, cache_dtype="float")
    tight = run_greedy(engine, prompts, 40)
    assert engine.stats()["num_preemptions"] > 0
    assert tight == ample
    assert engine.stats()["kv_pages_used"] == 0


def test_equal_chunks_ending_at_different_positions_share_a_step(models):
    model = models(V41)
    a, b = prompt_of(40, seed=1), prompt_of(20, seed=2)
    alone = run_greedy(make_engine(model, V41, prefill_chunk=20), [a], 6) + \
        run_greedy(make_engine(model, V41, prefill_chunk=20), [b], 6)
    engine = make_engine(model, V41, prefill_chunk=20)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("a", a, sp)
    engine.step()  # a's first 20-token chunk
    engine.add_request("b", b, sp)  # b's only chunk and a's last chunk: both 20 tokens, different ends
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done["a"], done["b"]] == alone


def test_sequence_outgrowing_the_cache_finishes_with_length(models):
    model = models(V41)
    engine = make_engine(model, V41, block_size=16, num_pages=3, prefill_chunk=16, cache_dtype="float")
    engine.add_request("big", prompt_of(30, seed=3), SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    outs = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        outs += [o for o in engine.step() if o.finished]
    assert not engine.has_unfinished_requests(), "the scheduler looped instead of finishing the sequence"
    assert outs[-1].outputs[0].finish_reason == "length"
    assert 0 < len(outs[-1].outputs[0].token_ids) < 64
    assert engine.stats()["kv_pages_used"] == 0


def test_budget_smaller_than_batch_is_refused(models):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_engine(models(V41), V41, max_num_seqs=8, max_num_batched_tokens=4)


def test_rejected_batch_leaves_nothing_queued():
    llm = LLM(V41, max_model_len=64, enforce_eager=True)
    with pytest.raises(RequestError):
        llm.generate([[5, 6, 7], [], [8, 9]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats()["kv_pages_used"] == 0


def test_bf16_engine_keeps_encoder_only_prefill():
    llm = LLM(V41, dtype="bfloat16", enforce_eager=True)
    assert llm.engine.encoder_only
    outs = llm.generate(["The quick brown fox", "jumps"], SamplingParams(max_tokens=6, temperature=0.0,
                                                                         ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert llm.engine.stats()["kv_pages_used"] == 0
