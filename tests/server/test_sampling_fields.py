"""The sampling fields of a request body reach the engine's SamplingParams under their OpenAI / vLLM names, in
the chat and the completions API alike (parsing only: no server)."""

from __future__ import annotations

import pytest

from flashserve.engine.sampling_params import SamplingParams
from flashserve.server.protocol import APIError, parse_chat_request, parse_completion_request

FIELDS = {"n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 7, "presence_penalty": 0.5,
          "frequency_penalty": -0.5, "repetition_penalty": 1.2, "stop": ["x"], "stop_token_ids": [3],
          "ignore_eos": True, "skip_special_tokens": False}


def parse(api: str, **body):
    if api == "chat":
        return parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **body}, vocab_size=512)
    return parse_completion_request({"prompt": "hi", **body}, vocab_size=512)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_every_sampling_field_reaches_the_engine(api):
    s = parse(api, **FIELDS, logit_bias={"4": 1.5}).sampling
    assert {k: getattr(s, k) for k in FIELDS} == FIELDS
    assert s.logit_bias == {4: 1.5}


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_fields_left_out_keep_the_engine_defaults(api):
    assert parse(api).sampling == SamplingParams()


def test_a_64_bit_seed_is_folded_into_the_engine_range():
    assert parse("chat", seed=2 ** 64 - 1).sampling.seed == 2 ** 63 - 1
    assert parse("chat", seed=-1).sampling.seed == 2 ** 63 - 1
    with pytest.raises(APIError) as e:
        parse("chat", seed=2 ** 64)
    assert e.value.param == "seed"


def test_max_tokens_names_differ_between_the_apis():
    assert parse("chat", max_completion_tokens=5, max_tokens=9).max_tokens == 5
    assert parse("chat", max_tokens=9).max_tokens == 9
    assert parse("completions", max_tokens=0, echo=True).max_tokens == 0
    assert parse("chat").max_tokens is None and parse("completions").max_tokens is None
