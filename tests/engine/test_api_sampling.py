"""Offline API, request validation, sampling options, streaming and the incremental detokenizer."""

import pytest

from engine_helpers import make_engine
from flashserve import LLM
from flashserve.engine import QueueFullError, RequestError, SamplingParams
from flashserve.engine.detokenizer import IncrementalDetokenizer
from flashserve.engine.tokenizer import load_tokenizer

# one worker runs the module: its server fixture starts once
pytestmark = pytest.mark.xdist_group("test_api_sampling")


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-v41", max_num_seqs=8, enforce_eager=True)


def test_generate_text_and_ids(llm):
    outs = llm.generate(["Hello, world!", "The quick brown fox"], SamplingParams(max_tokens=6, temperature=0.0,
                                                                               ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    o = outs[0]
    assert o.finished and o.outputs[0].finish_reason == "length"
    assert o.prompt == "Hello, world!" and o.prompt_token_ids == llm.tokenizer.encode("Hello, world!")
    assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids)
    again = llm.generate(o.prompt_token_ids, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert again[0].outputs[0].token_ids == o.outputs[0].token_ids
    s = llm.engine.stats()
    for k in ("num_running", "num_waiting", "kv_pages_used", "kv_pages_total", "prefix_cache_hit_rate",
              "prompt_tokens_total", "generation_tokens_total"):
        assert k in s
    assert s["kv_pages_used"] == 0


def test_stream_deltas_add_up(llm):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    chunks = list(llm.stream("Once upon a time", params))
    assert chunks[-1].finished
    final = chunks[-1].outputs[0]
    assert "".join(c.outputs[0].delta_text for c in chunks) == final.text
    assert sum((c.outputs[0].delta_token_ids for c in chunks), []) == final.token_ids


def test_seed_reproducible_and_n(llm):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=123, ignore_eos=True)
    a = llm.generate("abc", p)[0].outputs[0].token_ids
    b = llm.generate(["x y z", "abc"], [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True), p])
    assert b[1].outputs[0].token_ids == a  # per-request generator: independent of batch company
    n = llm.generate("abc", SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=123, ignore_eos=True))[0]
    assert [c.index for c in n.outputs] == [0, 1, 2]
    assert n.outputs[0].token_ids == a
    assert len({tuple(c.token_ids) for c in n.outputs}) > 1


def test_sampling_filters(llm):
    greedy = llm.generate("abc", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].outputs[0]
    top1 = llm.generate("abc", SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True))[0].outputs[0]
    tiny_p = llm.generate("abc", SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, ignore_eos=True))[0]
    minp = llm.generate("abc", SamplingParams(max_tokens=8, temperature=1.0, min_p=1.0, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids == tiny_p.outputs[0].token_ids == minp.outputs[0].token_ids
    pen = llm.generate("abc", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                             frequency_penalty=2.0, presence_penalty=2.0,
                                             repetition_penalty=1.5))[0].outputs[0]
    assert len(pen.token_ids) == 16
    assert len(set(pen.token_ids)) >= len(set(greedy.token_ids))


def test_logprobs_and_prompt_logprobs(llm):
    o = llm.generate("hello there", SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2,
                                                   ignore_eos=True))[0]
    lps = o.outputs[0].logprobs
    assert len(lps) == 4
    for tid, d in zip(o.outputs[0].token_ids, lps):
        assert tid in d and 3 <= len(d) <= 4
        assert d[tid] == pytest.approx(max(d.values()))  # greedy picks the most likely token
        assert all(v <= 0 for v in d.values())
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(o.prompt_token_ids)
    for tid, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]):
        assert tid in d


def test_stop_token_ids_and_strings(llm):
    base = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0]
    stop_id = base.token_ids[3]
    o = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                           stop_token_ids=[stop_id]))[0].outputs[0]
    k = base.token_ids.index(stop_id)
    assert o.token_ids == base.token_ids[:k + 1] and o.finish_reason == "stop" and o.stop_reason == stop_id
    text = base.text
    if len(text) >= 6:
        stop = text[3:6]
        o = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == text[:text.index(stop)]


def test_request_errors(llm):
    eng = llm.engine
    with pytest.raises(RequestError, match="prompt"):
        eng.add_request("e1", "", SamplingParams())
    with pytest.raises(RequestError, match="prompt"):
        eng.add_request("e2", [5] * eng.max_model_len, SamplingParams())
    for field, value in [("temperature", -1.0), ("top_p", 0.0), ("max_tokens", 0), ("n", 0), ("top_k", -3),
                         ("min_p", 2.0), ("logprobs", 100), ("repetition_penalty", 0.0),
                         ("stop_token_ids", [10 ** 6])]:
        with pytest.raises(RequestError, match=field):
            eng.add_request("e3", "hi", SamplingParams(**{field: value}))
    assert not eng.has_unfinished_requests()


def test_queue_full(models):
    engine = make_engine(models("tiny-v4"), "tiny-v4", max_waiting=2)
    engine.add_request("a", [5, 6], SamplingParams())
    engine.add_request("b", [5, 6], SamplingParams())
    with pytest.raises(QueueFullError):
        engine.add_request("c", [5, 6], SamplingParams())
    engine.abort_request("a")
    engine.abort_request("b")
    assert not engine.has_unfinished_requests()


def test_detokenizer_utf8_and_stop_holdback():
    tok = load_tokenizer("tiny-v41")
    text = "naïve 日本語 ok STOP here"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    pieces, stopped = [], None
    for t in ids:
        stopped = d.add(t)
        delta = d.take_delta(final=stopped is not None)
        assert "\ufffd" not in delta
        assert not (d.text.endswith("ST") and not stopped and delta.endswith("ST"))
        pieces.append(delta)
        if stopped:
            break
    assert stopped == "STOP"
    assert "".join(pieces) == "naïve 日本語 ok "


def test_cli_generate(llm, capsys):
    from flashserve.cli import main

    assert main(["generate", "tiny-v41", "Hello", "--max-tokens", "5", "--temperature", "0", "--ignore-eos",
                 "--enforce-eager"]) == 0
    out = capsys.readouterr()
    want = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert out.out == want.text + "\n"
    assert out.err.startswith("5 tokens in ") and "tok/s" in out.err


def test_stream_stop_string_never_leaks(llm):
    base = llm.generate("Hello", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].outputs[0]
    text = base.text
    assert len(text) >= 8, f"the seeded greedy text is too short to cut: {text!r}"
    stop = text[5:8]
    chunks = list(llm.stream("Hello", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop])))
    final = chunks[-1].outputs[0]
    joined = "".join(c.outputs[0].delta_text for c in chunks)
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert joined == final.text == text[:text.index(stop)]
    for c in chunks:  # the cumulative text never shows a prefix of the stop string that is later withdrawn
        assert final.text.startswith(c.outputs[0].text)


def test_n_streaming_and_abort_frees(llm):
    eng = llm.engine
    eng.add_request("nstream", "abc", SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True))
    seen = {0: [], 1: []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            for c in out.outputs:
                seen[c.index] += c.delta_token_ids
            if out.finished:
                assert [len(c.token_ids) for c in out.outputs] == [6, 6]
                assert [seen[c.index] for c in out.outputs] == [c.token_ids for c in out.outputs]
    assert eng.stats()["kv_pages_used"] == 0


def _drain(engine, rid_prefix: str, prompts, params) -> dict[str, list]:
    outs: dict[str, list] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"{rid_prefix}{i}", p, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_output_kinds_carry_the_same_completion(llm):
    """"delta" outputs add up to the "cumulative" final output; "final_only" sends that output alone."""
    engine = llm.engine
    prompts = ["Once upon a time", "abc"]

    def params(kind):
        return SamplingParams(n=2, max_tokens=14, temperature=0.9, seed=7, ignore_eos=True, logprobs=2,
                              prompt_logprobs=1, stop=["e t"], output_kind=kind)

    cum = _drain(engine, "cum", prompts, params("cumulative"))
    delta = _drain(engine, "dlt", prompts, params("delta"))
    final = _drain(engine, "fin", prompts, params("final_only"))
    for i in range(len(prompts)):
        c, d, f = cum[f"cum{i}"], delta[f"dlt{i}"], final[f"fin{i}"]
        assert len(f) == 1 and f[0].finished and len(d) == len(c) > 1
        assert f[0].prompt_logprobs == c[-1].prompt_logprobs == d[0].prompt_logprobs
        assert all(o.prompt_logprobs is None for o in d[1:])  # sent once
        for j in range(2):
            whole = c[-1].outputs[j]
            pieces = [o.outputs[j] for o in d]
            assert "".join(p.text for p in pieces) == whole.text == f[0].outputs[j].text
            assert sum((p.token_ids for p in pieces), []) == whole.token_ids == f[0].outputs[j].token_ids
            assert sum((p.logprobs for p in pieces), []) == whole.logprobs == f[0].outputs[j].logprobs
            assert all(p.token_ids == p.delta_token_ids for p in pieces)  # nothing but the new part
            assert pieces[-1].finish_reason == whole.finish_reason
    assert engine.stats()["kv_pages_used"] == 0


def test_output_kind_validated(llm):
    with pytest.raises(RequestError, match="output_kind"):
        llm.engine.add_request("bad-kind", "abc", SamplingParams(output_kind="deltas"))
