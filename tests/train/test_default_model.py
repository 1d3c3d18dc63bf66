"""The embedded default model: it loads from the package with no network, serves through the engine with the
held-out perplexity its training reported (within 2%), and is what LLM() and `flashserve generate PROMPT` use."""

import json
import math

import pytest

from flashserve.models import DEFAULT_MODEL_DIR, default_model, resolve_model

REPORT = DEFAULT_MODEL_DIR / "report.json"


@pytest.fixture(scope="module")
def report():
    return json.loads(REPORT.read_text())


def test_folder_is_complete_and_small():
    names = {p.name for p in DEFAULT_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "report.json",
            "heldout_sample.json"} <= names
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir()) <= 40 * 2**20
    assert resolve_model(None) == default_model() == str(DEFAULT_MODEL_DIR)
    assert resolve_model("tiny-v41") == "tiny-v41"


def test_engine_perplexity_is_the_reported_one(report, monkeypatch):
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("the default model must load without the network")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    from flashserve.train.recipe import engine_nll

    chunks = json.loads((DEFAULT_MODEL_DIR / report["heldout_sample"]["file"]).read_text())["chunks"]
    nll, count = engine_nll(DEFAULT_MODEL_DIR, chunks)
    assert count == report["heldout_sample"]["tokens_scored"]
    ppl = math.exp(nll)
    assert ppl == pytest.approx(report["heldout_sample"]["engine_ppl"], rel=0.02)
    # the sample's perplexity is of the held-out split's order (the split's own number is in the report)
    assert ppl < 3 * report["heldout"]["served_ppl"]


def test_llm_without_a_model_is_the_default():
    from flashserve import LLM, SamplingParams

    llm = LLM(enforce_eager=True)
    assert llm.engine.config.model == default_model()
    out = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert len(out.token_ids) == 12 or out.finish_reason == "stop"
    assert out.text.strip()


def test_generate_command_without_a_model(capsys):
    from flashserve.cli import main

    assert main(["generate", "def fibonacci(n):", "--max-tokens", "8", "--temperature", "0", "--enforce-eager"]) == 0
    assert capsys.readouterr().out.strip()


def test_serve_and_generate_parse_without_a_model():
    from flashserve.cli import build_parser

    p = build_parser()
    assert p.parse_args(["serve"]).model is None
    args = p.parse_args(["generate", "def f(n):"])
    assert (args.model, args.prompt) == (None, "def f(n):")
    args = p.parse_args(["generate", "tiny-v41", "hi"])
    assert (args.model, args.prompt) == ("tiny-v41", "hi")


def test_shipped_drafter_is_trained_on_the_models_own_text():
    """DSpark on the default model accepts most of its drafts on held-out prompts, where after the first few
    tokens it drafts after the model's own greedy text, and its output is the model's own. Mean acceptance
    length here: 3.08 shipped; 2.49 for the drafter before self-distillation, about 1 untrained."""
    from flashserve import LLM, SamplingParams
    from flashserve.bench.spec import heldout_prompts

    prompts = heldout_prompts(4)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    spec = LLM(speculative_config={"method": "dspark", "num_speculative_tokens": 5}, threads=1, enforce_eager=True)
    outs = spec.generate(prompts, params)
    drafts = sum(o.outputs[0].spec_decode["num_drafts"] for o in outs)
    accepted = sum(o.outputs[0].spec_decode["num_accepted_tokens"] for o in outs)
    assert 1 + accepted / drafts >= 2.75
    plain = LLM(threads=1, enforce_eager=True).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
