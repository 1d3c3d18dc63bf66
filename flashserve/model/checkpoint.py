"""Read and write DeepSeek-V4 / V4.1 checkpoints (safetensors only; nothing is ever unpickled).

Reading: :func:`load_checkpoint` fills caller-owned tensors, keyed by the released names of
:func:`flashserve.config.checkpoint_layout.checkpoint_layout`, one stored tensor (or row chunk) at a time. It understands

* ``released`` — DeepSeek's own names (docs/architecture.md#checkpoint-names): ``embed.weight``,
``layers.N.attn.wq_a.weight`` + ``.scale``
  (block FP8), experts as MXFP4 ``int8`` + ``.scale``, engram tables FP8 + per-row ``.scale``, plain floats;
* ``hf`` — what transformers 5.24 ``DeepseekV4ForCausalLM.save_pretrained`` writes (default
  ``save_original_format=True``): released names behind a ``model.`` prefix except ``head.weight``, plus
  ``model.embed_tokens.weight``, ``model.hc_head.hc_{fn,base,scale}`` and ``attn.norm.weight`` for the
  main KV norm, everything float;
* ``hf-modules`` — transformers' in-memory names (``save_original_format=False``): ``self_attn.q_a_proj``,
  ``mlp.experts.gate_up_proj [E, 2I, D]`` (w1 ‖ w3 fused), ``attn_hc.fn``, ``sinks``, ``position_bias``, ...

Stored values are decoded by their *stored* dtype: F8_E4M3 + scale -> block/row FP8, I8/U8 + scale -> MXFP4,
anything else -> cast. Every mismatch (missing, unexpected, mis-shaped) is collected and raised once as
:class:`CheckpointError`.

Writing: :func:`save_checkpoint` writes ``config.json`` + safetensors shards + ``model.safetensors.index.json``,
quantising by layout kind (or float32 throughout with ``quantize=False``).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flashserve.errors import UserError
from flashserve.config.checkpoint_layout import BF16, FP4, FP8, FP8_TABLE, FP32, INT, TensorSpec, checkpoint_layout
from flashserve.config.model_config import ModelConfig
from flashserve.config.serialize import config_to_json

from . import quant
from .mapped import DTYPES, FileReader, MappedFiles
from .packed import PackedSlot, encode

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SCALE_SUFFIXES = (".scale", ".weight_scale_inv", ".weight_scale")
RELEASED, HF, HF_MODULES = "released", "hf", "hf-modules"
DEFAULT_SHARD_BYTES = 5 * 10**9
_CHUNK_BYTES = 256 * 2**20  # larger stored tensors are read and decoded in row chunks
_LIST_LIMIT = 20
_OPTIONAL_PARTS = ({"mtp", "dspark"}, {"vision"})  # groups a checkpoint may omit as a whole
DRAFTERS, BIAS_VL, VISION = "drafters", "bias_vl", "vision"  # what load_checkpoint reports as omitted

_FLOAT_STORAGE = {BF16: torch.bfloat16, FP32: torch.float32}


class CheckpointError(UserError):
    """A checkpoint that cannot fill the model: the message names the offending tensors and files."""


# ============================================================================ naming


_HF_RULES: tuple[tuple[str, str], ...] = (
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.attn\.norm\.weight$", ".attn.kv_norm.weight"),  # save_pretrained's spelling of the main KV norm
    (r"\.attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.ffn\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
)
_HF_COMPILED = tuple((re.compile(p), r) for p, r in _HF_RULES)
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.ffn\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def hf_to_released_name(name: str) -> str:
    """Released name of a transformers DeepSeek-V4 key (saved or in-memory spelling; ``model.`` optional).

    Fused expert tensors (``...experts.gate_up_proj`` / ``down_proj``) keep their fused name here; see
    :func:`split_fused_experts`. Released names pass through unchanged.
    """
    out = name[len("model."):] if name.startswith("model.") else name
    for pattern, repl in _HF_COMPILED:
        out = pattern.sub(repl, out)
    return out


def split_fused_experts(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, slice]]] | None:
    """Per-expert released names of a fused transformers expert tensor, with ``(expert, row slice)`` picks.

    ``gate_up_proj [E, 2I, D]`` -> ``experts.e.w1`` rows ``:I`` and ``experts.e.w3`` rows ``I:``;
    ``down_proj [E, D, I]`` -> ``experts.e.w2``. None if ``name`` is not a fused expert tensor.
    """
    m = _FUSED_EXPERTS.match(name)
    if m is None or len(shape) != 3:
        return None
    prefix, n_experts, rows = m["prefix"], shape[0], shape[1]
    if m["kind"] == "down_proj":
        return [(f"{prefix}.{e}.w2.weight", (e, slice(0, rows))) for e in range(n_experts)]
    half = rows // 2
    return [item for e in range(n_experts) for item in (
        (f"{prefix}.{e}.w1.weight", (e, slice(0, half))), (f"{prefix}.{e}.w3.weight", (e, slice(half, rows))))]


def released_to_hf_name(name: str) -> str:
    """The key transformers' ``save_pretrained`` writes for a released V4 name (inverse of the ``hf`` scheme)."""
    if name == "head.weight":
        return name
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    m = re.fullmatch(r"hc_head_(fn|base|scale)", name)
    if m:
        return f"model.hc_head.hc_{m[1]}"
    return "model." + re.sub(r"\.attn\.kv_norm\.weight$", ".attn.norm.weight", name)


def detect_scheme(keys: Iterable[str]) -> str:
    """``released``, ``hf`` (transformers save_pretrained) or ``hf-modules`` (transformers in-memory names)."""
    keys = list(keys)
    if not any(k.startswith(("model.", "lm_head.")) for k in keys):
        return RELEASED
    modules = any(k.startswith("lm_head.") or ".self_attn." in k or ".mlp." in k for k in keys)
    return HF_MODULES if modules else HF


# ============================================================================ reading: discovery


@dataclass(frozen=True)
class _Stored:
    """Header of one stored tensor."""

    file: Path
    key: str
    dtype: str  # safetensors dtype string, e.g. F8_E4M3
    shape: tuple[int, ...]
    start: int = 0  # the data's bytes in the file: start:end
    end: int = 0


@dataclass(frozen=True)
class _Source:
    """One logical checkpoint tensor, decoded into a released name."""

    name: str
    weight: _Stored
    scale: _Stored | None
    shape: tuple[int, ...]  # logical (dequantised) shape
    pick: tuple[int, slice] | None = None  # (expert, rows) of a fused transformers expert tensor


def _checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (per the index when present) or a single file."""
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            raise CheckpointError(_pickle_message([path]))
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} names shard files that do not exist: {', '.join(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES or p.name.endswith(".bin.index.json"))
    if pickles:
        raise CheckpointError(_pickle_message(pickles))
    raise CheckpointError(f"no *.safetensors files in {path}")


def _pickle_message(files: list[Path]) -> str:
    names = ", ".join(str(f) for f in files[:_LIST_LIMIT])
    return (f"refusing pickle-based checkpoint files ({names}): loading them would execute arbitrary code. "
            "Convert them to safetensors first (e.g. with transformers: save_pretrained(..., "
            "safe_serialization=True)) on a machine you trust.")


def _check_length(f: Path) -> dict[str, tuple[int, int]]:
    """Refuse a safetensors file shorter than its header says, naming both sizes, before anything maps it (a read
    of a mapped page past a file's end kills the process with SIGBUS). Returns each tensor's bytes in the file
    (start, end)."""
    size = f.stat().st_size
    try:
        with f.open("rb") as handle:
            n = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(n)) if 8 + n <= size else None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the header of safetensors file {f} ({size} bytes): {exc}") from None
    if header is None:
        raise CheckpointError(f"safetensors file {f} is {size} bytes, shorter than its {n}-byte header (truncated?)")
    spans = {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in header.items()
             if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v}
    need = max((end for _, end in spans.values()), default=8 + n)
    if size < need:
        raise CheckpointError(f"safetensors file {f} is {size} bytes, but its header describes {need} "
                              f"({need - size} missing: truncated?)")
    return spans


def _read_headers(files: list[Path]) -> dict[str, _Stored]:
    """Every stored tensor's header, without reading any data."""
    headers: dict[str, _Stored] = {}
    for f in files:
        spans = _check_length(f)
        try:
            with safe_open(f, framework="pt") as handle:
                for key in handle.keys():
                    sl = handle.get_slice(key)
                    if key in headers:
                        raise CheckpointError(f"tensor {key!r} is stored twice: in {headers[key].file} and {f}")
                    headers[key] = _Stored(f, key, sl.get_dtype(), tuple(sl.get_shape()), *spans.get(key, (0, 0)))
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error type for corrupt files
            raise CheckpointError(f"cannot read safetensors file {f} (truncated or corrupt?): {exc}") from None
    return headers


def _pair_scales(headers: Mapping[str, _Stored]) -> list[tuple[_Stored, _Stored | None]]:
    """(weight, scale) pairs: ``X.scale`` / ``X.weight_scale_inv`` is a scale only when ``X.weight`` exists."""
    scale_of: dict[str, str] = {}
    for key in headers:
        for suffix in SCALE_SUFFIXES:
            if key.endswith(suffix) and key[: -len(suffix)] + ".weight" in headers:
                scale_of[key[: -len(suffix)] + ".weight"] = key
    scales = set(scale_of.values())
    return [(h, headers[scale_of[k]] if k in scale_of else None) for k, h in headers.items() if k not in scales]


def _logical_shape(weight: _Stored, scale: _Stored | None) -> tuple[int, ...]:
    if scale is not None and weight.dtype in ("I8", "U8") and len(weight.shape) == 2:
        return (weight.shape[0], 2 * weight.shape[1])  # MXFP4: two values per byte
    return weight.shape


def _sources(headers: Mapping[str, _Stored], scheme: str) -> list[_Source]:
    """Logical tensors of the checkpoint under their released names (fused experts split per expert)."""
    out: list[_Source] = []
    for weight, scale in _pair_scales(headers):
        shape = _logical_shape(weight, scale)
        name = weight.key if scheme == RELEASED else hf_to_released_name(weight.key)
        fused = split_fused_experts(name, shape) if scheme != RELEASED and scale is None else None
        if fused is None:
            out.append(_Source(name, weight, scale, shape))
            continue
        for expert_name, (e, rows) in fused:
            out.append(_Source(expert_name, weight, None, (rows.stop - rows.start, shape[2]), (e, rows)))
    return out


# ============================================================================ reading: validation


def _listing(title: str, items: list[str]) -> str:
    shown = "\n    ".join(items[:_LIST_LIMIT])
    more = f"\n    ... and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else ""
    return f"  {len(items)} {title}:\n    {shown}{more}"


def _omitted(dest: Mapping[str, torch.Tensor], present: Iterable[str], cfg: ModelConfig) -> dict[str, list[str]]:
    """Optional parts that the checkpoint leaves out as a whole: the MTP/DSpark drafters (transformers'
    ``save_pretrained`` drops them), the vision tower, and the routers' ``bias_vl`` (tools without a vision path
    drop it).
    Returns {what: names in ``dest``}; a part present in part is not omitted (its gaps stay errors)."""
    present = set(present)
    parts = {t.name: t.part for t in checkpoint_layout(cfg)}
    groups = {DRAFTERS: [n for n in dest if parts.get(n) in ("mtp", "dspark")],
              VISION: [n for n in dest if parts.get(n) == "vision"],
              BIAS_VL: [n for n in dest if n.endswith(".bias_vl")]}
    return {what: names for what, names in groups.items() if names and not present & set(names)}


def _validate(dest: Mapping[str, torch.Tensor], sources: list[_Source], cfg: ModelConfig, path: Path,
              scheme: str, strict: bool, streamed: bool = False) -> tuple[dict[str, _Source], dict[str, list[str]]]:
    """Match checkpoint tensors to ``dest``; raise one CheckpointError listing every problem. Returns the
    matches and the optional parts the checkpoint omits as a whole (see :func:`_omitted`)."""
    layout_names = {t.name for t in checkpoint_layout(cfg)}
    foreign = sorted(n for n in dest if n not in layout_names)
    by_name: dict[str, _Source] = {}
    unexpected: list[str] = []
    misshaped: list[str] = []
    for src in sources:
        stored_as = "" if src.weight.key == src.name else f"stored as {src.weight.key} "
        where = f"{stored_as}in {src.weight.file.name}"
        if src.name not in dest:
            if strict and not (streamed and (routed_expert(src.name) or engram_table(src.name))):
                unexpected.append(f"{src.name} ({where})")
            continue
        if src.name in by_name:
            unexpected.append(f"{src.name} (duplicate, {where})")
            continue
        by_name[src.name] = src
        want = tuple(dest[src.name].shape)
        if src.shape != want:
            misshaped.append(f"{src.name}: checkpoint {list(src.shape)} vs model {list(want)} ({where})")
    omitted = _omitted(dest, by_name, cfg)
    excused = {n for names in omitted.values() for n in names}
    missing = sorted(n for n in dest if n not in by_name and n in layout_names and n not in excused)
    problems = [_listing(title, items) for title, items in (
        ("missing (expected by the model, absent from the checkpoint)", missing),
        ("unexpected (in the checkpoint, not in the model)", sorted(unexpected)),
        ("mis-shaped", sorted(misshaped)),
        ("destination names that are not tensors of this config's layout", foreign)) if items]
    if problems:
        raise CheckpointError(f"checkpoint {path} (naming: {scheme}) does not match the model:\n" + "\n".join(problems))
    return by_name, omitted


# ============================================================================ reading: decoding


class _Handles:
    """Open safetensors files, shared by all reads of one load; :meth:`close_others` unmaps the files done with (a
    file safetensors has mapped keeps the pages read through it resident while it is open)."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._open: dict[Path, object] = {}
        self._stacks: dict[Path, contextlib.ExitStack] = {}

    def close_others(self, keep: Path) -> None:
        for f in [f for f in self._stacks if f != keep]:
            self._stacks.pop(f).close()
            del self._open[f]

    def get(self, stored: _Stored, index: slice | tuple[slice, ...] | None = None) -> torch.Tensor:
        """A stored tensor, or a slice of it (only the sliced part is read)."""
        try:
            if stored.file not in self._open:
                stack = self._stacks[stored.file] = self._stack.enter_context(contextlib.ExitStack())
                self._open[stored.file] = stack.enter_context(safe_open(stored.file, framework="pt"))
            handle = self._open[stored.file]
            if index is None or not stored.shape:
                return handle.get_tensor(stored.key)
            return handle.get_slice(stored.key)[index]
        except Exception as exc:
            raise CheckpointError(f"cannot read {stored.key!r} from {stored.file} (truncated or corrupt?): "
                                  f"{exc}") from None


_TORCH_DTYPES = {**DTYPES, "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu}


class _FileHandles:
    """:class:`_Handles`' ``get`` over the descriptors a :class:`~flashserve.model.mapped.FileReader` holds since
    loading (a streamed read decodes the file that was loaded, checked, never one put in its place)."""

    def __init__(self, files: FileReader) -> None:
        self.files = files

    def get(self, stored: _Stored, index: slice | tuple[slice, ...] | None = None) -> torch.Tensor:
        rows = index[0] if isinstance(index, tuple) else index
        rest = index[1:] if isinstance(index, tuple) else ()
        shape = tuple(stored.shape)
        if not shape:
            rows = None
        start, stop = (0, shape[0] if shape else 1) if rows is None else rows.indices(shape[0])[:2]
        row_bytes = (stored.end - stored.start) // max(shape[0] if shape else 1, 1)
        out = torch.empty(((stop - start) * row_bytes,), dtype=torch.uint8)
        self.files.read_into(stored.file, stored.start + start * row_bytes, stored.start + stop * row_bytes, out)
        t = out.view(_TORCH_DTYPES[stored.dtype]).view((stop - start, *shape[1:]) if shape else ())
        return t[(slice(None), *rest)] if rest else t


def _scale_blocks(src: _Source, block_hint: int) -> tuple[int, int]:
    """(row_block, col_block) of a tensor's scale grid: (1, 1) unscaled, (1, 32) MXFP4, (b, b) block FP8,
    (1, 32) FP8 table rows. Raises ValueError when the scale cannot cover the weight."""
    if src.scale is None:
        return 1, 1
    if len(src.weight.shape) != 2 or len(src.scale.shape) != 2:
        raise ValueError(f"scaled tensors must be 2-D, got weight {list(src.weight.shape)} "
                         f"and scale {list(src.scale.shape)}")
    (rows, cols), (s_rows, s_cols) = src.shape, src.scale.shape
    if src.weight.dtype in ("I8", "U8"):  # MXFP4: one scale per row per 32 values
        if s_rows != rows:
            raise ValueError(f"MXFP4 scale has {s_rows} rows for {rows} weight rows")
        return 1, quant.infer_block(cols, s_cols, quant.MX_BLOCK)
    if s_rows == rows != -(-rows // block_hint) and s_cols == -(-cols // quant.MX_BLOCK):
        return 1, quant.MX_BLOCK  # FP8 table: one scale per row per 32 columns
    b = quant.infer_square_block((rows, cols), (s_rows, s_cols), block_hint)
    return b, b


def _plan_blocks(sources: Mapping[str, _Source], block_hint: int, path: Path) -> dict[str, tuple[int, int]]:
    """Scale blocks of every source; one CheckpointError naming every scale that does not fit its weight."""
    blocks: dict[str, tuple[int, int]] = {}
    bad: list[str] = []
    for name, src in sources.items():
        try:
            blocks[name] = _scale_blocks(src, block_hint)
        except ValueError as exc:
            bad.append(f"{src.weight.key} in {src.weight.file.name}: {exc}")
    if bad:
        raise CheckpointError(f"checkpoint {path} has scales that do not fit their weights:\n"
                              + _listing("bad scales", sorted(bad)))
    return blocks


def _decode(src: _Source, handles: _Handles, rows: slice | None, row_block: int, col_block: int,
            dtype: torch.dtype) -> torch.Tensor:
    """Rows ``rows`` (all when None) of a logical tensor, dequantised into ``dtype``."""
    if src.scale is None:
        if src.pick is not None:  # one expert's rows of a fused transformers tensor
            e, picked = src.pick
            return handles.get(src.weight, (slice(e, e + 1), picked))[0].to(dtype)
        return handles.get(src.weight, rows).to(dtype)
    scale_rows = None if rows is None else slice(rows.start // row_block, -(-rows.stop // row_block))
    w = handles.get(src.weight, rows)
    s = handles.get(src.scale, scale_rows)
    if src.weight.dtype in ("I8", "U8"):
        return quant.dequantize_mxfp4(w, s, dtype)
    return quant.dequantize_fp8_grid(w, s, row_block, col_block, dtype)


def _row_chunks(src: _Source, row_block: int) -> Iterator[slice | None]:
    """Row ranges to read a tensor in (None = whole), aligned to the scale's row block."""
    stored = src.weight
    numel = 1
    for d in stored.shape:
        numel *= d
    if src.pick is not None or len(stored.shape) < 1 or numel * 4 <= _CHUNK_BYTES:
        yield None
        return
    n_rows = stored.shape[0]
    per_row = max(1, numel // max(n_rows, 1)) * 4
    step = max(row_block, (_CHUNK_BYTES // per_row) // row_block * row_block)
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


@dataclass
class LoadReport:
    """What a load did with the weights, in bytes by part of the model (the layout's parts: attention,
    routed_expert, engram_table, ...): used where they lie in the mapped files, or copied into memory (decoded,
    quantized, or stacked into the layout the kernels read, as the routed experts are)."""

    mapped: dict[str, int] = field(default_factory=dict)
    copied: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    locked: int = 0  # bytes locked in RAM (``--mlock``)

    def add(self, mapped: bool, part: str, nbytes: int) -> None:
        into = self.mapped if mapped else self.copied
        into[part] = into.get(part, 0) + nbytes

    def describe(self) -> str:
        def parts(d: dict[str, int]) -> str:
            items = sorted(d.items(), key=lambda kv: -kv[1])
            return ", ".join(f"{p.replace('_', ' ')} {_gb(b)}" for p, b in items)

        out = [f"weights loaded in {self.seconds:.2f} s: {_gb(sum(self.mapped.values()))} mapped in place"]
        if self.mapped:
            out[0] += f" ({parts(self.mapped)})"
        out.append(f"{_gb(sum(self.copied.values()))} copied into memory" + (f" ({parts(self.copied)})"
                                                                              if self.copied else ""))
        if self.locked:
            out.append(f"{_gb(self.locked)} locked in RAM")
        return "; ".join(out)


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def _bytes(target: torch.Tensor | PackedSlot) -> int:
    return target.nbytes() if isinstance(target, PackedSlot) else target.numel() * target.element_size()


def _adopt(target: torch.Tensor | PackedSlot, src: _Source, rb: int, cb: int, maps: MappedFiles) -> bool:
    """Make ``target`` a view of its stored bytes in the mapped file, where they are exactly what it holds: a whole
    packed matrix in its own format, or a whole parameter or buffer of the stored dtype (not a view into a stacked
    tensor). False where it must be copied."""
    if src.pick is not None:
        return False
    w = src.weight
    if isinstance(target, PackedSlot):
        if src.scale is None or not target.accepts(w.dtype, rb, cb):
            return False
        q = maps.tensor(w.file, w.dtype, w.shape, w.start, w.end)
        s = maps.tensor(src.scale.file, src.scale.dtype, src.scale.shape, src.scale.start, src.scale.end)
        return q is not None and s is not None and target.adopt(q, s)
    if src.scale is not None or target._base is not None or target.device.type != "cpu":
        return False
    t = maps.tensor(w.file, w.dtype, w.shape, w.start, w.end)
    if t is None or t.dtype != target.dtype or t.shape != target.shape:
        return False
    target.data = t
    return True


def _fill(dest: Mapping[str, torch.Tensor], sources: Mapping[str, _Source], blocks: Mapping[str, tuple[int, int]],
          parts: Mapping[str, str], maps: MappedFiles | None, report: LoadReport) -> None:
    """Give every destination its source: a view of the mapped file where it can (``maps``), else a copy, file by
    file, in row chunks for large tensors."""
    with contextlib.ExitStack() as stack, torch.no_grad():
        handles = _Handles(stack)
        for name, src in sorted(sources.items(), key=lambda kv: (str(kv[1].weight.file), kv[1].weight.key)):
            target = dest[name]
            rb, cb = blocks[name]
            handles.close_others(src.weight.file)  # sources come file by file (a fused scale may lie elsewhere)
            if maps is not None and _adopt(target, src, rb, cb, maps):
                report.add(True, parts.get(name, "other"), _bytes(target))
                continue
            report.add(False, parts.get(name, "other"), _bytes(target))
            if isinstance(target, PackedSlot):
                _fill_packed(target, src, handles, rb, cb)
                continue
            for rows in _row_chunks(src, rb):
                value = _decode(src, handles, rows, rb, cb, target.dtype)
                (target if rows is None else target[rows]).copy_(value)


def _fill_packed(target: PackedSlot, src: _Source, handles: _Handles, rb: int, cb: int) -> None:
    """A packed destination: stored bytes in its own format are copied as they are (no float copy of the
    weight exists at any point); another format is decoded to float32 and quantized."""
    if src.scale is not None and src.pick is None and target.accepts(src.weight.dtype, rb, cb):
        if target.set_stored(handles.get(src.weight), handles.get(src.scale)):
            return
    target.set_float(_decode(src, handles, None, rb, cb, torch.float32))


_ROUTED = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])\.weight$")


def routed_expert(name: str) -> tuple[str, int, str] | None:
    """(experts module path, expert, projection) of a released routed-expert name, e.g.
    ``layers.3.ffn.experts.17.w2.weight`` -> ``("layers.3.ffn.experts", 17, "w2")``; None for other names."""
    m = _ROUTED.match(name)
    return None if m is None else (m["module"], int(m["expert"]), m["proj"])


def _expert_reader(src: _Source, rb: int, cb: int, files: FileReader):
    """A reader of one stored expert projection into a slot of a layer's experts (see
    :mod:`flashserve.model.expert_cache`): its stored bytes as they are where the slot holds that format (MXFP4
    bytes and scales, float of the same dtype), read with ``pread``; decoded and quantized otherwise."""
    stored = src.weight.end - src.weight.start + (0 if src.scale is None else src.scale.end - src.scale.start)

    def read(experts, name: str, slot: int) -> int:
        packed = getattr(experts, f"{name}_packed", None)
        if packed is not None:
            target = PackedSlot(packed, slot)
            q, s = packed.qweight[slot], packed.scale[slot]
            if (src.scale is not None and src.pick is None and target.accepts(src.weight.dtype, rb, cb)
                    and tuple(src.weight.shape) == tuple(q.shape) and tuple(src.scale.shape) == tuple(s.shape)):
                return (files.read_into(src.weight.file, src.weight.start, src.weight.end, q)
                        + files.read_into(src.scale.file, src.scale.start, src.scale.end, s))
        else:
            target = getattr(experts, name)[slot]
            if (src.scale is None and src.pick is None and DTYPES.get(src.weight.dtype) == target.dtype
                    and tuple(src.weight.shape) == tuple(target.shape)):
                return files.read_into(src.weight.file, src.weight.start, src.weight.end, target)
        value = _decode(src, _FileHandles(files), None, rb, cb, target.dtype)
        if isinstance(target, PackedSlot):
            target.set_float(value)
        else:
            target.copy_(value)
        return stored

    def advise() -> None:  # announce the read (several experts' reads then wait on the disk together)
        for part in (src.weight, src.scale):
            if part is not None:
                files.advise(part.file, [(part.start, part.end)])

    read.advise = advise
    return read


_ENGRAM_TABLE = re.compile(r"^(?P<module>.+\.engram\.embed)\.weight$")


def engram_table(name: str) -> str | None:
    """The engram table module's path of a released engram table name (``layers.1.engram.embed.weight`` ->
    ``layers.1.engram.embed``); None for other names."""
    m = _ENGRAM_TABLE.match(name)
    return None if m is None else m["module"]


def _row_reader(src: _Source, rb: int, cb: int, files: FileReader):
    """A reader of rows of one stored engram table into slots of a held table (see
    :mod:`flashserve.model.row_cache`): each row's stored bytes and scales as they are where the held table has that
    format, read with ``pread``; decoded (and quantized into another packed format) otherwise."""
    w, s = src.weight, src.scale
    q_row = (w.end - w.start) // w.shape[0]
    s_row = 0 if s is None else (s.end - s.start) // s.shape[0]

    def read(held, rows: torch.Tensor, slots: torch.Tensor) -> int:
        packed = getattr(held, "packed", None)
        pairs = zip(rows.tolist(), slots.tolist())
        if (packed is not None and s is not None and PackedSlot(packed, None).accepts(w.dtype, rb, cb)
                and packed.qweight[0].numel() * packed.qweight.element_size() == q_row
                and packed.scale[0].numel() * packed.scale.element_size() == s_row):
            if len(rows) > 1:  # the rows' reads queued together
                files.advise(w.file, [(w.start + r * q_row, w.start + (r + 1) * q_row) for r in rows.tolist()])
                files.advise(s.file, [(s.start + r * s_row, s.start + (r + 1) * s_row) for r in rows.tolist()])
            for r, slot in pairs:
                files.read_into(w.file, w.start + r * q_row, w.start + (r + 1) * q_row, packed.qweight[slot])
                files.read_into(s.file, s.start + r * s_row, s.start + (r + 1) * s_row, packed.scale[slot])
            return len(rows) * (q_row + s_row)
        with torch.no_grad():
            handles = _FileHandles(files)
            for r, slot in pairs:
                if packed is None:
                    held.weight[slot].copy_(_decode(src, handles, slice(r, r + 1), rb, cb, held.weight.dtype)[0])
                else:
                    q, sc = encode(_decode(src, handles, slice(r, r + 1), rb, cb, torch.float32), packed.fmt)
                    packed.qweight[slot:slot + 1].copy_(q)
                    packed.scale[slot:slot + 1].copy_(sc)
        return len(rows) * (q_row + s_row)

    return read


def load_checkpoint(dest: Mapping[str, torch.Tensor], path: str | Path, cfg: ModelConfig, *,
                    strict: bool = True, maps: MappedFiles | None = None,
                    report: LoadReport | None = None, stream: dict | None = None) -> dict[str, list[str]]:
    """Fill ``dest`` (released name -> destination tensor, e.g. a parameter or a view into a stacked one) in place.

    Reads the ``*.safetensors`` files of ``path`` (via ``model.safetensors.index.json`` when present) one
    tensor at a time, in any supported naming scheme (see module docstring), dequantising into each
    destination's dtype (a :class:`~flashserve.model.packed.PackedSlot` destination keeps stored bytes that
    are already in its format, and quantizes anything else). All problems are checked from the headers
    before any data is copied and raised as one :class:`CheckpointError`. With ``strict=False`` checkpoint tensors that ``dest`` lacks (e.g. MTP
    stages the caller did not build) are skipped; missing and mis-shaped tensors are errors, except the
    optional parts a checkpoint may omit as a whole: those are returned ({``DRAFTERS`` | ``BIAS_VL``:
    names}) and their destinations left untouched for the caller to drop or zero.
    With ``maps``, a destination whose stored bytes are exactly what it holds becomes a view of the mapped file
    instead (see :func:`_adopt`); ``report`` gets the bytes mapped and copied by part. With ``stream`` (a dict),
    every routed expert's projection in the checkpoint, in ``dest`` or not, gets a reader there (released name ->
    ``read(experts, projection, slot)``, :mod:`flashserve.model.expert_cache`), and those ``dest`` lacks are
    expected.
    """
    started = time.perf_counter()
    path = Path(path)
    files = _checkpoint_files(path)
    headers = _read_headers(files)
    scheme = detect_scheme(headers)
    sources = _sources(headers, scheme)
    by_name, omitted = _validate(dest, sources, cfg, path, scheme, strict, streamed=stream is not None)
    blocks = _plan_blocks(by_name, cfg.quantization.weight_block_size, path)
    if stream is not None:
        streamed = {src.name: src for src in sources if routed_expert(src.name) or engram_table(src.name)}
        # the files the streamed tensors lie in, opened now and held: what is read later is what was loaded. Reads go
        # through the page cache, whose pages of them are a second level behind the slots (reclaimable, not this
        # process's memory: docs/engine-speed.md#a-budget-for-the-weights---weight-memory)
        files = FileReader(sorted({s.file for src in streamed.values() for s in (src.weight, src.scale) if s}))
        for name, (rb, cb) in _plan_blocks(streamed, cfg.quantization.weight_block_size, path).items():
            make = _expert_reader if routed_expert(name) else _row_reader
            stream[name] = make(streamed[name], rb, cb, files)
    report = LoadReport() if report is None else report
    _fill(dest, by_name, blocks, {t.name: t.part for t in checkpoint_layout(cfg)}, maps, report)
    report.seconds += time.perf_counter() - started
    return omitted


def stored_dtypes(path: str | Path, names: frozenset[str]) -> dict[str, str]:
    """Released name -> stored dtype of the tensors ``names`` that a checkpoint stores whole and unscaled (such as
    ``BF16``), from the headers alone."""
    headers = _read_headers(_checkpoint_files(Path(path)))
    return {src.name: src.weight.dtype for src in _sources(headers, detect_scheme(headers))
            if src.name in names and src.scale is None and src.pick is None}


def packed_dtypes(path: str | Path) -> dict[str, str]:
    """Released name -> stored dtype of every tensor a checkpoint stores with a scale (FP8 ``F8_E4M3``, MXFP4
    ``I8``/``U8``), from the headers alone."""
    headers = _read_headers(_checkpoint_files(Path(path)))
    return {src.name: src.weight.dtype for src in _sources(headers, detect_scheme(headers))
            if src.scale is not None}


# ============================================================================ writing


def scale_name(name: str) -> str:
    """The stored name of a weight's scale (``X.weight`` -> ``X.scale``)."""
    return (name[: -len(".weight")] if name.endswith(".weight") else name) + ".scale"


def stored_bytes(spec: TensorSpec, cfg: ModelConfig, quantize: bool = True) -> int:
    """Bytes a tensor takes on disk (weight + scale), computed from its spec alone."""
    n = spec.numel
    if spec.kind == INT:
        return 8 * n
    if not quantize:
        return 4 * n
    if spec.kind in _FLOAT_STORAGE:
        return _FLOAT_STORAGE[spec.kind].itemsize * n
    rows, cols = spec.shape
    if spec.kind == FP8:
        b = cfg.quantization.weight_block_size
        return n + (-(-rows // b)) * (-(-cols // b))
    per_row_scales = rows * (-(-cols // quant.MX_BLOCK))
    return (n // 2 if spec.kind == FP4 else n) + per_row_scales


def _encode(spec: TensorSpec, t: torch.Tensor, cfg: ModelConfig, quantize: bool) -> list[tuple[str, torch.Tensor]]:
    """Stored tensors (released names) of one layout tensor."""
    if spec.kind == INT:
        return [(spec.name, t.to(torch.int64))]
    if not quantize:
        return [(spec.name, t.to(torch.float32))]
    if spec.kind in _FLOAT_STORAGE:
        return [(spec.name, t.to(_FLOAT_STORAGE[spec.kind]))]
    if spec.kind == FP8:
        w, s = quant.quantize_fp8_blocks(t, cfg.quantization.weight_block_size)
    elif spec.kind == FP4:
        w, s = quant.quantize_mxfp4(t)
    elif spec.kind == FP8_TABLE:
        w, s = quant.quantize_fp8_rows(t)
    else:
        raise ValueError(f"unknown storage kind {spec.kind!r} for {spec.name}")
    return [(spec.name, w), (scale_name(spec.name), s)]


def _select_specs(src: Mapping[str, torch.Tensor], cfg: ModelConfig) -> list[TensorSpec]:
    """Layout specs of the tensors in ``src`` (layout order); optional parts must be whole or absent."""
    layout = checkpoint_layout(cfg)
    known = {t.name: t for t in layout}
    unknown = sorted(n for n in src if n not in known)
    present_parts = {t.part for t in layout if t.name in src}
    skipped = set().union(*(group for group in _OPTIONAL_PARTS if not group & present_parts))
    wanted = [t for t in layout if t.part not in skipped]
    missing = [t.name for t in wanted if t.name not in src]
    misshaped = [f"{t.name}: given {list(src[t.name].shape)} vs layout {list(t.shape)}"
                 for t in wanted if t.name in src and tuple(src[t.name].shape) != t.shape]
    problems = [_listing(title, items) for title, items in (
        ("missing", missing), ("not in the layout of this config", unknown), ("mis-shaped", misshaped)) if items]
    if problems:
        raise CheckpointError("cannot save: the tensors do not match the checkpoint layout:\n" + "\n".join(problems))
    return wanted


def _plan_shards(specs: list[TensorSpec], sizes: list[int], max_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec, size in zip(specs, sizes):
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += size
    return shards


def _config_json(cfg: ModelConfig, fmt: str) -> dict:
    """``config.json`` of a written checkpoint; the ``hf`` layout is unquantised float32, so it states none."""
    config = config_to_json(cfg)
    if fmt == HF:
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
    return config


def save_checkpoint(src: Mapping[str, torch.Tensor], path: str | Path, cfg: ModelConfig, *,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, fmt: str = RELEASED,
                    quantize: bool = True) -> list[Path]:
    """Write ``src`` (released name -> tensor) as a checkpoint folder; returns the shard paths.

    The names must be exactly those of ``checkpoint_layout(cfg)``, except that the MTP/DSpark stages and the
    vision tower may each be left out as a whole. ``fmt="released"`` stores each tensor by its layout kind
    (fp8 -> block FP8 + ``.scale`` with ``cfg.quantization.weight_block_size``, fp4 -> MXFP4 + ``.scale``,
    fp8_table -> FP8 rows + ``.scale``, bf16, fp32, int -> int64); ``quantize=False`` writes every float as
    float32 (exact round trips). ``fmt="hf"`` writes what transformers' ``save_pretrained`` writes for
    DeepSeek-V4 (float32, ``model.``-prefixed names, no ``quantization_config``; V4 only, no MTP), which
    ``DeepseekV4ForCausalLM.from_pretrained`` loads.
    """
    if fmt not in (RELEASED, HF):
        raise ValueError(f"fmt must be {RELEASED!r} or {HF!r}, got {fmt!r}")
    specs = _select_specs(src, cfg)
    if fmt == HF:
        if cfg.is_v41 or any(t.part in ("mtp", "dspark", "vision") for t in specs):
            raise ValueError("fmt='hf' is transformers' DeepSeek-V4 layout: V4 configs only, without MTP tensors")
        quantize = False
    sizes = [stored_bytes(t, cfg, quantize) for t in specs]

    def stored(spec: TensorSpec) -> list[tuple[str, torch.Tensor]]:
        pairs = _encode(spec, src[spec.name].detach(), cfg, quantize)
        return [(released_to_hf_name(k) if fmt == HF else k, t) for k, t in pairs]

    return write_checkpoint(path, _config_json(cfg, fmt), specs, stored, sizes, max_shard_bytes=max_shard_bytes)


def write_checkpoint(path: str | Path, config: dict, specs: list[TensorSpec],
                     stored: Callable[[TensorSpec], list[tuple[str, torch.Tensor]]], sizes: list[int], *,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """Write a checkpoint folder: ``config.json``, safetensors shards of at most about ``max_shard_bytes`` and
    their index. ``stored(spec)`` gives the stored tensors of one layout tensor (its weight and scale, by their
    stored names), asked for one shard at a time, so a checkpoint larger than memory can be written; ``sizes``:
    each spec's stored bytes. Returns the shard paths."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards = _plan_shards(specs, sizes, max_shard_bytes)
    n = len(shards)
    weight_map: dict[str, str] = {}
    written: list[Path] = []
    for i, group in enumerate(shards, start=1):
        fname = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for spec in group:
            for key, t in stored(spec):
                tensors[key] = t.contiguous().cpu()
                weight_map[key] = fname
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        del tensors
        written.append(path / fname)
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return written


__all__ = [
    "CheckpointError", "load_checkpoint", "packed_dtypes", "DRAFTERS", "BIAS_VL", "save_checkpoint", "write_checkpoint",
    "stored_bytes", "scale_name", "detect_scheme", "hf_to_released_name",
    "released_to_hf_name", "split_fused_experts", "INDEX_FILE",
]
