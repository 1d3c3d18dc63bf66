"""config_to_json: the released config.json of a ModelConfig, parsed back to the same config."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashserve.config import PRESET_JSON, config_from_dict, preset_config
from flashserve.config.serialize import config_to_json


@pytest.mark.parametrize("name", sorted(PRESET_JSON))
def test_roundtrip_every_preset(name: str) -> None:
    cfg = preset_config(name)
    data = json.loads(json.dumps(config_to_json(cfg)))  # must survive JSON as-is
    assert config_from_dict(data) == cfg


def test_v41_flash_matches_released_file() -> None:
    """Same keys and values as the reconstructed release (docs/architecture.md#configuration), which also pins dtype and
    the attention_bias / attention_dropout text keys the preset leaves out."""
    out = config_to_json(preset_config("deepseek-v41-flash"))
    want = json.loads(json.dumps(PRESET_JSON["deepseek-v41-flash"]))
    assert out.pop("dtype") == "bfloat16"
    text = out["text_config"]
    assert text.pop("attention_bias") is False and text.pop("attention_dropout") == 0.0
    assert out == want
    assert text["compress_ratios"][-3:] == [0, 0, 0] and len(text["compress_ratios"]) == 43


def test_v41_composite_layout() -> None:
    out = config_to_json(preset_config("tiny-v41"))
    assert out["model_type"] == "deepseek_v41"
    assert {"bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"} <= set(out)
    assert out["quantization_config"] == {"activation_scheme": "dynamic", "expert_dtype": "fp4",
                                          "quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}
    text = out["text_config"]
    assert text["compress_ratios"] == [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0]
    assert text["engram_pad_token_id"] == 2 and "num_hash_layers" not in text
    assert out["vision_config"]["hidden_size"] == 32 and out["vision_config"]["max_image_tokens"] == 1024
    assert preset_config("tiny-v41") == config_from_dict(out)
    assert config_to_json(preset_config("deepseek-v41-flash"))["vision_config"]["max_wh_ratio"] is None


def test_v4_legacy_keys() -> None:
    out = config_to_json(preset_config("deepseek-v4-flash"))
    assert out["model_type"] == "deepseek_v4" and "text_config" not in out
    assert out["compress_ratios"] == [0, 0] + [4, 128] * 20 + [4]
    assert out["num_hash_layers"] == 3 and "layer_types" not in out
    assert out["rope_scaling"] == {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                   "beta_fast": 32, "beta_slow": 1}
    assert out["quantization_config"]["weight_block_size"] == [128, 128]
    assert "expert_dtype" not in out["quantization_config"]


def test_v4_falls_back_to_transformers_keys() -> None:
    """Non-prefix hash layers or CSA/HCA rates other than 4/128 cannot be written with the legacy keys."""
    cfg = preset_config("tiny-v4")
    odd = dataclasses.replace(cfg, hash_layer_ids=(1, 3), compress_rate_hca=16,
                              compress_ratios=tuple(16 if r == 128 else r for r in cfg.compress_ratios))
    out = config_to_json(odd)
    assert "compress_ratios" not in out and "num_hash_layers" not in out
    assert out["compress_rates"] == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    assert out["layer_types"][2:4] == ["compressed_sparse_attention", "heavily_compressed_attention"]
    assert out["mlp_layer_types"][:4] == ["moe", "hash_moe", "moe", "hash_moe"]
    assert config_from_dict(out) == odd
    only_hash = dataclasses.replace(cfg, hash_layer_ids=(0, 2))  # rates legacy, hash layers not a prefix
    assert "mlp_layer_types" in config_to_json(only_hash)
    assert config_from_dict(config_to_json(only_hash)) == only_hash


def test_non_default_fields_roundtrip() -> None:
    cfg = dataclasses.replace(preset_config("tiny-v41"), gate_temp=0.5, pad_token_id=None, rope_scaling=None)
    out = config_to_json(cfg)
    assert out["text_config"]["gate_temp"] == 0.5 and "rope_scaling" not in out["text_config"]
    assert config_from_dict(json.loads(json.dumps(out))) == cfg


def test_serialize_does_not_import_torch() -> None:
    code = "import sys, flashserve.config.serialize; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
