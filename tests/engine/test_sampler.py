"""The sampler on fixed logits: which tokens each filter keeps, the sampled distribution, penalties and
logprobs, checked against the definitions rather than against the engine's own outputs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from flashserve.engine import SamplingParams
from flashserve.engine.sampler import SampleRow, sample

PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor([[math.log(p) for p in PROBS]], dtype=torch.float64)


def draws(params: SamplingParams, n: int = 400, output_ids=()) -> Counter:
    gen = torch.Generator().manual_seed(0)
    rows = [SampleRow(params, [], list(output_ids), gen)]
    return Counter(sample(LOGITS.clone(), rows).token_ids[0] for _ in range(n))


def test_top_k_top_p_and_min_p_keep_the_defined_sets():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2))) == {0, 1}
    # top-p keeps the smallest prefix whose mass reaches p: 0.5 < 0.7 <= 0.8
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.7))) == {0, 1}
    # min-p keeps tokens with p >= min_p * p_max = 0.25
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.5))) == {0, 1}
    assert set(draws(SamplingParams(temperature=1.0))) == {0, 1, 2, 3}


def test_sampled_frequencies_follow_the_distribution():
    counts = draws(SamplingParams(temperature=1.0), n=4000)
    for tok, p in enumerate(PROBS):
        assert abs(counts[tok] / 4000 - p) < 0.03
    renorm = draws(SamplingParams(temperature=1.0, top_k=2), n=4000)
    assert abs(renorm[0] / 4000 - 0.5 / 0.8) < 0.03


def test_seeded_rows_repeat():
    a = [draws(SamplingParams(temperature=1.0), n=20)]
    b = [draws(SamplingParams(temperature=1.0), n=20)]
    assert a == b


def test_penalties_move_greedy_choice():
    base = SamplingParams(temperature=0.0)
    assert sample(LOGITS.clone(), [SampleRow(base, [], [], None)]).token_ids == [0]
    # log-prob gap between tokens 0 and 1 is log(5/3) ≈ 0.51
    for params in (SamplingParams(temperature=0.0, presence_penalty=0.6),
                   SamplingParams(temperature=0.0, frequency_penalty=0.3),  # applied twice: 0.6
                   SamplingParams(temperature=0.0, repetition_penalty=2.0)):
        out = sample(LOGITS.clone(), [SampleRow(params, [], [0, 0], None)])
        assert out.token_ids == [1], params


def test_logprobs_are_log_softmax_of_the_logits():
    params = SamplingParams(temperature=0.0, logprobs=2)
    out = sample(LOGITS.clone(), [SampleRow(params, [], [], None)])
    lp = out.logprobs[0]
    assert set(lp) == {0, 1}
    for tok in lp:
        assert lp[tok] == pytest.approx(math.log(PROBS[tok]), abs=1e-9)


def test_logit_bias_adds_to_the_logits():
    row = SampleRow(SamplingParams(temperature=0.0, logit_bias={3: 100.0}), [], [], None)
    assert sample(LOGITS.clone(), [row]).token_ids == [3]  # the least likely token, pushed to the top
    row = SampleRow(SamplingParams(temperature=0.0, logit_bias={0: -100.0}), [], [], None)
    assert sample(LOGITS.clone(), [row]).token_ids == [1]  # the most likely, pushed out


def _tiny_guides():
    from flashserve.engine.guided import Guides
    from flashserve.engine.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny-v41", 512)
    return tok, Guides(tok, 512)


def test_a_mixed_batch_masks_only_the_constrained_rows():
    """Rows 0 and 2 must spell a JSON object of one digit; row 1 is free: its tokens are those of the same row
    sampled in a batch without any constraint (same seeds), and the constrained rows parse."""
    import json

    from flashserve.engine.sampling_params import Constraint

    tok, guides = _tiny_guides()
    schema = json.dumps({"type": "object", "properties": {"d": {"type": "integer", "minimum": 0, "maximum": 9}},
                         "required": ["d"], "additionalProperties": False})
    c = Constraint("json", schema)
    logits = torch.randn(40, 3, 512, generator=torch.Generator().manual_seed(1))  # noise for every step
    p = SamplingParams(temperature=1.0)
    free_gen, ref_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    rows = [SampleRow(p, [], [], torch.Generator().manual_seed(i), guide=guides.guide(c) if i != 1 else None)
            for i in range(3)]
    rows[1].generator = free_gen
    out: list[list[int]] = [[], [], []]
    free_ref = []
    for step in logits:
        for i, t in enumerate(sample(step.clone(), rows).token_ids):
            out[i].append(t)
        ref = SampleRow(p, [], [], ref_gen)
        free_ref.append(sample(step[1:2].clone(), [ref]).token_ids[0])
    assert out[1] == free_ref
    for i in (0, 2):
        ids = out[i][:out[i].index(tok.eos_token_id)]  # the grammar ends the row with EOS
        value = json.loads(tok.decode(ids))
        assert set(value) == {"d"} and 0 <= value["d"] <= 9


def test_an_uncompilable_schema_names_the_field():
    from flashserve.engine.sampling_params import Constraint, RequestError

    _, guides = _tiny_guides()
    with pytest.raises(RequestError, match="response_format: the constraint cannot be compiled: .*nope"):
        guides.check(Constraint("json", '{"$ref": "#/nope"}', param="response_format"))


def test_a_guide_waiting_for_its_start_forbids_ending_the_sequence():
    """In thinking mode a constraint starts after </think>; until then EOS and the request's stop token ids are
    masked (the answer cannot be skipped by ending inside the reasoning), </think> itself stays allowed, and
    from the token after it the grammar decides."""
    from flashserve.engine.sampling_params import Constraint

    tok, guides = _tiny_guides()
    think = tok.token_to_id("</think>")
    guide = guides.guide(Constraint("json", '{"type": "object"}', after=think), stop_token_ids=[7])
    logits = torch.zeros(1, 512)
    logits[0, tok.eos_token_id] = logits[0, 7] = 50.0  # what a model about to stop inside its reasoning gives
    logits[0, think] = 10.0
    row = SampleRow(SamplingParams(temperature=0.0), [], [], None, guide=guide)
    assert sample(logits.clone(), [row]).token_ids == [think]
    first = sample(logits.clone(), [row]).token_ids[0]
    assert first not in (tok.eos_token_id, 7) and tok.decode([first]).lstrip().startswith("{")


def test_the_cpu_argmax_is_torchs_first_maximum():
    """The sampler's argmax (numpy's on the CPU) picks what ``torch.argmax`` picks: the first of equal maxima,
    the first NaN, in float32 and float64, on strided rows."""
    from flashserve.engine.sampler import argmax

    g = torch.Generator().manual_seed(7)
    cases = [torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]]),
             torch.tensor([[1.0, float("nan"), 5.0, float("nan")]]),
             torch.randn(3, 700, generator=g, dtype=torch.float64),
             torch.randn(5, 4, generator=g).t(),
             torch.randint(0, 3, (4, 50), generator=g).float()]
    for x in cases:
        got = argmax(x)
        assert got.dtype == torch.long and got.tolist() == x.argmax(-1).tolist()
