"""llama.cpp as a peer of ``python -m flashserve.bench.engine``, through llama-cpp-python's low-level API.

The benchmark writes its checkpoint in DeepSeek's released layout with the routed experts on the MXFP4 grid
(the only expert format llama.cpp's converter reads), converts it with the converter of the installed
llama-cpp-python's own source (the wheel does not ship it: it is fetched once with ``pip download``, or taken
from ``FLASHSERVE_LLAMA_CPP_SRC``), and times decoding in a fresh process per block::

    python -m flashserve.bench.llamacpp decode MODEL.gguf --batch 16 [--kv f32|f16] [--flash-attn off|auto]

Each of B sequences gets its own sequence id; every step is one ``llama_decode`` of B tokens (greedy), so the
figure is decode-only tokens/s, as the engine benchmark reports. GGUFs: ``f32`` (experts dequantized: the
same numbers as flashserve's float weights), ``mxfp4`` (the converter's default: float dense, MXFP4 experts),
``q8_0`` (from the f32 one with ``llama_model_quantize``). When llama-cpp-python is missing, :func:`unavailable`
says why and the engine benchmark skips this peer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

SRC_ENV = "FLASHSERVE_LLAMA_CPP_SRC"
FORMATS = ("f32", "mxfp4", "q8_0")


def _version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.__version__


def converter_dir() -> Path | None:
    """The vendored llama.cpp folder holding ``convert_hf_to_gguf.py`` for the installed llama-cpp-python."""
    version = _version()
    if os.environ.get(SRC_ENV):
        path = Path(os.environ[SRC_ENV])
        return path if (path / "convert_hf_to_gguf.py").is_file() else None
    cache = Path.home() / ".cache" / "flashserve" / f"llama_cpp_python-{version}"
    src = cache / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                            f"llama-cpp-python=={version}", "-d", tmp], check=True, capture_output=True, timeout=900)
            archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(archive) as tar:
                tar.extractall(cache.parent, filter="data")
        except (subprocess.SubprocessError, StopIteration, OSError, tarfile.TarError):
            return None
    return src if (src / "convert_hf_to_gguf.py").is_file() else None


def unavailable() -> str | None:
    """Why the llama.cpp peer cannot run here, or None when it can."""
    if _version() is None:
        return "llama-cpp-python is not installed (pip install llama-cpp-python: it compiles llama.cpp, ~15 min on 2 cores)"
    if converter_dir() is None:
        return (f"llama.cpp's converter for llama-cpp-python {_version()} was not found: set {SRC_ENV} to its "
                "vendor/llama.cpp folder, or allow `pip download` of its source")
    return None


# --------------------------------------------------------------------------- checkpoint and conversion


def write_peer_checkpoint(model, path: Path) -> None:
    """``model``'s weights in the released layout: routed experts as MXFP4 + scale, everything else float32
    (int64 hash tables). Load it back with ``quantization="float"`` for the same numbers as the f32 GGUF."""
    from safetensors.torch import save_file

    from ..config.checkpoint_layout import FP4, INT, checkpoint_layout
    from ..config.serialize import config_to_json
    from ..model import quant

    path.mkdir(parents=True, exist_ok=True)
    dest = model.checkpoint_tensors()
    tensors: dict[str, torch.Tensor] = {}
    for spec in checkpoint_layout(model.cfg, vision=False):
        if spec.part in ("mtp", "dspark") or spec.name not in dest:
            continue
        t = dest[spec.name].detach()
        if spec.kind == FP4:
            w, s = quant.quantize_mxfp4(t)
            tensors[spec.name], tensors[spec.name[: -len(".weight")] + ".scale"] = w, s
        else:
            tensors[spec.name] = t.to(torch.int64 if spec.kind == INT else torch.float32).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = config_to_json(model.cfg)
    config.pop("quantization_config", None)
    config.update(dtype="float32", num_nextn_predict_layers=0)
    (path / "config.json").write_text(json.dumps(config, indent=1))


def _convert_in_process(folder: Path, out: Path, experts: str) -> None:
    """Run llama.cpp's converter on ``folder`` (this process only: it patches the converter's classes)."""
    import numpy as np

    src = converter_dir()
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    import gguf
    import convert_hf_to_gguf as conv
    from conversion.deepseek import DeepseekV4Model

    cfg = json.loads((folder / "config.json").read_text())

    def set_vocab(self) -> None:  # token ids go in directly: a byte-level vocabulary of the right size
        space, t = _byte_char(ord(" ")), _byte_char(ord("t"))
        tokens = [_byte_char(b) for b in range(256)] + [space + t]  # one merge: llama.cpp wants a merge list
        tokens += [f"<t{i}>" for i in range(len(tokens), cfg["vocab_size"])]
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre("gpt-2")
        self.gguf_writer.add_token_list(tokens)
        self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
        self.gguf_writer.add_token_merges([f"{space} {t}"])
        self.gguf_writer.add_bos_token_id(cfg["bos_token_id"])
        self.gguf_writer.add_eos_token_id(cfg["eos_token_id"])
        self.gguf_writer.add_pad_token_id(cfg["pad_token_id"])

    def float_experts(self, bid: int, proj: str, key) -> list[str]:
        from conversion.base import LazyTorchTensor

        from ..model import quant

        names, mats = [], []
        for e in range(self.hparams["n_routed_experts"]):
            w, s = (f"layers.{bid}.ffn.experts.{e}.{proj}.{k}" for k in ("weight", "scale"))
            weight = LazyTorchTensor.to_eager(self.model_tensors[w]())
            scale = LazyTorchTensor.to_eager(self.model_tensors[s]())
            mats.append(quant.dequantize_mxfp4(weight, scale, torch.float32))
            names += [w, s]
        data = np.ascontiguousarray(torch.stack(mats).numpy())
        self.gguf_writer.add_tensor(self.format_tensor_name(key, bid), data)
        return names

    DeepseekV4Model.set_vocab = set_vocab
    if experts == "f32":
        DeepseekV4Model._write_mxfp4_expert_tensor = float_experts
    sys.argv = ["convert_hf_to_gguf.py", str(folder), "--outfile", str(out), "--outtype", "f32"]
    conv.main()


def _byte_char(b: int) -> str:
    """GPT-2's printable character for byte ``b`` (what byte-level BPE vocabularies store)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def make_gguf(folder: Path, out_dir: Path, fmt: str, threads: int) -> Path:
    """The GGUF of ``folder`` in ``fmt`` (one of :data:`FORMATS`), converted in a child process."""
    out = out_dir / f"peer-{fmt}.gguf"
    if out.is_file():
        return out
    if fmt == "q8_0":
        f32 = make_gguf(folder, out_dir, "f32", threads)
        _run(["quantize", str(f32), str(out), "--threads", str(threads)])
    else:
        _run(["convert", str(folder), str(out), "--experts", "f32" if fmt == "f32" else "mxfp4"])
    return out


def make_gguf_file(folder: Path, out: Path) -> None:
    """The converter's GGUF of a checkpoint in the released layout (its MXFP4 experts kept), in a child process."""
    _run(["convert", str(folder), str(out), "--experts", "mxfp4"])


def _quantize_q8_0(src: Path, out: Path, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")


def _run(args: list[str]) -> str:
    run = subprocess.run([sys.executable, "-m", "flashserve.bench.llamacpp", *args], capture_output=True,
                         text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"llama.cpp {args[0]} failed:\n{run.stderr[-3000:]}")
    return run.stdout


# --------------------------------------------------------------------------- decoding


class _Session:
    """One llama.cpp model and context with ``n_seq`` sequences (greedy, token ids in, logits out)."""

    def __init__(self, gguf: Path, n_seq: int, n_ctx: int, threads: int, kv: str, flash_attn: str):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.use_extra_bufts = False  # Q8_0 GGUFs of this model crash with the AMX extra buffers on
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max = n_ctx * n_seq, n_seq
        cp.n_batch = cp.n_ubatch = max(512, n_seq)
        cp.n_threads = cp.n_threads_batch = threads
        if kv == "f32":
            cp.type_k = cp.type_v = lc.GGML_TYPE_F32
        cp.flash_attn_type = {"off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED, "auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO}[flash_attn]
        cp.kv_unified = False
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(max(512, n_seq), 0, 1)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of (token, position, sequence, wants logits) rows."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def logits(self, row: int):
        import numpy as np

        ptr = self.lc.llama_get_logits_ith(self.ctx, row)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()


def decode_rate(gguf: Path, prompts: list[list[int]], new: int, threads: int, kv: str, flash_attn: str) -> float:
    """Decode-only tokens/s of greedy generation for every prompt at once (one sequence id each)."""
    n = len(prompts)
    s = _Session(gguf, n, len(prompts[0]) + new + 8, threads, kv, flash_attn)
    nxt = []
    for seq, p in enumerate(prompts):
        for a in range(0, len(p), 512):
            chunk = p[a:a + 512]
            s.decode([(t, a + i, seq, a + i == len(p) - 1) for i, t in enumerate(chunk)])
        nxt.append(int(s.logits(len(p) - 1 - (len(p) - 1) // 512 * 512).argmax()))
    pos = len(prompts[0])
    t0 = None
    for step in range(new - 1):
        if step == 1:
            t0 = time.perf_counter()  # after the first decode step (its graph is built on first use)
        s.decode([(tok, pos + step, seq, True) for seq, tok in enumerate(nxt)])
        nxt = [int(s.logits(i).argmax()) for i in range(n)]
    return n * (new - 2) / (time.perf_counter() - t0)


def prompt_logits(gguf: Path, ids: list[int], threads: int):
    """Logits of the last prompt position, F32 KV and flash attention off (the matched configuration)."""
    s = _Session(gguf, 1, len(ids) + 8, threads, "f32", "off")
    s.decode([(t, i, 0, i == len(ids) - 1) for i, t in enumerate(ids)])
    return s.logits(len(ids) - 1)


# --------------------------------------------------------------------------- child-process entry points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="llama.cpp peer of the engine benchmark (child processes)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("folder", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--experts", choices=("f32", "mxfp4"), default="mxfp4")
    q = sub.add_parser("quantize")
    q.add_argument("src", type=Path)
    q.add_argument("out", type=Path)
    q.add_argument("--threads", type=int, default=2)
    d = sub.add_parser("decode")
    d.add_argument("gguf", type=Path)
    d.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    d.add_argument("--new", type=int, default=32)
    d.add_argument("--threads", type=int, default=2)
    d.add_argument("--kv", choices=("f32", "f16"), default="f16")
    d.add_argument("--flash-attn", choices=("off", "auto"), default="auto")
    g = sub.add_parser("logits")
    g.add_argument("gguf", type=Path)
    g.add_argument("--ids", required=True, help="JSON list of token ids")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.cmd == "convert":
        _convert_in_process(args.folder, args.out, args.experts)
    elif args.cmd == "quantize":
        _quantize_q8_0(args.src, args.out, args.threads)
    elif args.cmd == "decode":
        rate = decode_rate(args.gguf, json.loads(args.prompts), args.new, args.threads, args.kv, args.flash_attn)
        print(json.dumps({"decode_tok_s": rate}))
    else:
        import numpy as np

        np.save(args.out, prompt_logits(args.gguf, json.loads(args.ids), args.threads))
    return 0


class Peer:
    """The parent's handle: GGUFs made once, each measurement in a fresh process."""

    def __init__(self, model, work: Path, threads: int):
        self.work, self.threads = work, threads
        self.folder = work / "peer-checkpoint"
        write_peer_checkpoint(model, self.folder)

    def gguf(self, fmt: str) -> Path:
        return make_gguf(self.folder, self.work, fmt, self.threads)

    def decode_rate(self, fmt: str, prompts: list[list[int]], new: int, kv: str, flash_attn: str) -> float:
        out = _run(["decode", str(self.gguf(fmt)), "--prompts", json.dumps(prompts), "--new", str(new),
                    "--threads", str(self.threads), "--kv", kv, "--flash-attn", flash_attn])
        return json.loads(out.strip().splitlines()[-1])["decode_tok_s"]

    def logits(self, fmt: str, ids: list[int]) -> torch.Tensor:
        import numpy as np

        path = self.work / "logits.npy"
        _run(["logits", str(self.gguf(fmt)), "--ids", json.dumps(ids), "--out", str(path),
              "--threads", str(self.threads)])
        return torch.from_numpy(np.load(path))


if __name__ == "__main__":
    raise SystemExit(main())


# --------------------------------------------------------------------------- rows of the engine benchmark

# name -> (label, flashserve's weights, llama.cpp's GGUF, its KV type, its flash attention). Q8_0 is compared
# with both 8-bit formats: int8 (weight-only) and w8a8 (8-bit activations too, as Q8_0's own products); llama.cpp's
# defaults with the checkpoint as released (exact) and with w4a8 (its MXFP4 experts' products on 8-bit activations,
# as llama.cpp's own).
ROWS = {"f32": ("F32 weights, F32 KV, flash-attn off", "float", "f32", "f32", "off"),
        "defaults": ("defaults: MXFP4 experts, F16 KV, flash-attn auto", None, "mxfp4", "f16", "auto"),
        "int8": ("8-bit: int8 vs Q8_0 (F16 KV)", "int8", "q8_0", "f16", "auto"),
        "w8a8": ("8-bit: w8a8 vs Q8_0 (F16 KV)", "w8a8", "q8_0", "f16", "auto"),
        "w4a8": ("w4a8 (experts on 8-bit activations) vs llama.cpp's defaults", "w4a8", "mxfp4", "f16", "auto")}


def compare(model, work: Path, table, *, threads: int, repeats: int, batches: tuple[int, ...], prompt_len: int,
            new: int, engine_kw: dict, rows: tuple[str, ...] = tuple(ROWS)) -> None:
    """llama.cpp's rows of the engine benchmark: the logits agreement of the matched configuration, then
    decode-only tokens/s per format and batch, flashserve in this process and llama.cpp in a fresh one per
    block, alternating, medians of ``repeats``."""
    import statistics

    from ..model.loader import load_model
    from .workload import engine_for, fs_run, prompts

    peer = Peer(model, work, threads)
    load = dict(fake_quant=False, with_mtp=False, dtype=model.dtype)
    ours = {q: load_model(peer.folder, quantization=q, **load) for q in {"float"} | {ROWS[r][1] for r in rows}}
    ids = prompts(1, 40, 5)[0]
    with torch.no_grad():
        want = ours["float"](torch.tensor([ids])).logits[0, -1].float()
    got = peer.logits("f32", ids)
    rel = float((got - want).abs().max() / want.abs().max())
    print(f"llama.cpp (F32 GGUF, F32 KV, flash-attn off) vs flashserve float logits: max rel diff {rel:.2e}",
          flush=True)
    for label, q, fmt, kv, fa in (ROWS[r] for r in rows):
        engine = engine_for(ours[q], str(peer.folder), max_num_seqs=max(batches), **engine_kw)
        for b in batches:
            batch = prompts(b, prompt_len, 40 + b)
            fs_run(engine, batch[:2], 2)
            a, c = [], []
            for _ in range(repeats):
                _, dec = fs_run(engine, batch, new)
                a.append(b * (new - 1) / dec)
                c.append(peer.decode_rate(fmt, batch, new, kv, fa))
            # goals: batch 1 at 1.0x in each matched format, 16 concurrent at 2x llama.cpp's defaults
            goal = 1.0 if b == 1 and q is not None else (2.0 if b == 16 and q is None else None)
            table(f"{label}, batch {b}", statistics.median(a), statistics.median(c), goal=goal, vs="llama.cpp")
