"""A step's host cost does not grow with the output's length (docs/engine-speed.md#host-work-per-step): the
engine's step at output position 50,000 takes within 1.1x of its time at position 50.

The model's forward is replaced by one that returns fixed logits, so what is timed is the engine's own work:
scheduling, page tables, sampling with penalties and logprobs, stop strings, detokenization and outputs.
The long sequences get their 50,000 tokens through the engine's own per-token bookkeeping (``_append``: token
list, penalty counts, logprobs, detokenizer, stop checks) rather than 50,000 timed steps. Times are medians
of interleaved steps (short, long, short, ...), so drift on a shared machine hits both sides alike; a cost
that grows with length fails every attempt, noise rarely fails three in a row.
"""

from __future__ import annotations

import itertools
import statistics
import time
from types import SimpleNamespace

import pytest
import torch

from flashserve.engine import EngineConfig, LLMEngine, SamplingParams
from flashserve.engine.detokenizer import IncrementalDetokenizer
from flashserve.engine.tokenizer import load_tokenizer

SHORT, LONG = 50, 50_000
PAIRS, ATTEMPTS, BOUND = 300, 3, 1.1
STOP = ["\x00never"]  # a stop string the synthetic tokens cannot produce: searched for, never found


class FixedForward:
    """Stands in for the model's forward: the same logits every call, in constant time."""

    def __init__(self, vocab: int):
        self.logits = torch.randn(8, 1, vocab, generator=torch.Generator().manual_seed(0))

    def __call__(self, ids: torch.Tensor, state, **kw) -> SimpleNamespace:
        return SimpleNamespace(logits=self.logits[:ids.shape[0]])


def long_ids(n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(16, vocab - 1, (n,), generator=g).tolist()


def engine_at(model, position: int) -> LLMEngine:
    """Two running sequences ("delta" and "final_only" outputs, penalties, logprobs, a stop string) whose
    outputs reach ``position`` tokens."""
    engine = LLMEngine(EngineConfig(model="tiny-v41", num_pages=2048, max_num_seqs=4, enforce_eager=True), model=model)
    engine.runner.model = engine.runner.decode_step.model = FixedForward(model.cfg.vocab_size)
    engine.max_model_len = 10 ** 9  # the fixed forward has no position limit
    for kind in ("delta", "final_only"):
        params = SamplingParams(max_tokens=10 ** 9, temperature=0.0, ignore_eos=True, stop=STOP, logprobs=1,
                                presence_penalty=0.1, frequency_penalty=0.1, repetition_penalty=1.1,
                                output_kind=kind)
        engine.add_request(kind, list(range(20, 40)), params)
    while not any(s.prefill_done for s in engine.scheduler.running):
        engine.step()
    extra = long_ids(position, model.cfg.vocab_size)
    with torch.inference_mode():  # as inside a step
        for seq in engine.scheduler.running:
            for t in extra[len(seq.tokens) - seq.num_prompt:position]:
                engine._append(seq, t, {t: -1.0})
            seq.num_computed = seq.num_tokens - 1  # the new tokens count as computed but the last
    for _ in range(10):  # pages for the new tokens, their prefix hashes, first sampling
        engine.step()
    return engine


def step_seconds(engine: LLMEngine) -> float:
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def add_seconds(d: IncrementalDetokenizer, token: int) -> float:
    """One token added and its delta taken, timed."""
    t = time.perf_counter()
    d.add(token)
    d.take_delta(final=False)
    return time.perf_counter() - t


def token_cost_ratios(short: IncrementalDetokenizer, long: IncrementalDetokenizer, tokens) -> list[float]:
    """Median token cost of ``long`` over ``short`` per attempt (the same next tokens to both, interleaved),
    until one is within ``BOUND`` or ``ATTEMPTS`` are made."""
    ratios = []
    for _ in range(ATTEMPTS):
        times = [(add_seconds(short, t), add_seconds(long, t)) for t in itertools.islice(tokens, PAIRS)]
        a, b = (statistics.median(t) for t in zip(*times))
        ratios.append(b / a)
        if b <= BOUND * a:
            break
    return ratios


@pytest.fixture(scope="module")
def engines(models):
    model = models("tiny-v41", torch.float32)
    return engine_at(model, SHORT), engine_at(model, LONG)


def test_step_host_time_does_not_grow_with_output_length(engines):
    short, long = engines
    assert min(len(s.tokens) - s.num_prompt for s in long.scheduler.running) >= LONG
    assert max(len(s.tokens) - s.num_prompt for s in short.scheduler.running) < 2 * SHORT
    ratios = []
    for _ in range(ATTEMPTS):
        times = [(step_seconds(short), step_seconds(long)) for _ in range(PAIRS)]
        a, b = (statistics.median(t) for t in zip(*times))
        ratios.append(b / a)
        if b <= BOUND * a:
            break
    assert ratios[-1] <= BOUND, f"step time at {LONG} / at {SHORT} tokens, per attempt: {ratios}"
    assert all(not s.finished for s in short.scheduler.running + long.scheduler.running)


def test_detokenizer_token_cost_does_not_grow_with_text_length():
    """Per token: decode window, stop search, hold-back and delta, at 50 and at 50,000 tokens of text; both
    detokenizers get the same next token, so its text's length does not differ between the two sides."""
    tok = load_tokenizer("tiny-v41")
    ids = long_ids(LONG + PAIRS * ATTEMPTS, tok.vocab_size)
    short, long = (IncrementalDetokenizer(tok, stop=STOP) for _ in range(2))
    for t in ids[:SHORT]:
        short.add(t)
    for t in ids[:LONG]:
        long.add(t)
    assert len(long.text) > 50 * len(short.text)  # the long text really is long (~3 characters per token)
    nxt = iter(ids[LONG:])

    ratios = token_cost_ratios(short, long, nxt)
    assert ratios[-1] <= BOUND, f"token cost at {LONG} / at {SHORT} tokens, per attempt: {ratios}"


def test_kept_penalty_counts_follow_the_definition(models):
    """Penalties from counts kept across steps choose what the definition does over the whole history:
    logit / r (or * r when negative) for ids seen in the prompt or output, then minus frequency * count and
    presence * [count > 0]."""
    model = models("tiny-v41", torch.float32)
    engine = LLMEngine(EngineConfig(model="tiny-v41", max_num_seqs=2, num_pages=16, enforce_eager=True), model=model)
    fixed = engine.runner.model = engine.runner.decode_step.model = FixedForward(model.cfg.vocab_size)
    prompt = [int(i) for i in fixed.logits[0, 0].topk(3).indices]  # the prompt holds the 3 likeliest ids
    freq, pres, rep, n = 0.4, 0.3, 1.5, 40
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, frequency_penalty=freq,
                            presence_penalty=pres, repetition_penalty=rep, output_kind="delta")
    engine.add_request("p", prompt, params)
    got = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got += out.outputs[0].delta_token_ids
    base, want = fixed.logits[0, 0].double(), []
    for _ in range(n):
        count = torch.zeros_like(base)
        for t in want:
            count[t] += 1
        seen = count > 0
        seen[prompt] = True
        lg = torch.where(seen, torch.where(base > 0, base / rep, base * rep), base)
        want.append(int((lg - freq * count - pres * (count > 0).double()).argmax()))
    assert len(set(want)) > 5  # the penalties really move the choice around
    assert got == want


def test_detokenizer_text_and_stop_string_across_compacted_text():
    """Text long enough to be compacted many times: deltas, the whole text and a stop string found at its
    end agree with the plain text; a detokenizer read only at the end (final_only) gives the same text."""
    tok = load_tokenizer("tiny-v41")
    text = " ".join(f"word{i}" for i in range(600)) + " STOP after"
    ids = tok.encode(text)
    want = text[:text.index("STOP")]
    streamed, final_only = (IncrementalDetokenizer(tok, stop=["STOP", "x" * 40]) for _ in range(2))
    pieces, stopped, late = [], None, None
    for t in ids:
        stopped = streamed.add(t)
        pieces.append(streamed.take_delta(final=stopped is not None))
        late = late or final_only.add(t)
        if stopped:
            break
    assert stopped == late == "STOP"
    assert len(want) > 8 * 256  # compacted several times
    assert "".join(pieces) == streamed.text == want
    assert final_only.take_delta(final=True) == final_only.text == want


def test_detokenizer_token_cost_does_not_grow_with_tokens_that_make_no_text():
    """Ids that add no text (skipped special tokens, ids past the tokenizer's vocabulary: a random model's
    output with a smaller tokenizer) do not widen every later token's decode window; text around them is
    the whole sequence's decode."""
    tok = load_tokenizer("tiny-v41")
    special = [i for i in sorted(tok.special_tokens.values()) if tok.is_special(i)]
    textless = [tok.vocab_size + 7, special[-1], tok.vocab_size + 100]
    short, long = (IncrementalDetokenizer(tok, stop=STOP) for _ in range(2))
    head = tok.encode("naïve 日本語 ")
    for d, n in ((short, SHORT), (long, LONG)):
        for t in head + [textless[i % 3] for i in range(n)]:
            d.add(t)
    assert short.text == long.text == tok.decode(head)
    ratios = token_cost_ratios(short, long, iter([tok.vocab_size + 3] * (PAIRS * ATTEMPTS)))
    assert ratios[-1] <= BOUND, f"token cost after {LONG} / after {SHORT} textless ids, per attempt: {ratios}"
    tail = tok.encode("ok 語")
    for t in tail:
        long.add(t)
    long.finish()
    assert long.text == tok.decode(head + tail)


def test_detokenizer_keeps_the_first_textless_tokens_and_flushes_unfinished_bytes():
    """The first tokens without text stay in the window (a decoder may strip what starts a text); bytes that
    never finish a character are emitted as replacement characters after a bounded number of tokens."""
    tok = load_tokenizer("tiny-v41")
    d = IncrementalDetokenizer(tok)
    for t in [tok.vocab_size + 1] * 3 + tok.encode("ab"):
        d.add(t)
    assert len(d.ids) == 5 and d.text == "ab"
    lone = tok.encode("日")[:1]  # the first byte of a three-byte character, repeated: never valid UTF-8
    d = IncrementalDetokenizer(tok)
    for _ in range(40):
        d.add(lone[0])
    assert len(d.ids) - d.prefix_offset <= 20 and d.text.startswith("\ufffd")
