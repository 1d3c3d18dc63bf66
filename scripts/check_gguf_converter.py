"""Check flashserve's GGUF loading against llama.cpp's own converter, where the converter is available.

The test suite writes its GGUFs with the ``gguf`` package (``tests/model/gguf_writer.py``), following the
converter's names and metadata; this script shows that those files are what the converter writes, and that what
the converter writes loads as the checkpoint it was made from::

    FLASHSERVE_LLAMA_CPP_SRC=.../vendor/llama.cpp python scripts/check_gguf_converter.py [--work DIR]

(the folder of ``convert_hf_to_gguf.py`` in llama-cpp-python's source: ``pip download --no-binary :all: --no-deps
llama-cpp-python==0.3.36`` and unpack; or an installed llama-cpp-python, whose source is fetched once.)

Two conversions of the tiny-v4 preset's weights: (1) a checkpoint with float32 dense weights and MXFP4 experts
(the converter keeps F32, packs the experts as MXFP4), (2) the released storage (block-FP8 dense weights with
128-blocks, which the converter turns into Q8_0, BF16 matrices, MXFP4 experts). For each it prints the metadata
and tensors where the converter's file and the test writer's differ (none expected besides the file name, the
size label and the chat template), whether flashserve's config and tokenizer from the converter's file equal the
checkpoint's, and the logits of ``load_model`` on the GGUF against ``load_model`` on the checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "model"))

_CONVERT = """
import sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import convert_hf_to_gguf as conv
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # a home-made byte-level BPE: GPT-2's regex
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", "f32"]
conv.main()
"""
_IGNORED_KEYS = ("general.name", "general.size_label", "tokenizer.chat_template")


def _tokenizer_files(folder: Path) -> None:
    from flashserve.engine.tokenizer import BOS, EOS, PAD, tiny_tokenizer_json

    (folder / "tokenizer.json").write_text(tiny_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "tokenizer_class": "PreTrainedTokenizerFast"}))


def _convert(src: Path, folder: Path, out: Path) -> None:
    run = subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(folder), str(out)], capture_output=True,
                         text=True, timeout=1800)
    if run.returncode != 0:
        raise SystemExit(f"the converter failed:\n{run.stderr[-3000:]}")


def _compare_files(theirs: Path, ours: Path) -> int:
    import gguf
    import numpy as np

    a, b = gguf.GGUFReader(theirs), gguf.GGUFReader(ours)
    ka = {k: f.contents() for k, f in a.fields.items() if not k.startswith("GGUF.") and k not in _IGNORED_KEYS}
    kb = {k: f.contents() for k, f in b.fields.items() if not k.startswith("GGUF.") and k not in _IGNORED_KEYS}
    problems = [f"metadata {k}: converter {ka.get(k)!r:.80} vs test writer {kb.get(k)!r:.80}"
                for k in sorted(set(ka) | set(kb)) if ka.get(k) != kb.get(k)]
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    for name in sorted(set(ta) | set(tb)):
        x, y = ta.get(name), tb.get(name)
        if x is None or y is None:
            problems.append(f"tensor {name}: only in the {'test writer' if x is None else 'converter'}'s file")
        elif x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            problems.append(f"tensor {name}: converter {x.tensor_type.name} {list(x.shape)} vs test writer "
                            f"{y.tensor_type.name} {list(y.shape)}")
        elif not np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)):
            problems.append(f"tensor {name}: same type and shape, different bytes")
    print(f"  {len(ta)} tensors, {len(ka)} metadata keys compared: "
          + ("identical" if not problems else f"{len(problems)} differences"))
    for p in problems[:30]:
        print("   ", p)
    return len(problems)


def _check_loading(folder: Path, gguf_file: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    from flashserve.config import load_config
    from flashserve.engine.tokenizer import load_tokenizer
    from flashserve.model.loader import load_model

    same = dataclasses.asdict(load_config(gguf_file)) == dataclasses.asdict(load_config(folder))
    print(f"  config from the GGUF's metadata equals the checkpoint's config.json: {same}")
    text = "<｜begin▁of▁sentence｜><｜User｜>The quick brown fox 123 <think>x</think><｜Assistant｜>ok<｜end▁of▁sentence｜>"
    ours = load_tokenizer(gguf_file).encode(text)
    ref = HFTokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    print(f"  tokenizer from the GGUF encodes as tokenizer.json: {ours == ref}")
    ids = torch.randint(16, 500, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = load_model(folder, with_mtp=False, fake_quant=False)(ids).logits
        got = load_model(gguf_file, fake_quant=False)(ids).logits
    print(f"  logits, load_model(GGUF) vs load_model(checkpoint): bit-equal {torch.equal(got, want)}, max abs diff "
          f"{(got - want).abs().max().item():.3g} (logit scale {want.abs().max().item():.3g}); last position "
          f"{(got[0, -1] - want[0, -1]).abs().max().item():.3g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=None, help="folder for the checkpoints and GGUFs (a temporary one)")
    args = ap.parse_args()
    from flashserve.bench.llamacpp import converter_dir, write_peer_checkpoint
    from flashserve.config import load_config
    from flashserve.config.model_config import QuantizationConfig
    from flashserve.model.checkpoint import save_checkpoint
    from flashserve.model.loader import load_model
    from gguf_writer import write_gguf

    src = converter_dir()
    if src is None:
        print("llama.cpp's converter was not found: set FLASHSERVE_LLAMA_CPP_SRC to the vendor/llama.cpp folder of "
              "llama-cpp-python's source")
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="gguf-check-"))
    model = load_model("tiny-v4", with_mtp=False)
    failures = 0

    print("(1) float32 dense weights, MXFP4 experts")
    f32 = work / "f32"
    write_peer_checkpoint(model, f32)
    _tokenizer_files(f32)
    _convert(src, f32, work / "f32-converter.gguf")
    write_gguf(load_model(f32, with_mtp=False, mmap=False), f32, work / "f32-writer.gguf")
    failures += _compare_files(work / "f32-converter.gguf", work / "f32-writer.gguf")
    _check_loading(f32, work / "f32-converter.gguf")

    print("(2) released storage: block-FP8 dense weights (Q8_0 in the GGUF), BF16 matrices, MXFP4 experts")
    rel = work / "released"
    cfg = dataclasses.replace(load_config("tiny-v4"), quantization=QuantizationConfig(weight_block_size=128),
                              num_nextn_predict_layers=0)
    save_checkpoint(model.checkpoint_tensors(), rel, cfg)
    _tokenizer_files(rel)
    _convert(src, rel, work / "released-converter.gguf")
    stored = load_model(rel, with_mtp=False, mmap=False)  # as stored: MXFP4 experts' bytes, FP8 decoded by the writer
    write_gguf(stored, rel, work / "released-writer.gguf", dense="Q8_0")
    failures += _compare_files(work / "released-converter.gguf", work / "released-writer.gguf")
    _check_loading(rel, work / "released-converter.gguf")
    print(f"files in {work}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
