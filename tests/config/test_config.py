"""Config parsing (released, composite V4.1, transformers-style V4), validation errors and arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flashserve.config import ConfigError, config_from_dict, load_config, model_arithmetic, preset_json
from flashserve.config.engram_primes import engram_primes


def test_v41_flash_arithmetic_matches_published_figures():
    a = model_arithmetic(load_config("deepseek-v41-flash"))
    assert a.kv_bytes_per_token == 890
    assert round(a.params_total / 1e9, 1) == 551.9
    assert round(a.params_all / 1e9, 1) == 763.2
    assert round(a.params_active_prefill / 1e9, 1) == 7.9
    assert round(a.params_active_decode / 1e9, 1) == 16.1
    assert round(a.by_part["engram_table"] / 1e9, 1) == 196.6
    assert round(a.by_part["dspark"] / 1e9, 1) == 14.2
    assert (a.kv.main, a.kv.index) == (288, 68)


def test_v4_flash_arithmetic():
    a = model_arithmetic(load_config("deepseek-v4-flash"))
    assert round(a.params_total / 1e9) == 284
    assert round(a.params_active_decode / 1e9) == 13
    assert 3400 < a.kv_bytes_per_token < 3600  # "≈3.5 KB" with FP8 rows (docs/architecture.md#deepseek-v4-for-contrast)


def test_engram_primes_reproduce_released_table_sizes():
    primes = engram_primes(2, 4, 8, 16_000_000)
    assert primes[0][0] == 16000057 and primes[0][7] == 16000183 and primes[0][8] == 16000189
    assert primes[1][0] == 16000477 and primes[1][-1] == 16000889
    assert [sum(p) for p in primes] == list(load_config("deepseek-v41-flash").engram_num_embeddings)


def test_v41_roles_from_config_lists():
    cfg = load_config("deepseek-v41-flash")
    roles = [cfg.layer_role(i) for i in range(40)]
    assert roles[:2] == ["swa", "swa"]
    assert [i for i, r in enumerate(roles) if r == "full"] == [2, 8, 14, 20]
    assert [i for i, r in enumerate(roles) if r == "reindex"] == [24, 28, 32, 36]
    assert cfg.kv_source(19) == 14 and cfg.kv_source(39) == 20 and cfg.index_source(27) == 24
    assert cfg.decoder_start == 20
    # the indexers of 2, 8 and 14 select from their own ratio-2 caches; those of 20-36 from layer 20's ratio-1 cache
    assert [cfg.compress_ratios[i] for i in (2, 8, 14, 20)] == [2, 2, 2, 1] and cfg.indexed_ratios() == (1, 2)


def test_v4_indexers_select_from_csa_caches_only():
    """V4's CSA layers (ratio 4) pick top-k entries; its HCA layers (ratio 128) attend to every entry."""
    cfg = load_config("deepseek-v4-flash")
    assert set(cfg.compress_ratios) == {0, 4, 128} and cfg.indexed_ratios() == (4,)


def test_transformers_style_v4_config_is_read():
    data = preset_json("tiny-v4")
    ratios = data.pop("compress_ratios")
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    data["layer_types"] = [kinds[r] for r in ratios]
    data["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    data["mlp_layer_types"] = ["hash_moe", "hash_moe"] + ["moe"] * (len(ratios) - 2)
    data.pop("num_hash_layers")
    assert config_from_dict(data) == load_config("tiny-v4")


def test_optional_parts_may_be_absent():
    data = preset_json("tiny-v41")
    text = data["text_config"]
    text.update(engram_layer_ids=[], engram_num_embeddings=[], num_nextn_predict_layers=0,
                dspark_target_layer_ids=[], compress_ratios=text["compress_ratios"][:10])
    data.pop("vision_config", None)
    cfg = config_from_dict(data)
    assert cfg.engram_layer_ids == () and cfg.num_nextn_predict_layers == 0


@pytest.mark.parametrize("mutate, field", [
    (lambda t: t.update(compress_ratios=[0, 0, 3] + [2] * 7), "compress_ratios"),
    (lambda t: t.update(kv_source_layer_ids=[3, 4, 6]), "kv_source_layer_ids"),
    (lambda t: t.update(index_source_layer_ids=[4, 6, 8]), "index_source_layer_ids"),
    (lambda t: t.update(o_groups=3), "o_groups"),
    (lambda t: t.update(num_experts_per_tok=99), "num_experts_per_tok"),
    (lambda t: t.update(engram_num_embeddings=[5]), "engram_num_embeddings"),
    (lambda t: t.update(mystery_width=7), "mystery_width"),
    (lambda t: t.update(hidden_size="64"), "hidden_size"),
    (lambda t: t.pop("vocab_size"), "vocab_size"),
    (lambda t: t.update(scoring_func="softmax"), "scoring_func"),
    (lambda t: t.update(candidate_source_layer_id=7), "candidate_source_layer_id"),
])
def test_inconsistent_or_unknown_fields_are_named(mutate, field):
    data = preset_json("tiny-v41")
    mutate(data["text_config"])
    with pytest.raises(ConfigError, match=field):
        config_from_dict(data)


def test_unknown_model_type_and_bad_json_file(tmp_path):
    with pytest.raises(ConfigError, match="model_type"):
        config_from_dict({"model_type": "llama"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_info_command_prints_json():
    out = subprocess.run([sys.executable, "-m", "flashserve", "info", "deepseek-v41-flash", "--json"],
                         capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert data["kv_bytes_per_token"] == 890
    assert {"params_total", "params_active_prefill", "params_active_decode"} <= set(data)
    bad = subprocess.run([sys.executable, "-m", "flashserve", "info", "no-such-model"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no-such-model" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("mutate, field", [
    (lambda t: t.update(engram_num_embeddings=[100, 200]), "engram_num_embeddings"),
    (lambda t: t.update(engram_layer_ids=[1, 7]), "engram_layer_ids"),
    (lambda t: t.update(kv_source_layer_ids=[2, 4, 6, 8], index_source_layer_ids=[2, 4, 6, 8]), "kv_source_layer_ids"),
    (lambda t: t.update(tie_word_embeddings=True), "tie_word_embeddings"),
    (lambda t: t.update(dspark_block_size=0), "dspark_block_size"),
])
def test_structural_contradictions_are_named(mutate, field):
    data = preset_json("tiny-v41")
    mutate(data["text_config"])
    with pytest.raises(ConfigError, match=field):
        config_from_dict(data)


def test_image_token_outside_vocab_is_named():
    data = preset_json("tiny-v41")
    data["image_token_id"] = 10_000
    with pytest.raises(ConfigError, match="image_token_id"):
        config_from_dict(data)


@pytest.mark.parametrize("args, needle", [
    (["generate", "tiny-v41", ""], "empty prompt"),
    (["generate", "deepseek-v41-flash", "hi"], "arithmetic and planning only"),
    (["generate", "tiny-v41", "hi", "--dtype", "float7"], "float7"),
    (["serve", "/no/such/checkpoint"], "/no/such/checkpoint"),
])
def test_cli_reports_user_errors_without_traceback(args, needle):
    out = subprocess.run([sys.executable, "-m", "flashserve", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert needle in out.stderr and "Traceback" not in out.stderr


def test_info_plan_and_a_refused_generate_do_not_import_torch():
    code = ("import sys, contextlib, io\nfrom flashserve.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    assert main(['generate', 'tiny-v41', '']) == 2\n"
            "    assert main(['info', 'deepseek-v41-flash', '--json']) == 0\n"
            "    assert main(['plan', '--model', 'deepseek-v41-flash', '--hardware', 'b200', '--gpus', '8', "
            "'--concurrency', '1', '--context', '4096', '--json']) == 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
