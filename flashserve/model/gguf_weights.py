"""Load a DeepSeek-V4 GGUF into flashserve's model: ``load_model("model.gguf")`` comes here.

What each stored tensor becomes:

* F32, F16 and BF16 tensors the model holds in that dtype are used where they lie in the read-only, shared map of
  the file (as the safetensors loader maps them: :class:`flashserve.model.mapped.MappedFiles`), read from the disk
  when first touched; a float32 model on the CPU holds a large BF16 token embedding and LM head as stored, as it
  does for a checkpoint folder;
* MXFP4 routed experts (llama.cpp's blocks: one E8M0 scale byte, then 16 bytes whose low nibbles are the block's
  values 0-15 and high nibbles 16-31) are repacked, bit for bit, into flashserve's MXFP4 (values in pairs, even
  index in the low nibble, scales apart): the same numbers, held packed (copied, since the nibble order differs);
  a layer whose three expert projections are not all MXFP4 is held in float;
* everything else (Q8_0, the K-quants, the IQ formats, tensors of another float dtype, the I32 hash tables) is
  decoded at load with ``gguf.quants.dequantize`` (or converted) into the model's parameters, row chunk by row
  chunk, an expert at a time.
``quantization`` (``int8``, ``fp8``, ...) packs the decoded floats as it packs a float checkpoint's. Every name,
shape and type is checked against the model before any tensor data is read.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError, ModelConfig
from ..config.checkpoint_layout import QUANTIZATIONS, checkpoint_layout
from ..gguf.config import config_from_gguf
from ..gguf.file import FLOAT_TYPES, GGUFError, GGUFModel, StoredTensor, open_gguf
from ..gguf.names import released_name

log = logging.getLogger(__name__)

_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_CHUNK_BYTES = 64 << 20  # float32 bytes decoded at a time
_MX_BLOCK, _MX_BLOCK_BYTES = 32, 17
_LIST_LIMIT = 20


def mxfp4_experts(model: GGUFModel, cfg: ModelConfig) -> list[str]:
    """The ``layers.N.ffn.experts`` prefixes whose three stacked projections the GGUF stores as MXFP4."""
    seen: dict[str, set[str]] = {}
    for name, t in model.tensors.items():
        prefix, proj, kind = released_name(name, cfg.num_hidden_layers)
        if kind == "experts" and t.type_name == "MXFP4":
            seen.setdefault(prefix, set()).add(proj)
    return sorted(p for p, projs in seen.items() if projs == {"w1", "w2", "w3"})


def stored_formats(model: GGUFModel, cfg: ModelConfig) -> dict:
    """Module path -> packed format that keeps the GGUF's experts as stored (MXFP4 where all three of a layer's
    projections are MXFP4); everything else float."""
    from .packed import plan_as_stored

    return plan_as_stored(cfg, {f"{p}.0.w1.weight": "U8" for p in mxfp4_experts(model, cfg)})


def formats_for(model: GGUFModel, cfg: ModelConfig, quantization: str | None) -> dict:
    """What the loader packs: the stored formats (``quantization`` None), else the asked method's plan, as for a
    checkpoint folder (``w4a8`` keeps MXFP4 experts as stored)."""
    from .packed import W4A8, plan

    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)} "
                          "(or leave it unset to keep the GGUF's MXFP4 experts as stored)")
    if quantization is None:
        return stored_formats(model, cfg)
    if quantization == W4A8 and mxfp4_experts(model, cfg):
        return stored_formats(model, cfg)
    return plan(cfg, quantization)


def load_gguf_model(path: str | Path, *, dtype, device: str = "cpu", fake_quant: bool | None = None, seed: int = 0,
                    with_mtp: bool = True, quantization: str | None = None, prepare=None, mmap: bool = True,
                    experts_in_place: bool | None = None, mlock: bool = False, weight_memory: int | None = None,
                    expert_cache_policy: str = "lru", gpu_experts: int | None = None):
    """:func:`flashserve.model.loader.load_model` for a GGUF file (a split set by its first file); the same options.
    A GGUF carries no MTP drafter (``with_mtp`` builds none); ``experts_in_place`` has no effect (MXFP4 experts are
    repacked into flashserve's layout); ``weight_memory`` is refused (experts are not streamed from a GGUF)."""
    from .load_common import _hybrid, activations_in_8_bits, keep_fp32, resolve_dtype
    from .packed import W4A8, pack_model
    from .transformer import Transformer

    del seed, experts_in_place, expert_cache_policy  # no random weights; experts are copied, never streamed
    g = open_gguf(path)
    cfg = config_from_gguf(g)
    torch_dtype = resolve_dtype(dtype)
    if weight_memory is not None:
        raise ConfigError("weight_memory: routed experts are streamed from safetensors checkpoint folders only; a "
                          "GGUF's weights are loaded whole")
    if gpu_experts is not None:
        if isinstance(gpu_experts, bool) or not isinstance(gpu_experts, int) or gpu_experts < 1:
            raise ConfigError(f"gpu_experts: must be an integer >= 1, got {gpu_experts!r}")
        model = load_gguf_model(path, dtype=dtype, device="cpu", fake_quant=fake_quant, with_mtp=with_mtp,
                                quantization=quantization, prepare=prepare, mmap=mmap, mlock=mlock)
        return _hybrid(model, gpu_experts, device)
    formats = formats_for(g, cfg, quantization)
    if with_mtp:
        log.info("%s: a GGUF holds no MTP drafter; the model is loaded without one", g.path.name)
    with torch.device("meta"):
        model = Transformer(cfg, with_mtp=False)
    model.to(torch_dtype)
    keep_fp32(model)  # before any weight is written, so the fp32 leaves are never rounded to ``dtype``
    pack_model(model, formats, quantize=False, compute_dtype=torch_dtype)  # still on meta: no float copy
    on_cpu = torch.device(device).type == "cpu"
    if torch_dtype == torch.float32 and on_cpu and prepare is None:
        _hold_as_stored(model, g)
    if prepare is not None:
        prepare(model)
    if on_cpu:
        _check_memory(model, g, cfg, mmap)
    model = model.to_empty(device=device)
    for module in model.modules():  # buffers computed, never loaded (rope, packed tables)
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    _load_weights(model, g, cfg, mmap=mmap and on_cpu, strict=prepare is None)
    model.fake_quant = cfg.is_v41 if fake_quant is None else bool(fake_quant)
    model.weight_memory = None
    model.weight_budget = None
    if mlock:
        from .mapped import lock_weights

        locked, failed = lock_weights(model)
        if failed:
            log.warning("--mlock: %s; %d bytes locked, the rest may be paged out", failed, locked)
        model.load_report.locked = locked
    if quantization == W4A8:
        activations_in_8_bits(model)
    log.info("%s: %s", g.path.name, model.load_report.describe())
    return model.eval()


def _hold_as_stored(model, g: GGUFModel) -> None:
    """A float32 model on the CPU holds a large BF16 token embedding and LM head as the GGUF stores them (read through
    the bfloat16 panels, as :func:`flashserve.model.loader.hold_as_stored` does for a checkpoint folder)."""
    from . import cpu_kernels
    from .load_common import KEEP_STORED, KEEP_STORED_MIN_ELEMENTS

    if not cpu_kernels.dense_rows_available():
        return
    params = dict(model.named_parameters())
    for gguf_name, t in g.tensors.items():
        name, _, _ = released_name(gguf_name, model.cfg.num_hidden_layers)
        p = params.get(name) if name in KEEP_STORED else None
        if (p is not None and t.type_name == "BF16" and p.dtype == torch.float32
                and p.numel() >= KEEP_STORED_MIN_ELEMENTS):
            p.data = torch.empty(p.shape, dtype=torch.bfloat16, device=p.device)


def _mappable(target, t: StoredTensor) -> bool:
    """Whether a destination can be a view of the tensor where it lies in the file (a whole float tensor of its
    dtype)."""
    return (isinstance(target, torch.Tensor) and t.type_name in FLOAT_TYPES and target._base is None
            and _FLOAT_DTYPES[t.type_name] == target.dtype)


def _check_memory(model, g: GGUFModel, cfg: ModelConfig, mmap: bool) -> None:
    """Refuse, before anything is allocated (``model`` on ``meta``), a GGUF whose decoded or repacked weights need
    more memory than the system has available, naming the sizes and the formats decoded."""
    from .mapped import available_memory

    dest = model.checkpoint_tensors()
    every = {id(t): t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())}
    mapped, decoded = 0, set()
    for name, t in g.tensors.items():
        rel, _, kind = released_name(name, cfg.num_hidden_layers)
        target = dest.get(rel) if kind == "tensor" else None
        if mmap and target is not None and _mappable(target, t):
            mapped += target.numel() * target.element_size()
        elif t.type_name not in ("F32", "MXFP4", "I32"):
            decoded.add(t.type_name)
    need = sum(every.values()) - mapped
    have = available_memory()
    if have is not None and need > have:
        what = f" (tensors of type {', '.join(sorted(decoded))} decoded to floats)" if decoded else ""
        raise ConfigError(f"{g.path}: the weights it loads into memory take {_size(need)}{what}, more than the "
                          f"{_size(have)} available. Only F32/F16/BF16 tensors of the compute dtype are "
                          "used where they lie and MXFP4 experts held packed; a 16-bit --dtype halves decoded floats")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _listing(title: str, items: list[str]) -> str:
    shown = "\n    ".join(items[:_LIST_LIMIT])
    more = f"\n    ... and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else ""
    return f"  {len(items)} {title}:\n    {shown}{more}"


def match(g: GGUFModel, dest: dict, cfg: ModelConfig, strict: bool = True) -> list[tuple[StoredTensor, list]]:
    """Each GGUF tensor with the destinations it fills: ``[(tensor, [(released name, expert or None), ...])]``.
    Every problem (a tensor the model does not have, one it lacks, a shape that differs) is raised at once as a
    GGUFError before anything is read. Without ``strict`` (an expert-parallel rank), experts the model does not
    hold are left out."""
    plan: list[tuple[StoredTensor, list]] = []
    covered: set[str] = set()
    unexpected, misshaped, skipped = [], [], []
    for name, t in g.tensors.items():
        rel, proj, kind = released_name(name, cfg.num_hidden_layers)
        where = f"{name} ({t.type_name} {list(t.shape)} in {t.file.name})"
        if kind == "skipped":
            skipped.append(name)
            continue
        if kind == "unknown":
            unexpected.append(where)
            continue
        if kind == "tensor":
            if rel not in dest:
                unexpected.append(where)
                continue
            want = tuple(dest[rel].shape)
            if t.shape != want:
                misshaped.append(f"{where}: the model's {rel} is {list(want)}")
                continue
            plan.append((t, [(rel, None)]))
            covered.add(rel)
            continue
        names = [(f"{rel}.{e}.{proj}.weight", e) for e in range(t.shape[0])]
        if len(t.shape) != 3 or not any(n in dest for n, _ in names):
            unexpected.append(where)
            continue
        held = [(n, e) for n, e in names if n in dest]
        if strict and len(held) != len(names):
            unexpected.append(f"{where}: {len(names)} experts, the model has {len(held)}")
            continue
        want = tuple(dest[held[0][0]].shape)
        if t.shape[1:] != want:
            misshaped.append(f"{where}: an expert of the model's {rel} {proj} is {list(want)}")
            continue
        plan.append((t, held))
        covered.update(n for n, _ in held)
    layout = {s.name for s in checkpoint_layout(cfg, mtp=False, vision=False)}
    missing = sorted(n for n in dest if n not in covered and n in layout)
    problems = [_listing(title, items) for title, items in (
        ("missing (the model has them, the GGUF does not)", missing),
        ("unexpected (in the GGUF, not in the model)", sorted(unexpected)),
        ("mis-shaped", sorted(misshaped))) if items]
    if problems:
        raise GGUFError(f"{g.path} does not match the DeepSeek-V4 model its metadata describes:\n"
                        + "\n".join(problems))
    if skipped:
        log.info("%s: %d tensors not loaded (MTP drafter blocks, image routing): %s", g.path.name, len(skipped),
                 ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""))
    return plan


def _load_weights(model, g: GGUFModel, cfg: ModelConfig, *, mmap: bool, strict: bool) -> None:
    from .checkpoint import LoadReport
    from .mapped import MappedFiles

    started = time.perf_counter()
    dest = model.checkpoint_tensors()
    plan = match(g, dest, cfg, strict)
    parts = {s.name: s.part for s in checkpoint_layout(cfg, mtp=False, vision=False)}
    maps = MappedFiles() if mmap else None
    report = model.load_report = LoadReport()
    with torch.no_grad():
        for t, targets in plan:
            for name, expert in targets:
                mapped, nbytes = _fill(dest[name], t, expert, maps)
                report.add(mapped, parts.get(name, "other"), nbytes)
    if maps is not None and maps.maps:
        model._mapped_files = maps  # the maps live as long as the model
    report.seconds = time.perf_counter() - started


def _fill(target, t: StoredTensor, expert: int | None, maps) -> tuple[bool, int]:
    """Give one destination its stored values; (whether it was mapped in place, the bytes it holds)."""
    from .packed import PackedSlot

    if isinstance(target, PackedSlot):
        if t.type_name == "MXFP4" and target.accepts("U8", 1, _MX_BLOCK):
            q, s = repack_mxfp4(_bytes(t, expert))
            if target.set_stored(q, s):
                return False, target.nbytes()
        target.set_float(decode(t, expert, torch.float32))
        return False, target.nbytes()
    nbytes = target.numel() * target.element_size()
    if maps is not None and expert is None and target.device.type == "cpu" and _mappable(target, t):
        view = maps.tensor(t.file, t.type_name, t.shape, t.start, t.end)
        if view is not None and tuple(view.shape) == tuple(target.shape):
            target.data = view
            return True, nbytes
    rows = target.shape[0] if target.dim() >= 2 else None
    if rows is None:
        target.copy_(decode(t, expert, target.dtype))
        return False, nbytes
    row_values = max(1, int(np.prod(target.shape[1:])))
    step = max(1, _CHUNK_BYTES // (4 * row_values))
    for a in range(0, rows, step):
        target[a:a + step].copy_(decode(t, expert, target.dtype, slice(a, a + step)))
    return False, nbytes


def _bytes(t: StoredTensor, expert: int | None, rows: slice | None = None) -> np.ndarray:
    """The reader's view of one tensor, one expert of a stacked one, and/or some of its rows (no copy)."""
    data = t.data if expert is None else t.data[expert]
    return data if rows is None else data[rows]


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # the reader's views are read-only; nothing writes through this one
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def decode(t: StoredTensor, expert: int | None, dtype: torch.dtype, rows: slice | None = None) -> torch.Tensor:
    """Values of a tensor (one expert of it, some rows of it) in ``dtype``: plain types converted, block formats
    decoded with ``gguf.quants.dequantize``."""
    data = _bytes(t, expert, rows)
    if t.type_name == "BF16":
        raw = np.ascontiguousarray(data)
        return _as_tensor(raw).view(torch.bfloat16).to(dtype)
    if t.type_name in ("F32", "F16", "F64", "I8", "I16", "I32", "I64"):
        return _as_tensor(np.asarray(data)).to(dtype)
    import gguf

    values = gguf.quants.dequantize(np.asarray(data), gguf.GGMLQuantizationType[t.type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)


def repack_mxfp4(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's MXFP4 blocks ``uint8 [..., rows, blocks * 17]`` (a scale byte, then byte j holding value j in its
    low nibble and value j + 16 in its high one) -> flashserve's MXFP4: E2M1 pairs ``uint8 [..., rows, cols / 2]``
    (value 2i low, 2i + 1 high) and E8M0 scales ``uint8 [..., rows, blocks]``. Lossless: the 4-bit codes and the
    scale bytes mean the same on both sides (ggml doubles its E2M1 table and halves the scale)."""
    b = torch.from_numpy(np.ascontiguousarray(blocks))
    lead, n = b.shape[:-1], b.shape[-1] // _MX_BLOCK_BYTES
    b = b.view(*lead, n, _MX_BLOCK_BYTES)
    scale = b[..., 0].contiguous()
    codes = b[..., 1:]
    values = torch.cat((codes & 0x0F, codes >> 4), dim=-1)  # [..., blocks, 32] in the block's order
    pairs = values[..., 0::2] | (values[..., 1::2] << 4)
    return pairs.reshape(*lead, n * (_MX_BLOCK // 2)).contiguous(), scale
