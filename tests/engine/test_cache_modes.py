"""Cache accounting, page release, and the agreement numbers of the approximate / packed modes."""

import pytest
import torch

from engine_helpers import make_engine, prompt_of, run_greedy
from flashserve.config.arithmetic import model_arithmetic
from flashserve.engine import SamplingParams


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_packed_bytes_per_token_match_arithmetic(models, name):
    model = models(name, torch.float32)
    engine = make_engine(model, name, dtype="float32", cache_dtype="packed", kv_memory="1MiB")
    cache = engine.cache
    allocated = sum(r.pages.numel() * r.pages.element_size() for r in cache.storage.paged)
    per_token = allocated / ((cache.num_pages + 1) * cache.page_tokens)  # + the scratch page
    assert per_token == model_arithmetic(model.cfg).kv_bytes_per_token
    assert cache.num_pages == (1 << 20) // cache.page_bytes


def test_pages_and_slots_free_after_finish_and_abort(models):
    name = "tiny-v41"
    engine = make_engine(models(name), name, block_size=16)
    for i in range(6):
        engine.add_request(f"r{i}", prompt_of(10 + 9 * i, seed=i), SamplingParams(max_tokens=30, temperature=0.0,
                                                                                 ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.stats()["kv_pages_used"] > 0
    engine.abort_request("r1")
    engine.abort_request("r4")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("late", prompt_of(40, seed=9), SamplingParams(max_tokens=5))
    engine.step()
    engine.abort_request("late")  # abort while running: freed at once
    assert engine.stats()["kv_pages_used"] == 0
    assert not engine.has_unfinished_requests()
    assert sorted(engine.scheduler.free_slots) == list(range(engine.cache.num_slots))


def _first_logits_and_tokens(engine, prompts, n):
    from flashserve.engine.sampler import sample

    firsts = []
    orig = sample

    def spy(logits, rows, gen=None):
        firsts.append(logits.detach().clone())
        return orig(logits, rows, gen)

    import flashserve.engine.model_runner as le  # where the step samples

    le.sample = spy
    try:
        toks = []
        for p in prompts:  # one at a time so the first sampled row is this prompt's first token
            firsts.clear()
            toks.append((run_greedy(engine, [p], n)[0], firsts[0][0]))
    finally:
        le.sample = orig
    return toks


def _agreement(a, b):
    first = sum(x[0][0] == y[0][0] for x, y in zip(a, b)) / len(a)
    agree = sum(x[0] == y[0] for x, y in zip(a, b)) / len(a)
    tok_agree = sum(sum(u == v for u, v in zip(x[0], y[0])) / len(x[0]) for x, y in zip(a, b)) / len(a)
    diff = max(float((x[1] - y[1]).abs().max()) for x, y in zip(a, b))
    return first, agree, tok_agree, diff


def test_encoder_only_and_packed_agreement(models, capsys):
    """Reported numbers: greedy agreement and max first-token logit difference over 10 prompts."""
    name = "tiny-v41"
    model = models(name)
    prompts = [prompt_of(8 + 11 * i, seed=300 + i) for i in range(10)]
    exact = _first_logits_and_tokens(make_engine(model, name, exact_prefill=True, cache_dtype="float"), prompts, 8)
    enc = _first_logits_and_tokens(make_engine(model, name, exact_prefill=False, cache_dtype="float"), prompts, 8)
    packed = _first_logits_and_tokens(make_engine(model, name, exact_prefill=False, cache_dtype="packed"), prompts, 8)
    e_first, e_seq, e_tok, e_diff = _agreement(exact, enc)
    p_first, p_seq, p_tok, p_diff = _agreement(enc, packed)
    with capsys.disabled():
        print(f"\n[tiny-v41] encoder-only vs exact prefill over {len(prompts)} prompts: first greedy token "
              f"{e_first:.2%}, identical 8-token greedy continuations {e_seq:.2%}, per-token agreement {e_tok:.2%}, max |first-token logit diff| {e_diff:.3g}")
        print(f"[tiny-v41] packed vs float cache (encoder-only): first token {p_first:.2%}, "
              f"identical continuations {p_seq:.2%}, "
              f"per-token agreement {p_tok:.2%}, max |first-token logit diff| {p_diff:.3g}")
    # prompts shorter than the window see no truncation: encoder-only is exact there
    assert all(x[0] == y[0] for x, y, p in zip(exact, enc, prompts) if len(p) <= model.cfg.sliding_window)
    assert e_tok >= 0.5 and p_tok >= 0.5


def test_v4_packed_cache_agreement(models, capsys):
    """V4 has no QAT rounding, so its packed FP8 rows are lossy: report agreement with the float cache."""
    name = "tiny-v4"
    model = models(name)
    prompts = [prompt_of(8 + 11 * i, seed=400 + i) for i in range(10)]
    flt = _first_logits_and_tokens(make_engine(model, name, cache_dtype="float"), prompts, 8)
    pk = _first_logits_and_tokens(make_engine(model, name, cache_dtype="packed"), prompts, 8)
    first, seq, tok, diff = _agreement(flt, pk)
    with capsys.disabled():
        print(f"\n[tiny-v4] packed (FP8) vs float cache over {len(prompts)} prompts: first token {first:.2%}, identical "
              f"continuations {seq:.2%}, per-token agreement {tok:.2%}, max |first-token logit diff| {diff:.3g}")
    assert first >= 0.5 and diff < 5.0  # a random tiny model is chaotic: later tokens diverge quickly


def test_sequence_larger_than_cache_finishes_with_length(models):
    name = "tiny-v41"
    engine = make_engine(models(name), name, block_size=16, num_pages=3)
    engine.add_request("big", prompt_of(30, seed=1), SamplingParams(max_tokens=64, temperature=0.0,
                                                                    ignore_eos=True))
    last = None
    for _ in range(200):
        for out in engine.step():
            last = out
        if not engine.has_unfinished_requests():
            break
    assert last is not None and last.finished and last.outputs[0].finish_reason == "length"
    assert 0 < len(last.outputs[0].token_ids) < 64
    assert engine.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("replay", ["exact", "window"])
def test_encoder_only_prefix_hit_agreement(models, capsys, replay):
    """Encoder-only prefix hits: "exact" replay (encoder depth × window) equals a cold encoder-only run;
    the serving stacks' one-window rule is approximate: report its agreement."""
    name = "tiny-v41"
    model = models(name)
    base = prompt_of(120, seed=11)
    prompts = [base + prompt_of(5 + i, seed=500 + i) for i in range(6)]
    cold = run_greedy(make_engine(model, name, enable_prefix_caching=False, block_size=16), prompts, 8)
    engine = make_engine(model, name, block_size=16, prefix_replay=replay)
    warm = run_greedy(engine, prompts[:1], 8) + run_greedy(engine, prompts[1:], 8)
    same = sum(a == b for a, b in zip(cold, warm)) / len(cold)
    first = sum(a[0] == b[0] for a, b in zip(cold, warm)) / len(cold)
    hit = engine.stats()["prefix_cache_hit_rate"]
    with capsys.disabled():
        print(f"\n[tiny-v41] encoder-only prefix hit ({replay} replay) vs cold over {len(prompts)} prompts (hit rate {hit:.0%}): first token "
              f"{first:.0%}, identical 8-token continuations {same:.0%}")
    assert warm[0] == cold[0]  # the first request had nothing cached
    assert hit > 0.5 and first >= 0.5
    if replay == "exact":
        assert warm == cold
    assert engine.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_decode_reads_only_the_picked_compressed_rows(models, name, monkeypatch):
    """A decode step reads whole compressed caches only where it must (every entry of a dense HCA layer): the
    indexer scores the index keys in their pages (``cpu_kernels.index_topk``), sparse layers fetch their k
    picked rows from the pages, and the tokens are those of the packed cache read whole."""
    from flashserve.engine.batch_state import BatchState
    from flashserve.engine.fixed_state import FixedBatchState
    from flashserve.model.state import CacheKey, gather_entries

    model = models(name, torch.float32)
    cfg = model.cfg
    sparse_src = {CacheKey(cfg.kv_source(i)) for i in range(cfg.num_hidden_layers)
                  if cfg.compress_ratios[i] and cfg.index_source(i) is not None}
    dense_src = {CacheKey(cfg.kv_source(i)) for i in range(cfg.num_hidden_layers)
                 if cfg.compress_ratios[i] and cfg.index_source(i) is None}
    assert sparse_src - dense_src
    prompts = [prompt_of(n, seed=n) for n in (70, 133)]
    real_read, real_rows = BatchState.compressed, BatchState.compressed_rows
    with monkeypatch.context() as m:  # the plain way: read every entry, then pick
        m.setattr(BatchState, "compressed_rows",
                  lambda self, key, index: gather_entries(real_read(self, key)[0], index))
        whole = run_greedy(make_engine(model, name, dtype="float32", cache_dtype="packed"), prompts, 6)

    reads, picked = [], []

    real_fixed_read = FixedBatchState.compressed  # decode steps run on the fixed-shape state

    def spy_read(self, key):
        if self.num_new == 1:
            reads.append(key)
        return real_read(self, key)

    def spy_fixed_read(self, key):
        reads.append(key)
        return real_fixed_read(self, key)

    def spy_rows(self, key, index):
        picked.append((key, index.shape[-1]))
        return real_rows(self, key, index)

    monkeypatch.setattr(BatchState, "compressed", spy_read)
    monkeypatch.setattr(FixedBatchState, "compressed", spy_fixed_read)
    monkeypatch.setattr(BatchState, "compressed_rows", spy_rows)
    engine = make_engine(model, name, dtype="float32", cache_dtype="packed")
    assert run_greedy(engine, prompts, 6) == whole
    assert picked and set(reads) <= dense_src and bool(reads) == bool(dense_src)
    assert {k for k, _ in picked} == sparse_src
    assert all(k <= cfg.index_topk for _, k in picked)
