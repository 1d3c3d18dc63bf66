"""The training recipe (flashserve.train): the fast mode runs every stage and is deterministic for a seed, and
the drafter's training forward computes what DSparkStages.draft computes."""

import json

import pytest
import torch

from flashserve.train.recipe import Recipe, run, stage_export


def test_fast_recipe_is_deterministic_and_exports_a_loadable_model(tmp_path):
    r = Recipe.fast(tmp_path / "work", tmp_path / "model", steps=3)
    first = run(r, ("tokenizer", "backbone"), progress=False)["backbone"]["losses"]
    again = run(r, ("backbone",), progress=False)["backbone"]["losses"]
    other = run(Recipe.fast(r.work, r.out, steps=3, seed=1), ("backbone",), progress=False)["backbone"]["losses"]
    assert first == again
    assert first != other
    assert all(torch.isfinite(torch.tensor(first)))
    drafter = run(r, ("drafter",), progress=False)["drafter"]
    assert len(drafter["losses"]) == r.drafter_steps and all(x == x for x in drafter["losses"])
    distill = run(r, ("distill",), progress=False)["distill"]
    assert len(distill["losses"]) == r.distill_steps and all(x == x for x in distill["losses"])
    own = torch.load(r.work / "own_text.pt")["rows"]
    assert own.shape == (r.distill_prompts, r.distill_prompt_len + r.distill_gen_len)
    assert run(r, ("distill",), progress=False)["distill"]["losses"] != distill["losses"]  # went on from its result
    report = stage_export(r, engine=False)
    assert report["heldout"]["served_ppl"] > 1 and report["heldout"]["float_ppl"] > 1
    files = {p.name for p in r.out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "report.json",
            "heldout_sample.json"} <= files
    assert json.loads((r.out / "report.json").read_text())["heldout"] == report["heldout"]

    from flashserve.model.loader import load_model

    model = load_model(r.out)
    assert model.mtp is not None and model.fake_quant  # drafters stored; V4.1 serves with its QAT points


def test_tokenizer_ids_match_the_config():
    from flashserve.engine.tokenizer import TINY_SPECIALS
    from flashserve.train.tokenizer import IMAGE_TOKEN_ID, NOISE_TOKEN_ID, SPECIALS, train_tokenizer

    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20], 300)
    assert tok.token_to_id("<｜begin▁of▁sentence｜>") == 0 and tok.token_to_id("<｜end▁of▁sentence｜>") == 1
    assert tok.token_to_id("<｜▁pad▁｜>") == 2 and tok.token_to_id("<｜System｜>") == NOISE_TOKEN_ID
    assert tok.token_to_id("<｜deepseek_image｜>") == IMAGE_TOKEN_ID
    for i, (text, special) in SPECIALS.items():
        assert tok.token_to_id(text) == i
        if i in TINY_SPECIALS:
            assert TINY_SPECIALS[i] == (text, special)
    # <think> and <｜System｜> survive skip_special_tokens (docs/architecture.md#tokenizer-and-chat-format), BOS does not
    assert tok.decode([6, 3, 0], skip_special_tokens=True) == "<think><｜System｜>"


@pytest.mark.parametrize("fake_quant", [False, True])
def test_drafter_training_forward_is_the_inference_draft(fake_quant):
    from flashserve.model.loader import load_model
    from flashserve.train.drafter import draft_logits

    model = load_model("tiny-v41", with_mtp=True)
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    T = cfg.sliding_window + 7
    ids = torch.randint(17, cfg.vocab_size - 1, (3, T), generator=g)
    with torch.no_grad():
        out = model(ids, capture=cfg.dspark_target_layer_ids, fake_quant=fake_quant)
        positions = torch.arange(T)[None].expand(3, -1)
        first = torch.randint(17, cfg.vocab_size - 1, (3,), generator=g)
        ref = model.mtp.draft(model, out.features, positions, first, fake_quant=fake_quant)
        prev = torch.cat([first[:, None], ref.tokens[:, :-1]], dim=1)  # draft's own greedy chain
        logits, conf, _ = draft_logits(model, out.features, positions, first, prev, fake_quant=fake_quant)
    assert torch.equal(logits.argmax(-1), ref.tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.sigmoid(conf), ref.confidence, rtol=1e-5, atol=1e-6)


def test_anchor_batch_rows():
    from flashserve.train.drafter import anchor_batch

    B, S, W, k, D = 2, 30, 8, 5, 4
    ids = torch.arange(B * S).view(B, S)
    feats = {7: torch.arange(B * S, dtype=torch.float32).view(B, S, 1).expand(B, S, D)}
    anchors = torch.tensor([[7, 20], [10, 24]])
    f, pos, first, prev, rows = anchor_batch(feats, ids, anchors, W, k)
    assert pos[1].tolist() == list(range(13, 21)) and f[7][1, :, 0].tolist() == list(range(13, 21))
    assert first.tolist() == [8, 21, 41, 55]
    assert prev[2].tolist() == [30 + 11 + i for i in range(k)]
    assert rows[3].tolist() == [30 + 25 + i for i in range(k)]


def test_line_prompts_end_where_a_line_of_code_ends():
    from flashserve.train.selfgen import line_prompts
    from flashserve.train.tokenizer import train_tokenizer

    body = "".join(f"    x{i} = compute({i})\n" for i in range(30))
    texts = [f"import os\n\n\ndef f{j}(a, b):\n{body}\nclass C{j}:\n    def m(self):\n{body}" for j in range(3)]
    tok = train_tokenizer(texts, 300)
    g = torch.Generator().manual_seed(0)
    prompts = line_prompts(texts, tok, 6, 24, g, def_fraction=0.5)
    assert len(prompts) == 6 and all(len(p) == 24 for p in prompts)
    lines = [tok.decode(p).splitlines(keepends=True)[-1] for p in prompts]
    assert all(line.endswith("\n") and line.strip() for line in lines)
    assert sum(line.lstrip().startswith("def ") for line in lines) >= 3  # half after a def line
    with pytest.raises(ValueError, match="no line of code"):
        line_prompts(["x = 1\n"], tok, 2, 24, g)
