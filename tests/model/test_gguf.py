"""DeepSeek-V4 GGUFs (llama.cpp's ``deepseek4`` layout) loaded as stored: config, tokenizer, weights, errors.

The GGUFs are written by ``gguf_writer.py`` as llama.cpp's converter writes them from the tiny-v4 weights (checked
byte for byte against the converter by ``scripts/check_gguf_converter.py``), next to the checkpoint folder they
would be converted from."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from flashserve.config import load_config
from flashserve.engine.tokenizer import load_tokenizer, tiny_tokenizer_json
from flashserve.gguf.file import GGUFError
from flashserve.model.loader import load_model

from gguf_writer import rounded_like, write_gguf, write_tiny_gguf

TEXT = ("<｜begin▁of▁sentence｜><｜User｜>The quick brown fox, 12345 times! 日本語 x<<y>> \n\n  def f(): "
        "<think>hmm</think><｜Assistant｜>Hello<｜end▁of▁sentence｜><｜System｜>ok")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the tiny-v4 model, its checkpoint folder: float32 dense weights + MXFP4 experts + tokenizer.json, the GGUF the
    converter makes of that folder)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf"))


def _ids(n: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(16, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_f32_mxfp4_gguf_gives_the_checkpoints_logits_bit_for_bit(tiny):
    from flashserve.model.mapped import weights_held
    from flashserve.model.moe import MoE
    from flashserve.model.packed import PackedExperts

    _, folder, path = tiny
    want = _logits(load_model(folder, with_mtp=False, fake_quant=False), _ids())
    model = load_model(path, fake_quant=False)
    assert torch.equal(_logits(model, _ids()), want)
    experts = [m.experts for m in model.modules() if isinstance(m, MoE)]
    assert len(experts) == 8 and all(isinstance(e, PackedExperts) and e.w1_packed.fmt.name == "mxfp4" for e in experts)
    held = weights_held(model)
    assert held["mapped"] > 0.8 * sum(model.load_report.mapped.values())  # the float tensors lie in the file's map
    assert model.load_report.mapped.get("attention", 0) > 0 and "routed_expert" in model.load_report.copied
    copied = load_model(path, fake_quant=False, mmap=False)
    assert not copied.load_report.mapped and weights_held(copied)["mapped"] == 0
    assert torch.equal(_logits(copied, _ids()), want)


def test_gguf_config_is_the_checkpoints_config(tiny, capsys):
    from flashserve.cli import main

    _, folder, path = tiny
    ours = load_config(path)
    assert ours == load_config(folder)
    preset = dataclasses.asdict(load_config("tiny-v4"))
    differ = {k for k, v in dataclasses.asdict(ours).items() if preset[k] != v}
    assert differ == {"num_nextn_predict_layers", "quantization"}  # no drafter and no FP8 blocks in a GGUF
    assert ours.rms_norm_eps == 1e-6 and ours.hc_eps == 1e-6  # float32 metadata read back as the decimal written
    assert main(["info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert main(["info", str(folder), "--json"]) == 0
    assert info["params_total"] == json.loads(capsys.readouterr().out)["params_total"] > 0
    assert main(["info", str(path), "--memory"]) == 0  # each rank's weights as the GGUF stores them
    assert "weights as stored" in capsys.readouterr().out
    code = ("import sys\nfrom flashserve.config import load_config\n"
            f"assert load_config({str(path)!r}).num_hidden_layers == 8\nassert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)  # the config of a GGUF is torch-free


def test_q8_0_and_bf16_tensors_are_decoded_to_their_values(tiny, tmp_path):
    import gguf

    model, folder, _ = tiny
    path = tmp_path / "q8.gguf"
    write_gguf(model, folder, path, dense="Q8_0")
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {"Q8_0", "BF16", "F32", "MXFP4", "I32"} <= types
    rounded = rounded_like(model)
    ref = load_model(folder, with_mtp=False, fake_quant=False, mmap=False)
    dest = ref.checkpoint_tensors()
    changed = 0
    with torch.no_grad():
        for name, value in rounded.items():
            changed += not torch.equal(dest[name], value)
            dest[name].copy_(value)
    assert changed > len(rounded) // 2  # the rounding is real: the test would see a loader that skipped it
    ours = load_model(path, fake_quant=False)
    assert torch.equal(_logits(ours, _ids()), _logits(ref, _ids()))
    assert ours.load_report.copied.get("attention", 0) > 0  # Q8_0 weights decoded into memory


def test_tokenizer_from_the_gguf_vocabulary_matches_tokenizer_json(tiny):
    _, folder, path = tiny
    ours, ref = load_tokenizer(path, 512), load_tokenizer(folder, 512)
    ids = ref.encode(TEXT)
    assert ours.encode(TEXT) == ids and len(ids) > 20
    assert ours.special_tokens == ref.special_tokens and len(ours.special_tokens) == 17
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert [ours.is_special(i) for i in range(512)] == [ref.is_special(i) for i in range(512)]
    assert (ours.bos_token_id, ours.eos_token_id, ours.vocab_size) == (0, 1, 512)


# DeepSeek-V3's pre-tokenizer as its tokenizer.json states it (llama.cpp's "deepseek-v3")
_DEEPSEEK_V3_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
    {"type": "Split", "pattern": {"Regex": "[一-龥\u3040-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": False},
    {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|"
                                           "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|"
                                           "\\s*[\r\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


def test_deepseek_v3_pre_tokenizer(tiny, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    model, _, _ = tiny
    folder = tmp_path / "ds"
    folder.mkdir()
    spec = json.loads(tiny_tokenizer_json())
    spec["pre_tokenizer"] = _DEEPSEEK_V3_PRE
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    path = tmp_path / "ds.gguf"
    write_gguf(model, folder, path, pre="deepseek-v3")
    text = TEXT + " 1234567 ab,cd 漢字かなカナ x\r\n\ty"
    want = HFTokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    gpt2 = HFTokenizer.from_str(tiny_tokenizer_json()).encode(text, add_special_tokens=False).ids
    assert want != gpt2  # the two pre-tokenizers split this text differently
    assert load_tokenizer(path, 512).encode(text) == want


def test_other_architectures_are_refused_before_loading(tmp_path, capsys):
    import gguf
    import numpy as np

    from flashserve.cli import main

    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for load in (load_config, load_model):
        with pytest.raises(GGUFError, match=r"architecture 'llama' is not supported.*'deepseek4'.*V4\.1 has no GGUF"):
            load(path)
    assert main(["info", str(path)]) == 2
    assert "architecture 'llama'" in capsys.readouterr().err


def _tensor_type_offset(path, name: str) -> int:
    """Byte offset of the ggml type id in the tensor info of ``name`` (GGUF's layout: name length, name, n_dims,
    dims, type)."""
    data = path.read_bytes()
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    return at + 4 + 8 * n_dims


def test_unknown_tensor_type_is_refused_by_name_and_id(tiny, tmp_path):
    _, _, good = tiny
    path = tmp_path / "bad-type.gguf"
    shutil.copy(good, path)
    at = _tensor_type_offset(path, "blk.3.attn_q_a.weight")
    with path.open("r+b") as f:
        f.seek(at)
        assert struct.unpack("<I", f.read(4))[0] == 0  # F32 there
        f.seek(at)
        f.write(struct.pack("<I", 99))
    with pytest.raises(GGUFError, match=r"'blk\.3\.attn_q_a\.weight' has ggml type id 99"):
        load_model(path)


def test_truncated_file_is_refused(tiny, tmp_path):
    _, _, good = tiny
    data = good.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:-5000])
    with pytest.raises(GGUFError, match=r"ends at byte \d+ but the file has \d+ bytes .*truncated"):
        load_model(path)
    path.write_bytes(data[:3000])  # inside the vocabulary
    with pytest.raises(GGUFError, match="cannot read the GGUF header"):
        load_config(path)


def test_split_set_loads_by_its_first_file_and_a_missing_split_is_refused(tiny, tmp_path):
    model, folder, single = tiny
    files = write_gguf(model, folder, tmp_path / "split.gguf", split_max_tensors=100)
    assert [f.name for f in files] == [f"split-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert all(f.is_file() for f in files)
    want = _logits(load_model(single, fake_quant=False), _ids())
    assert torch.equal(_logits(load_model(files[0], fake_quant=False), _ids()), want)
    with pytest.raises(GGUFError, match="open the set by its first file"):
        load_config(files[1])
    files[1].unlink()
    with pytest.raises(GGUFError, match="first of 3 splits, but 1 of them are missing.*split-00002-of-00003.gguf"):
        load_model(files[0])


def test_weights_larger_than_the_available_memory_are_refused_before_loading(tiny, tmp_path, monkeypatch):
    from flashserve.config import ConfigError
    from flashserve.model import mapped

    model, folder, _ = tiny
    path = tmp_path / "q8.gguf"
    write_gguf(model, folder, path, dense="Q8_0")
    monkeypatch.setattr(mapped, "available_memory", lambda: 1 << 20)  # 1 MiB: the MXFP4 experts alone are 0.4 MB
    with pytest.raises(ConfigError, match=r"take [\d.]+ MiB \(tensors of type BF16, Q8_0 decoded to floats\), more "
                                          r"than the 1\.0 MiB available"):
        load_model(path)
    monkeypatch.setattr(mapped, "available_memory", lambda: 64 << 20)
    assert load_model(path).load_report.copied
