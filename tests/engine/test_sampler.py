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
