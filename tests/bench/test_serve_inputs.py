"""Datasets, arrivals, concurrency cap and speculative counters of ``bench serve``, without a server."""

import asyncio
import json

import numpy as np
import pytest

from flashserve.bench.datasets import random_requests, sharegpt_requests
from flashserve.bench.load import arrival_gaps, run_load
from flashserve.bench.serve import load_bench_tokenizer
from flashserve.bench.spec_metrics import acceptance, read_counters
from flashserve.errors import UserError


@pytest.fixture(scope="module")
def tok():
    return load_bench_tokenizer("tiny-v41")


def test_random_prompts_have_the_asked_lengths(tok):
    reqs = random_requests(tok, 12, 40, 9, seed=3)
    assert all(r.output_len == 9 for r in reqs)
    assert all(r.prompt_len == len(tok.encode(r.prompt)) for r in reqs)
    assert np.median([r.prompt_len for r in reqs]) == 40
    assert len({r.prompt for r in reqs}) == 12
    assert [r.prompt for r in random_requests(tok, 3, 40, 9, seed=3)] == [r.prompt for r in reqs[:3]]


def test_range_ratio_spreads_lengths(tok):
    reqs = random_requests(tok, 40, 20, 20, range_ratio=0.5, seed=1)
    outs = [r.output_len for r in reqs]
    assert min(outs) >= 10 and max(outs) <= 30 and len(set(outs)) > 5
    with pytest.raises(UserError, match="range-ratio"):
        random_requests(tok, 2, 20, 20, range_ratio=1.5)


def test_prefix_prompts_share_the_prefix(tok):
    reqs = random_requests(tok, 4, 8, 4, prefix_len=30, seed=2)
    prefix = reqs[0].prompt[: len(reqs[0].prompt) // 2]
    assert all(r.prompt.startswith(prefix) for r in reqs) and len({r.prompt for r in reqs}) == 4
    assert all(r.prompt_len >= 36 for r in reqs)


def test_sharegpt_file_json_and_jsonl(tok, tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"Question number {i}: tell me about the fox."},
                                {"from": "gpt", "value": "The quick brown fox jumps. " * (i + 1)}]}
             for i in range(5)]
    convs.append({"conversations": [{"from": "human", "value": "only one turn"}]})  # skipped
    js, jl = tmp_path / "d.json", tmp_path / "d.jsonl"
    js.write_text(json.dumps(convs))
    jl.write_text("\n".join(json.dumps(c) for c in convs))
    for path in (js, jl):
        reqs = sharegpt_requests(tok, path, 5)
        assert sorted(r.output_len for r in reqs) == sorted(len(tok.encode("The quick brown fox jumps. " * (i + 1)))
                                                             for i in range(5))
        assert all(r.prompt.startswith("Question number") for r in reqs)
    assert {r.output_len for r in sharegpt_requests(tok, js, 3, output_len=7)} == {7}
    with pytest.raises(UserError, match="fewer than --num-prompts 6"):
        sharegpt_requests(tok, js, 6)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        sharegpt_requests(tok, tmp_path / "bad.json", 1)


def test_unknown_tokenizer_is_refused():
    with pytest.raises(UserError, match="--tokenizer"):
        load_bench_tokenizer("some-remote-model")


def test_no_tokenizer_named_is_refused_not_taken_from_the_working_directory(tmp_path, monkeypatch, capsys):
    from flashserve.cli import main

    (tmp_path / "tokenizer.json").write_text("{}")  # a stray file that must not be picked up
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="empty name"):
        load_bench_tokenizer("")
    # without --tokenizer the server is asked what it serves; one that cannot be reached is named, with the flag
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:9 to ask which model it serves" in err and "pass --tokenizer" in err
    assert main(["bench", "sweep", "--base-url", "http://127.0.0.1:9", "--concurrency", "1", "--out",
                 str(tmp_path / "s"), "--no-progress"]) == 2
    assert "pass --tokenizer" in capsys.readouterr().err and not (tmp_path / "s").exists()


def test_arrivals_poisson_and_burstiness():
    assert arrival_gaps(4, float("inf"), 1.0, 0) == [0.0] * 4
    poisson = np.array(arrival_gaps(20000, 4.0, 1.0, 0))
    regular = np.array(arrival_gaps(20000, 4.0, 4.0, 0))
    assert poisson.mean() == pytest.approx(0.25, rel=0.03) and regular.mean() == pytest.approx(0.25, rel=0.03)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)  # exponential: cv 1
    assert regular.std() / regular.mean() == pytest.approx(0.5, rel=0.05)  # gamma shape 4: cv 1/2
    assert arrival_gaps(5, 2.0, 1.0, 7) == arrival_gaps(5, 2.0, 1.0, 7)
    with pytest.raises(UserError, match="--request-rate"):
        arrival_gaps(2, 0.0, 1.0, 0)


def test_max_concurrency_caps_requests_in_flight():
    in_flight, peak, done = 0, 0, []

    async def send(i: int) -> int:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01 * (5 - i % 5))
        in_flight -= 1
        return i * 10

    out = asyncio.run(run_load(list(range(7)), send, [0.0] * 7, 3, on_done=done.append))
    assert out == [i * 10 for i in range(7)] and sorted(done) == out and peak == 3
    peak = 0
    asyncio.run(run_load(list(range(7)), send, [0.0] * 7, None))
    assert peak == 7


METRICS_BEFORE = """# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{model_name="m"} 100
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 500
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 200
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 80
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 60
"""
METRICS_AFTER = METRICS_BEFORE.replace(" 100\n", " 140\n").replace(" 500\n", " 700\n").replace(
    " 200\n", " 290\n").replace(" 80\n", " 116\n").replace(" 60\n", " 90\n")


def test_speculative_acceptance_from_counter_growth():
    # over the run: 40 drafts, 200 draft tokens, 90 accepted; position 0 accepted 36, position 1 accepted 30
    out = acceptance(read_counters(METRICS_BEFORE), read_counters(METRICS_AFTER))
    assert out["spec_decode_acceptance_rate"] == pytest.approx(45.0)
    assert out["spec_decode_acceptance_length"] == pytest.approx(1 + 90 / 40)
    assert (out["spec_decode_num_drafts"], out["spec_decode_draft_tokens"], out["spec_decode_accepted_tokens"]) == (40, 200, 90)
    assert out["spec_decode_per_position_acceptance_rates"] == pytest.approx([0.9, 0.75])
    assert acceptance({}, read_counters("# no speculative counters\nfoo_total 3\n")) == {}
