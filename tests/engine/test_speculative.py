"""Speculative decoding: verification emits the target's tokens, rejected rows leave no trace in the cache,
sampling keeps the target's distribution, drafts stay within the budget, and the options are checked."""

from __future__ import annotations

import pytest
import torch

from flashserve.config import ConfigError
from flashserve.engine import EngineConfig, SamplingParams
from flashserve.engine.spec_config import SpeculativeConfig
from flashserve.engine.speculative import NgramIndex, Proposal, accept

from engine_helpers import make_engine, prompt_of, run_greedy


# ---------------------------------------------------------------- verification rule
def _rows(argmaxes: list[int], V: int = 12) -> torch.Tensor:
    lg = torch.zeros(len(argmaxes), V, dtype=torch.float64)
    for j, t in enumerate(argmaxes):
        lg[j, t] = 3.0
    return lg


def test_greedy_verification_keeps_the_agreeing_prefix_and_adds_the_targets_token():
    greedy = SamplingParams(temperature=0.0)
    lg = _rows([5, 7, 2, 9])
    assert accept(lg, [5, 7, 2], greedy, None) == [5, 7, 2, 9]  # all accepted: the bonus token too
    assert accept(lg, [5, 7, 3], greedy, None) == [5, 7, 2]  # third rejected: the target's token instead
    assert accept(lg, [1, 7, 2], greedy, None) == [5]  # first rejected
    assert accept(lg, [], greedy, None) == [5]
    assert accept(lg, [5], greedy, None) == [5, 7]  # rows past the draft are padding, never read


def _chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def _emitted_distribution(accept_fn, N: int = 12000):
    """Two-position chain over 4 tokens: the first emitted token, and the second when the first is draft 0."""
    g = torch.Generator().manual_seed(0)
    row0 = torch.tensor([1.0, 0.4, -0.3, -1.2], dtype=torch.float64)
    row1 = torch.tensor([-0.5, 0.9, 0.2, 0.0], dtype=torch.float64)  # the target's row given the first is 0
    row2 = torch.tensor([0.3, 0.3, -0.2, 0.1], dtype=torch.float64)
    logits = torch.stack([row0, row1, row2])
    params = SamplingParams(temperature=0.7, seed=None)
    first, second = [0] * 4, [0] * 4
    for _ in range(N):
        out = accept_fn(logits, [0, 3], params, g)
        first[out[0]] += 1
        if out[0] == 0 and len(out) > 1:
            second[out[1]] += 1
    p0 = torch.softmax(row0 / 0.7, -1).tolist()
    p1 = torch.softmax(row1 / 0.7, -1).tolist()
    return _chi2(first, p0), _chi2(second, p1)


CHI2_3DOF_1E4 = 21.11  # chi-square, 3 degrees of freedom, p = 1e-4


def test_speculative_sampling_reproduces_the_target_distribution():
    """Drafts [0, 3] are proposed every time (a one-hot draft distribution); the emitted tokens must still be
    distributed as the target's softmax(logits / T). A verifier that draws the rejection token from p itself
    (not p with the draft removed) over-produces the draft and fails the same statistic."""
    c_first, c_second = _emitted_distribution(accept)
    assert c_first < CHI2_3DOF_1E4 and c_second < CHI2_3DOF_1E4, (c_first, c_second)

    def biased(logits, draft, params, g):  # rejection draws from p, not from p - q
        from flashserve.engine.sampler import sampling_probs

        probs = sampling_probs(logits.float(), [params] * len(logits))
        out = []
        for j, d in enumerate(draft):
            if float(torch.rand(1, generator=g)) < float(probs[j, d]):
                out.append(d)
                continue
            return out + [int(torch.multinomial(probs[j], 1, generator=g))]
        return out + [int(torch.multinomial(probs[len(draft)], 1, generator=g))]

    b_first, _ = _emitted_distribution(biased)
    assert b_first > CHI2_3DOF_1E4, b_first


def test_drafts_drawn_from_the_drafters_distribution_keep_the_target_distribution():
    """Drafts drawn at random from q (as DSpark drafts a sampled request's) and verified against q: the emitted
    token is distributed as p, and a draft is kept with probability sum(min(p, q)), more often than p(argmax q)
    (a greedy draft of the same drafter) and than sum(p * q) (the same drawn drafts verified as one-hot, q=None:
    exact too, but it keeps fewer)."""
    g = torch.Generator().manual_seed(1)
    T = 0.7
    target = torch.tensor([[1.0, 0.4, -0.3, -1.2], [0.2, 0.1, 0.0, -0.1]], dtype=torch.float64)
    q = torch.softmax(torch.tensor([0.6, 0.9, -0.4, -1.0], dtype=torch.float64) / T, -1)
    p = torch.softmax(target[0] / T, -1)
    params = SamplingParams(temperature=T)
    N = 12000

    def run(pass_q: bool):
        first, kept = [0] * 4, 0
        for _ in range(N):
            d = int(torch.multinomial(q, 1, generator=g))
            out = accept(target, [d], params, g, q[None] if pass_q else None)
            first[out[0]] += 1
            kept += len(out) == 2
        return _chi2(first, p.tolist()), kept / N

    chi, rate = run(True)
    assert chi < CHI2_3DOF_1E4, chi
    expected = float(torch.minimum(p, q).sum())
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / N) ** 0.5, (rate, expected)
    assert expected > float(p[q.argmax()]) + 0.1  # the point of drawing drafts: more of them are kept
    chi_onehot, rate_onehot = run(False)
    assert chi_onehot < CHI2_3DOF_1E4, chi_onehot
    onehot = float((p * q).sum())
    assert abs(rate_onehot - onehot) < 4 * (onehot * (1 - onehot) / N) ** 0.5, (rate_onehot, onehot)
    assert expected > onehot + 0.1


# ---------------------------------------------------------------- drafters
def test_ngram_index_drafts_what_followed_the_latest_earlier_occurrence():
    idx = NgramIndex(1, 3)
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    assert idx.lookup(toks, 2) == [5, 6]  # "1 2 3" last followed by 5 6 (not by 4 9)
    toks += [5]
    assert idx.lookup(toks, 3) == [6, 1, 2]
    assert NgramIndex(2, 3).lookup([7, 8, 9], 4) == []  # no earlier occurrence


class OracleDrafter:
    """Drafts the known greedy continuation, wrong from a rotating position on in two drafts of three, so
    verification meets full, partial and no acceptance (real acceptance on random-weight models)."""

    capture = ()

    def __init__(self, continuation: dict[str, list[int]], seed: int = 0):
        self.cont, self.n = continuation, seed

    def observe(self, *a) -> None:
        pass

    def prefill_rows(self, *a) -> int:
        return 0

    def propose(self, seqs, k, generator=None):
        out = []
        for s in seqs:
            ref = self.cont[s.group.request_id]
            d = list(ref[s.num_computed + 1 - s.num_prompt:][:k])
            self.n += 1
            if d and self.n % 3:
                j = self.n % len(d)
                d[j] = (d[j] + 1) % 500 + 1  # not the greedy token
            out.append(Proposal(d))
        return out


CROSSING = [prompt_of(n, seed=n) for n in (14, 31, 9)]  # verification spans ratio groups and window edges


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_greedy_output_is_the_targets_with_a_drafter_that_is_often_right(models, name):
    model = models(name)
    base = run_greedy(make_engine(model, name), CROSSING, 36)
    eng = make_engine(model, name, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    eng.drafter = OracleDrafter({f"r{i}": b for i, b in enumerate(base)})
    got = run_greedy(eng, CROSSING, 36)
    assert got == base
    st = eng.stats()["spec_decode"]
    assert 0 < st["num_accepted_tokens"] < st["num_draft_tokens"]  # both acceptance and rejection happened
    assert eng.num_steps < 36 + len(CROSSING) * 2  # fewer steps than one token each


@pytest.mark.parametrize("name,method", [("tiny-v41", "ngram"), ("tiny-v41", "dspark"), ("tiny-v4", "ngram"),
                                         ("tiny-v4", "mtp")])
def test_greedy_output_is_the_targets_with_each_drafter(models, name, method):
    model = models(name, with_mtp=True)
    rep = prompt_of(10, seed=3)
    prompts = [rep * 3, prompt_of(23, seed=4)]  # the repeated one gives the n-gram drafter matches
    base = run_greedy(make_engine(model, name), prompts, 30)
    eng = make_engine(model, name, speculative_config={"method": method, "num_speculative_tokens": 3})
    assert run_greedy(eng, prompts, 30) == base
    assert eng.stats()["spec_decode"]["num_drafts"] > 0


def _running(engine, steps: int):
    for _ in range(steps):
        engine.step()
    (seq,) = engine.scheduler.running
    return seq


@torch.inference_mode()
def test_dspark_drafts_what_the_reference_drafter_drafts(models):
    """The engine's stage windows (keys written from prefill and verification features) give the drafts the
    reference DSpark forward makes from the whole sequence's features: after prefill and after decoding."""
    name = "tiny-v41"
    model = models(name, with_mtp=True)
    cfg = model.cfg
    eng = make_engine(model, name, exact_prefill=True,
                      speculative_config={"method": "dspark", "num_speculative_tokens": 5})
    eng.add_request("r", prompt_of(21, seed=5), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for steps in (1, 6):
        seq = _running(eng, steps)
        end = seq.num_computed
        out = model(torch.tensor([seq.tokens[:end]]), capture=tuple(cfg.dspark_target_layer_ids))
        ref = model.mtp.draft(model, out.features, torch.arange(end)[None], torch.tensor([seq.tokens[end]]))
        assert seq.draft == ref.tokens[0].tolist(), f"after {steps} step(s)"


@pytest.mark.parametrize("name,method", [("tiny-v41", "dspark"), ("tiny-v4", "mtp")])
def test_a_sampled_requests_drafts_are_drawn_from_the_drafters_sampling_distribution(models, name, method):
    """Beside a greedy request (its drafts the drafter's argmax, no distribution), a sampled request's drafts are
    drawn from the drafter's logits under the request's temperature and top-k: each comes with the distribution
    it was drawn from (a probability row with at most top-k tokens, the draft among them), and the drafts are not
    always the argmax. With ``draft_sample_method: greedy`` no draft comes with a distribution."""
    model = models(name, with_mtp=True)
    V = model.cfg.vocab_size

    def drafts(**spec) -> list[tuple]:
        """(greedy request's draft, its distribution, sampled request's draft, its distribution) after each step"""
        eng = make_engine(model, name, speculative_config={"method": method, "num_speculative_tokens": 3, **spec})
        eng.add_request("g", prompt_of(21, seed=5), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        eng.add_request("s", prompt_of(17, seed=6), SamplingParams(max_tokens=30, temperature=1.5, top_k=20, seed=3,
                                                                    ignore_eos=True))
        seen = []
        for _ in range(12):
            eng.step()
            by_id = {s.group.request_id: s for s in eng.scheduler.running}
            if set(by_id) == {"g", "s"} and by_id["s"].draft:
                g, s = by_id["g"], by_id["s"]
                seen.append((list(g.draft), g.draft_probs, list(s.draft), s.draft_probs))
        assert len(seen) >= 4
        return seen

    differs = 0
    for g_draft, g_probs, s_draft, q in drafts():
        assert g_probs is None
        n = len(s_draft)
        assert q.shape == (n, V) and torch.allclose(q.sum(-1), torch.ones(n), atol=1e-5)
        assert ((q > 0).sum(-1) <= 20).all()
        drafted = torch.tensor(s_draft)
        assert (q[torch.arange(n), drafted] > 0).all()
        differs += int((drafted != q.argmax(-1)).any())
    assert differs > 0
    assert all(g_probs is None and q is None for _, g_probs, _, q in drafts(draft_sample_method="greedy"))


@torch.inference_mode()
def test_mtp_drafts_what_the_reference_chain_drafts(models):
    """The engine's MTP window (caught up after prefill and each verification) gives the drafts of the MTP
    block run over the whole sequence's final streams, then chained on its own output."""
    name = "tiny-v4"
    model = models(name, with_mtp=True)
    eng = make_engine(model, name, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    eng.add_request("r", prompt_of(27, seed=6), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for steps in (1, 5):
        seq = _running(eng, steps)
        end = seq.num_computed
        out = model(torch.tensor([seq.tokens[:end]]), return_streams=end)
        state = model.new_state(1)
        logits, x = model.mtp.step(model, out.streams, torch.tensor([seq.tokens[1:end + 1]]), state)
        ref = [int(logits[0, -1].argmax())]
        for _ in range(2):
            logits, x = model.mtp.step(model, x[:, -1:], torch.tensor([[ref[-1]]]), state)
            ref.append(int(logits[0, -1].argmax()))
        assert seq.draft == ref, f"after {steps} step(s)"


def _logical_state(engine, seq) -> dict:
    """Everything a later step can read of ``seq``'s cache, by position (ring capacities may differ)."""
    st, slot, end = engine.cache.storage, seq.slot, seq.num_computed
    W = engine.cache.window_size
    out = {"history": st.history[slot].tolist()}
    for i, lay in enumerate(st.layers):
        cap, first = lay.window.rows.shape[1], int(lay.window.first[slot])
        pos = [p for p in range(max(end - W + 1, first, 0), end)]
        out[f"win{i}"] = lay.window.rows[slot, [p % cap for p in pos]].clone() if pos else None
        for tag, ring in (("main_ring", lay.main_ring), ("index_ring", lay.index_ring)):
            if ring is not None:
                keep = int(ring.keep[slot])
                pos = list(range(keep, end)) if keep < end else []
                out[f"{tag}{i}"] = (keep if pos else None, ring.rows[slot, [p % ring.capacity for p in pos]].clone()
                                    if pos else None)
        for tag, rows in (("main", lay.main), ("index", lay.index)):
            if rows is not None:
                n = int(rows.counts[slot])
                e = torch.arange(n)
                pages = engine.cache.page_table[slot, e // rows.per_page]
                out[f"{tag}{i}"] = (n, rows.pages[pages, e % rows.per_page].clone())
    return out


def _assert_same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, tuple):
            assert x[0] == y[0], (where, k)
            x, y = x[1], y[1]
        if x is None or y is None:
            assert x is None and y is None, (where, k)
        elif isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10, msg=f"{where}: {k}")
        else:
            assert x == y, (where, k)


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_after_rejected_drafts_the_cache_equals_a_run_that_never_drafted(models, name):
    """After every verification (rollback done), each sequence's window rings, partial groups, global entries
    and engram look-back equal those of a plain run at the same position."""
    model = models(name)
    prompt = prompt_of(19, seed=11)
    base_eng = make_engine(model, name, cache_dtype="float")
    base = run_greedy(base_eng, [prompt], 30)[0]
    eng = make_engine(model, name, cache_dtype="float",
                      speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    eng.drafter = OracleDrafter({"r0": base}, seed=5)
    eng.add_request("r0", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    snaps = {}
    while eng.has_unfinished_requests():
        eng.step()
        for s in eng.scheduler.running:
            if s.prefill_done:
                snaps[s.num_computed] = _logical_state(eng, s)
    assert eng.stats()["spec_decode"]["num_accepted_tokens"] < eng.stats()["spec_decode"]["num_draft_tokens"]
    ref = make_engine(model, name, cache_dtype="float")
    ref.add_request("r0", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    checked = 0
    while ref.has_unfinished_requests():
        ref.step()
        for s in ref.scheduler.running:
            if s.prefill_done and s.num_computed in snaps:
                _assert_same(_logical_state(ref, s), snaps[s.num_computed], f"position {s.num_computed}")
                checked += 1
    assert checked >= 5


@pytest.mark.parametrize("method", ["ngram", "dspark"])
def test_sampled_speculation_runs_seeded_and_reproducibly(models, method):
    name = "tiny-v41"
    model = models(name, with_mtp=True)
    rep = prompt_of(8, seed=9) * 4
    sp = SamplingParams(max_tokens=24, temperature=0.8, top_k=50, seed=123, ignore_eos=True)

    def run():
        eng = make_engine(model, name, speculative_config={"method": method, "num_speculative_tokens": 3})
        eng.add_request("a", rep, sp)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    return out.outputs[0]

    a, b = run(), run()
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    assert a.spec_decode is not None and a.spec_decode["num_draft_tokens"] > 0


# ---------------------------------------------------------------- budget, switch-off, statistics
def test_drafts_count_inside_the_token_budget(models):
    name = "tiny-v41"
    model = models(name)
    base = run_greedy(make_engine(model, name), CROSSING, 12)
    eng = make_engine(model, name, max_num_seqs=3, max_num_batched_tokens=5,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    eng.drafter = OracleDrafter({f"r{i}": b for i, b in enumerate(base)})
    seen = []
    schedule = eng.scheduler.schedule

    def spy():
        out = schedule()
        seen.append(sum(n for _, n in out.chunks))
        decoding = [n for s, n in out.chunks if s.prefill_done]
        assert all(n >= 1 for n in decoding)
        return out

    eng.scheduler.schedule = spy
    assert run_greedy(eng, CROSSING, 12) == base
    assert max(seen) <= 5
    assert eng.stats()["spec_decode"]["num_drafts"] > 0


def test_speculation_switches_off_above_the_batch_size_limit(models):
    name = "tiny-v41"
    model = models(name)
    rep = prompt_of(6, seed=2) * 4
    eng = make_engine(model, name, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                       "disable_by_batch_size": 1})
    run_greedy(eng, [rep, rep], 10)  # two decode together throughout: never more than the limit of 1
    assert eng.stats()["spec_decode"]["num_drafts"] == 0
    run_greedy(eng, [rep], 10)
    assert eng.stats()["spec_decode"]["num_drafts"] > 0


def test_acceptance_statistics_per_request_and_in_aggregate(models):
    name = "tiny-v41"
    model = models(name)
    base = run_greedy(make_engine(model, name), CROSSING[:2], 20)
    eng = make_engine(model, name, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    eng.drafter = OracleDrafter({f"r{i}": b for i, b in enumerate(base)})
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(CROSSING[:2]):
        eng.add_request(f"r{i}", p, sp)
    per = []
    while eng.has_unfinished_requests():
        per += [o.outputs[0].spec_decode for o in eng.step() if o.finished]
    total = eng.stats()["spec_decode"]
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert sum(p[key] for p in per) == total[key]
    assert total["acceptance_rate"] == pytest.approx(total["num_accepted_tokens"] / total["num_draft_tokens"])
    assert total["mean_acceptance_length"] == pytest.approx(1 + total["num_accepted_tokens"] / total["num_drafts"])
    pos = total["accepted_per_position"]
    assert sum(pos) == total["num_accepted_tokens"] and all(a >= b for a, b in zip(pos, pos[1:]))
    assert total["per_position_acceptance_rate"] == pytest.approx([a / total["num_drafts"] for a in pos])
    # each request's emitted tokens = one per verification + accepted drafts (20 tokens, 1 from prefill)
    for p in per:
        assert p["num_drafts"] + p["num_accepted_tokens"] <= 19


# ---------------------------------------------------------------- options
@pytest.mark.parametrize("value,message", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "not one of"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}', "unknown field(s) draft_model"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ("{method: ngram}", "not valid JSON"),
    ('{"method": "dspark", "num_speculative_tokens": 2, "draft_sample_method": "random"}',
     "draft_sample_method: 'random' is not one of probabilistic, greedy"),
])
def test_speculative_config_is_checked(value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.parse(value)


def test_drafters_that_the_model_cannot_run_are_refused(models):
    with pytest.raises(ConfigError, match="needs a V4.1 model"):
        make_engine(models("tiny-v4"), "tiny-v4", speculative_config={"method": "dspark", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="needs a V4 model"):
        make_engine(models("tiny-v41", with_mtp=True), "tiny-v41",
                    speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="has no MTP weights"):
        make_engine(models("tiny-v4"), "tiny-v4", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="exceeds the DSpark block size"):
        make_engine(models("tiny-v41", with_mtp=True), "tiny-v41",
                    speculative_config={"method": "dspark", "num_speculative_tokens": 6})


# ------------------------------------------------------------------------------ on by default where shipped


def _v4_folder(path, with_drafter: bool):
    """A tiny V4 checkpoint folder, with or without its MTP block's tensors."""
    from flashserve.config import preset_config
    from flashserve.model.checkpoint import save_checkpoint
    from flashserve.model.init import random_init
    from flashserve.model.transformer import Transformer

    cfg = preset_config("tiny-v4")
    tensors = random_init(Transformer(cfg), seed=2).checkpoint_tensors()
    if not with_drafter:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    save_checkpoint(tensors, path, cfg, quantize=False)
    return str(path)


def test_a_checkpoint_that_ships_its_drafter_speculates_by_default(tmp_path, caplog):
    """With no speculative_config, a checkpoint storing its drafter decodes with it (the embedded V4.1: DSpark, a
    whole block; a V4 checkpoint: MTP, one token), and the log says so; "off" turns it off; presets (random
    weights) and checkpoints without a drafter do not speculate. Greedy tokens are the same either way."""
    import logging

    from flashserve.engine.llm_engine import LLMEngine
    from flashserve.models import default_model

    kw = dict(kv_memory="16MiB", max_num_seqs=2, dtype="float32", enforce_eager=True)
    with caplog.at_level(logging.INFO, logger="flashserve"):
        on = LLMEngine(EngineConfig(model=default_model(), **kw))
    assert (on.spec.method, on.spec.num_speculative_tokens) == ("dspark", on.model_config.dspark_block_size)
    assert "speculative decoding: dspark, 5 tokens a step, sampled requests' drafts probabilistic" in caplog.text
    assert "--speculative-config off" in caplog.text
    off = LLMEngine(EngineConfig(model=default_model(), speculative_config="off", **kw))
    assert off.spec is None and off.drafter is None
    prompt = off.tokenizer.encode("def fibonacci(n):")
    assert run_greedy(on, [prompt], 24) == run_greedy(off, [prompt], 24)
    assert on.spec_stats.as_dict()["num_accepted_tokens"] > 0  # it did draft, and drafts were taken

    assert LLMEngine(EngineConfig(model="tiny-v41", **kw)).spec is None  # a preset: seeded random weights
    mtp = LLMEngine(EngineConfig(model=_v4_folder(tmp_path / "with", True), **kw)).spec
    assert (mtp.method, mtp.num_speculative_tokens) == ("mtp", 1)
    assert LLMEngine(EngineConfig(model=_v4_folder(tmp_path / "without", False), **kw)).spec is None
