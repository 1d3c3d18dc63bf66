"""Engine tokens against the reference forward, and invariances of batching, chunking, prefix hits and
preemption (float64, exact prefill, so near-ties in routing / top-k cannot flip)."""

import pytest

from engine_helpers import make_engine, prompt_of, reference_greedy, run_greedy

# prompt lengths cross the window (16), the ratio-2/4 groups and (tiny-v4, with generation) the ratio-128 group
CASES = {"tiny-v4": [7, 90], "tiny-v41": [7, 37]}


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_exact_prefill_matches_reference(models, name):
    model = models(name)
    prompts = [prompt_of(n, seed=n) for n in CASES[name]]
    engine = make_engine(model, name, exact_prefill=True, cache_dtype="float")
    got = run_greedy(engine, prompts, 48)
    for p, g in zip(prompts, got):
        assert g == reference_greedy(model, p, 48)
    assert engine.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("name,mode", [("tiny-v41", {}), ("tiny-v4", {})])
def test_batch_invariance(models, name, mode):
    model = models(name)
    target = prompt_of(29, seed=1)
    # different lengths, and three of the target's length so its prefill is batched with theirs
    others = [prompt_of(29 if i % 5 == 0 else 3 + 5 * i, seed=100 + i) for i in range(15)]
    alone = run_greedy(make_engine(model, name, **mode), [target], 16)[0]
    batch = run_greedy(make_engine(model, name, **mode), others[:7] + [target] + others[7:], 16)[7]
    assert alone == batch


@pytest.mark.parametrize("name,exact", [("tiny-v41", True), ("tiny-v41", False), ("tiny-v4", True)])
def test_chunked_prefill_same_tokens(models, name, exact):
    model = models(name)
    prompt = prompt_of(45, seed=7)  # crosses the window (16) and every ratio-2/4 group boundary
    results = {}
    for chunk in (1, 7, 32, None):
        engine = make_engine(model, name, exact_prefill=exact, prefill_chunk=chunk, enable_prefix_caching=False)
        results[chunk] = run_greedy(engine, [prompt], 8)[0]
    assert results[1] == results[7] == results[32] == results[None]


@pytest.mark.parametrize("name", ["tiny-v41", "tiny-v4"])
def test_prefix_hit_matches_cold(models, name):
    model = models(name)
    base = prompt_of(300, seed=3)
    prompts = [base + prompt_of(9, seed=4), base + prompt_of(20, seed=5)]
    cold = run_greedy(make_engine(model, name, exact_prefill=True, enable_prefix_caching=False,
                                  block_size=16), prompts, 16)
    engine = make_engine(model, name, exact_prefill=True, block_size=16)
    warm = run_greedy(engine, prompts[:1], 16) + run_greedy(engine, prompts[1:], 16)
    assert warm == cold
    assert engine.stats()["prefix_cache_hit_rate"] > 0.3
    assert engine.scheduler.replay_start(288, True) > 0  # the hit replays only the tail, not the whole prefix
    assert engine.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("name,prefix", [("tiny-v41", False), ("tiny-v41", True), ("tiny-v4", False)])
def test_forced_preemption_same_tokens(models, name, prefix):
    """Too few pages for every running sequence: the scheduler preempts (recompute) and tokens do not change."""
    model = models(name)
    base = 20 if name == "tiny-v41" else 100  # tiny-v4 pages hold 128 tokens: cross one while decoding
    prompts = [prompt_of(base + 7 * i, seed=20 + i) for i in range(4)]
    ample = run_greedy(make_engine(model, name, exact_prefill=True), prompts, 40)
    engine = make_engine(model, name, exact_prefill=True, block_size=16, enable_prefix_caching=prefix,
                         num_pages=10 if name == "tiny-v41" else 4)
    tight = run_greedy(engine, prompts, 40)
    assert engine.stats()["num_preemptions"] > 0
    assert tight == ample
    assert engine.stats()["kv_pages_used"] == 0
