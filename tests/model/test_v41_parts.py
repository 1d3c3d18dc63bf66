"""V4 / V4.1 components on small hand-checkable cases, for what no oracle covers (docs/architecture.md#classic-bugs)."""

from __future__ import annotations

import math

import pytest
import torch

from flashserve.config import load_config, preset_config
from flashserve.config.checkpoint_layout import checkpoint_layout
from flashserve.config.presets import PRESET_JSON
from flashserve.model import load_model
from flashserve.model.attention import candidate_pool
from flashserve.model.block import Block
from flashserve.model.context import ForwardContext
from flashserve.model.engram import EngramHasher, engram_multipliers
from flashserve.model.mhc import HyperMix, expand, hyper_mix
from flashserve.model.rope import RotaryTables, apply_rope, rope_inv_freq
from flashserve.model.transformer import Transformer

torch.set_grad_enabled(False)


@pytest.fixture(scope="module")
def v41():
    return load_model("tiny-v41", dtype=torch.float64, fake_quant=False)


def test_sinkhorn_is_doubly_stochastic_and_expand_sums_over_source():
    g = torch.Generator().manual_seed(0)
    n, D = 4, 8
    x = torch.randn(3, n, D, generator=g)
    mix = hyper_mix(x, torch.randn(24, n * D, generator=g), torch.randn(24, generator=g), torch.ones(3),
                    n=n, iters=20, hc_eps=1e-6, norm_eps=1e-20)
    # the last Sinkhorn step normalises columns (the sum over the source index j) exactly
    assert torch.allclose(mix.comb.sum(-2), torch.ones(3, n), atol=1e-5)
    assert torch.allclose(mix.comb.sum(-1), torch.ones(3, n), atol=0.1)
    comb = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    streams = torch.arange(4.0)[:, None].expand(n, D)
    out = expand(torch.zeros(D), streams, HyperMix(None, torch.zeros(n), comb))
    # comb[j, k] sends source stream j to destination k: destination 1 receives stream 0
    assert out[:, 0].tolist() == [3.0, 0.0, 1.0, 2.0]


def test_v41_block_collapses_attention_input_with_previous_pre():
    cfg = preset_config("tiny-v41")
    model = load_model("tiny-v41", dtype=torch.float64, fake_quant=False)
    block: Block = model.layers[0]
    x = torch.randn(1, 3, 4, cfg.hidden_size, dtype=torch.float64)
    outs = []
    for stream in (0, 2):
        pre = torch.zeros(1, 3, 4, dtype=torch.float64)
        pre[..., stream] = 1.0
        state = model.new_state(1)
        state.begin(3)
        ctx = ForwardContext(state=state, positions=torch.arange(3)[None], input_ids=torch.zeros(1, 3, dtype=torch.long),
                             rope=model.rope, fake_quant=False)
        outs.append(block(x, pre, ctx)[0])
    assert not torch.allclose(outs[0], outs[1]), "V4.1 attention must collapse with the incoming pre"
    v4 = load_model("tiny-v4", dtype=torch.float64)
    state = v4.new_state(1)
    state.begin(3)
    ctx = ForwardContext(state=state, positions=torch.arange(3)[None], input_ids=torch.zeros(1, 3, dtype=torch.long),
                         rope=v4.rope, fake_quant=False)
    a = v4.layers[0](x, torch.zeros(1, 3, 4, dtype=torch.float64), ctx)[0]
    state2 = v4.new_state(1)
    state2.begin(3)
    ctx.state = state2
    b = v4.layers[0](x, torch.ones(1, 3, 4, dtype=torch.float64), ctx)[0]
    assert torch.allclose(a, b), "V4 blocks use their own pre"


def test_rope_pairs_are_interleaved_and_inverse_undoes_it():
    x = torch.tensor([[5.0, 7.0, 1.0, 0.0]])  # nope dims (5, 7), one rope pair (1, 0)
    cos, sin = torch.tensor([[math.cos(0.3)]]), torch.tensor([[math.sin(0.3)]])
    y = apply_rope(x, cos, sin)
    assert torch.allclose(y, torch.tensor([[5.0, 7.0, math.cos(0.3), math.sin(0.3)]]))
    assert torch.allclose(apply_rope(y, cos, sin, inverse=True), x)


def test_yarn_applies_to_ratio_one_layers(v41):
    cfg = v41.cfg
    ratio_one = [i for i, r in enumerate(cfg.compress_ratios) if r == 1]
    assert ratio_one and all(v41.layers[i].attn.rope_kind == "compress" for i in ratio_one)
    plain = rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, None)
    yarn = RotaryTables(cfg).compress
    assert yarn[0] == pytest.approx(plain[0].item())  # fastest pair untouched (extrapolation)
    assert yarn[-1] == pytest.approx(plain[-1].item() / cfg.rope_scaling.factor)  # slowest interpolated


def test_sink_enlarges_only_the_denominator(v41):
    attn = v41.layers[0].attn
    x = torch.randn(1, 1, v41.cfg.hidden_size, dtype=torch.float64)

    def run(sink: float) -> torch.Tensor:
        attn.attn_sink.fill_(sink)
        state = v41.new_state(1)
        state.begin(1)
        ctx = ForwardContext(state=state, positions=torch.zeros(1, 1, dtype=torch.long),
                             input_ids=torch.zeros(1, 1, dtype=torch.long), rope=v41.rope, fake_quant=False)
        return attn(x, ctx)

    saved = attn.attn_sink.clone()
    try:
        # one key: softmax weight is 1/(1+exp(sink - score)); with sink -inf the key gets weight 1
        base, damped = run(-1e9), run(1e9)
        assert damped.abs().max() < 1e-6 * base.abs().max()
    finally:
        attn.attn_sink.copy_(saved)


def test_compressor_entries_respect_causality(v41):
    """Entry j (tokens 2j, 2j+1) must stay invisible until the query passes its last token."""
    ids = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(3))
    other = ids.clone()
    other[0, 13] = (ids[0, 13] + 7) % 500
    a, b = v41(ids).logits, v41(other).logits
    assert torch.allclose(a[0, :13], b[0, :13])
    assert not torch.allclose(a[0, 13:], b[0, 13:])


def test_chunked_state_starting_mid_group_equals_whole_sequence(v41):
    ids = torch.randint(3, 500, (2, 41), generator=torch.Generator().manual_seed(5))
    whole = v41(ids).logits
    state = v41.new_state(2)
    parts = [v41(ids[:, a:b], state).logits for a, b in ((0, 3), (3, 4), (4, 19), (19, 41))]
    assert torch.allclose(torch.cat(parts, 1), whole, atol=1e-9)


def test_candidate_pool_pins_the_newest_block():
    scores = torch.tensor([[[5.0, 4.0, 3.0, 2.0, 9.0, 8.0, -7.0]]])  # blocks of 2: [5,4] [3,2] [9,8] [-7]
    visible = torch.ones_like(scores, dtype=torch.bool)
    mask = candidate_pool(scores, visible, torch.tensor([[7]]), block=2, n_blocks=2)
    assert mask[0, 0].tolist() == [False, False, False, False, True, True, True]
    visible[..., 5:] = False  # newest visible entry is 4 → block 2 is pinned, best other block is 0
    mask = candidate_pool(scores, visible, torch.tensor([[5]]), block=2, n_blocks=2)
    assert mask[0, 0].tolist() == [True, True, False, False, True, True, False]


def _engram_ids_by_hand(z, mults, primes, offsets, pad, order):
    out = []
    for t in range(len(z)):
        vals, blocked = [], False
        for s in range(order):
            blocked = blocked or t - s < 0
            vals.append(pad if blocked else z[t - s])
        h, row = None, []
        for s, v in enumerate(vals):
            term = (v * mults[s] + 2**63) % 2**64 - 2**63
            h = term if h is None else h ^ term
            if s >= 1:
                heads = len(primes) // (order - 1)
                for k in range(heads):
                    p = primes[(s - 1) * heads + k]
                    row.append(h % p + offsets[(s - 1) * heads + k])
        out.append(row)
    return out


def test_engram_multipliers_and_ids():
    assert engram_multipliers(1, 4, 99092) == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert engram_multipliers(14, 4, 99092) == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    cfg = preset_config("tiny-v41")
    hasher = EngramHasher(cfg)
    seq = [17, 3, 250, 250, 9, 101, 44]
    ids = torch.tensor([[-1, -1, -1] + seq])
    got = hasher(ids, torch.zeros_like(ids, dtype=torch.bool))
    for li in range(2):
        expect = _engram_ids_by_hand(seq, hasher.multipliers[li].tolist(), hasher.primes[li].tolist(),
                                     hasher.offsets[li].tolist(), cfg.engram_pad_token_id, 4)
        assert got[0, :, li].tolist() == expect


@pytest.mark.parametrize("name", sorted(PRESET_JSON))
def test_built_model_has_exactly_the_checkpoint_layout(name):
    cfg = load_config(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    got = {k: tuple(v.shape) for k, v in model.checkpoint_tensors().items()}
    expected = {t.name: t.shape for t in checkpoint_layout(cfg)}  # the vision tower's names included
    assert got == expected


def test_encoder_only_equals_exact_when_the_prompt_fits_the_window(v41):
    ids = torch.randint(3, 500, (1, v41.cfg.sliding_window), generator=torch.Generator().manual_seed(8))
    exact = v41(ids).logits[:, -1]
    enc = v41(ids, encoder_only=True, logits_rows=1).logits[:, -1]
    assert torch.allclose(exact, enc, atol=1e-9)
    longer = torch.randint(3, 500, (1, 3 * v41.cfg.sliding_window), generator=torch.Generator().manual_seed(9))
    approx = v41(longer, encoder_only=True, logits_rows=1).logits
    assert approx.shape == (1, 1, v41.cfg.vocab_size) and torch.isfinite(approx).all()


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_fake_quant_switch(preset):
    plain = load_model(preset, dtype=torch.float64, fake_quant=False)
    quant = load_model(preset, dtype=torch.float64, fake_quant=True)
    assert load_model(preset).fake_quant == (preset == "tiny-v41")  # on by default for V4.1 only
    ids = torch.randint(3, 500, (1, 140), generator=torch.Generator().manual_seed(2))
    whole = quant(ids).logits
    diff = (whole - plain(ids).logits).abs().max()
    assert 0 < diff < 10
    # the quantisation points sit where the cached path sees the same values
    state = quant.new_state(1)
    chunks = torch.cat([quant(ids[:, a:b], state).logits for a, b in ((0, 61), (61, 62), (62, 140))], dim=1)
    assert torch.allclose(chunks, whole, atol=1e-9)


def test_draft_heads_produce_tokens(v41):
    cfg = v41.cfg
    ids = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(4))
    out = v41(ids, capture=cfg.dspark_target_layer_ids)
    nxt = out.logits[:, -1].argmax(-1)
    pos = torch.arange(20)[None].expand(2, -1)
    draft = v41.mtp.draft(v41, out.features, pos, nxt)
    assert draft.tokens.shape == (2, cfg.dspark_block_size)
    assert ((draft.confidence > 0) & (draft.confidence < 1)).all()
    v4 = load_model("tiny-v4", dtype=torch.float64)
    o4 = v4(ids, return_streams=True)
    logits = v4.mtp.logits(v4, o4.streams, ids)
    assert logits.shape == (2, 20, v4.cfg.vocab_size) and torch.isfinite(logits).all()


def test_bf16_model_keeps_fp32_parameters_and_runs_encoder_only():
    model = load_model("tiny-v41", dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    assert params["layers.3.ffn.gate.bias"].dtype == torch.float32
    assert params["layers.0.hc_attn_fn"].dtype == torch.float32
    assert params["layers.0.attn.attn_sink"].dtype == torch.float32
    assert params["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(6))
    ids[0, 30] = model.cfg.image_token_id  # ids survive the replay stash exactly
    out = model(ids, encoder_only=True, logits_rows=1).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_replay_contract_is_enforced(v41):
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(6))
    state = v41.new_state(1)
    v41(ids[:, :30], state, encoder_only=True, run_decoder=False)
    v41(ids[:, 30:], state, encoder_only=True)  # the replay, once
    with pytest.raises(ValueError, match="replay"):
        v41(ids[:, :5], state, encoder_only=True)
    fresh = v41.new_state(1)
    with pytest.raises(ValueError, match="cannot start"):
        v41(ids[:, :5], fresh, start=torch.tensor([5]))


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_bf16_forward_tracks_fp32(preset):
    """bf16 weights and activations with fp32 mHC, router, softmax and compressor math stay close to fp32.
    Random tiny models are chaotic (expert and top-k near-ties flip under bf16 noise; measured cosine ≈0.97
    for tiny-v41 and above 0.99 for tiny-v4), so this guards against gross dtype bugs, not rounding."""
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(12))
    ref = load_model(preset, dtype=torch.float32, fake_quant=False)(ids).logits
    got = load_model(preset, dtype=torch.bfloat16, fake_quant=False)(ids).logits.float()
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    assert cos > 0.93, f"cosine similarity {cos:.4f}"
