"""``load_model``: a preset with seeded random weights, or a checkpoint folder in either naming scheme."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig, load_config
from ..config.presets import PRESET_JSON, RUNNABLE_PRESETS
from . import cpu_kernels
from .init import random_init
from .load_common import (KEEP_STORED, KEEP_STORED_MIN_ELEMENTS, _hybrid, activations_in_8_bits,  # noqa: F401
                          keep_fp32, resolve_dtype)
from .packed import MXFP4, W4A8
from .transformer import Transformer

log = logging.getLogger(__name__)

# Under a budget, the engram tables keep a sixteenth of what the other weights leave (at least row_cache.MIN_ROWS rows
# a table): a token reads about 13 KB of engram rows where it reads gigabytes of routed experts, and the rows'
# accesses are Zipfian, so a small row cache hits most of them; the routed experts take the rest.
ROW_SHARE = 16


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _layer_experts(m) -> tuple[int, int]:
    """(experts, bytes an expert) of one MoE layer's routed experts (their stacked tensors)."""
    n = m.experts.n_experts
    return n, _nbytes(t for t in list(m.experts.parameters()) + list(m.experts.buffers()) if t.dim() >= 3) // n


def _slots_for(layers: list, sizes: list[tuple[int, int]], room: int) -> list[int]:
    """Slots a layer for the routed experts in ``room`` bytes: each layer the same share of its own experts (a
    drafter's layers have fewer than the model's), at least its router's top-k, at most all of them; the largest
    share that fits."""
    def slots(share: float) -> list[int]:
        return [min(n, max(m.gate.top_k, int(share * n))) for m, (n, _) in zip(layers, sizes)]

    def cost(share: float) -> int:
        return sum(s * b for s, (_, b) in zip(slots(share), sizes))

    lo, hi = 0.0, 1.0
    if cost(hi) <= room:
        return slots(hi)
    for _ in range(60):  # the share is found to far below one slot of the largest layer
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost(mid) <= room else (lo, mid)
    held = slots(lo)
    left = room - cost(lo)
    while True:  # what the common share leaves: a slot more to the layers holding the least share of theirs
        open_ = [i for i, (n, b) in enumerate(sizes) if held[i] < n and b <= left]
        if not open_:
            return held
        i = min(open_, key=lambda i: held[i] / sizes[i][0])
        held[i] += 1
        left -= sizes[i][1]


def plan_copies(model: Transformer) -> tuple[int, int]:
    """Bytes of the copies of weights the engine's execution plan makes on a CPU (engine.execution), predicted on
    the still-empty ``meta`` model: (the bfloat16 panels of the large weights held in bfloat16 as stored, which
    every decode row reads and the plan always makes; the block-FP8 codes in column panels, which it makes only
    where a budget leaves room for them)."""
    from . import blas
    from .packed import FP8, PackedLinear

    lanes = cpu_kernels.LANES
    bf16 = 0
    if model.dtype == torch.float32 and cpu_kernels.dense_rows_available():
        for mod in model.modules():
            for name in getattr(mod, "ROW_WEIGHTS", ()):
                w = getattr(mod, name, None)
                if (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.bfloat16
                        and w.numel() >= blas.BF16_PANEL_MIN_ELEMENTS):
                    bf16 += -(-w.shape[0] // lanes) * lanes * w.shape[1] * 2
    fp8 = 0
    if cpu_kernels.fp8_panels_available():
        for mod in model.modules():
            p = getattr(mod, "packed", None)
            if (isinstance(mod, PackedLinear) and p.fmt.name == FP8 and p.qweight.dim() == 2
                    and p.fmt.row_block % lanes == 0):
                fp8 += -(-p.qweight.shape[0] // lanes) * lanes * p.qweight.shape[1]
    return bf16, fp8


@dataclass
class Budget:
    """How a weight budget is spent (:func:`_budget`): bytes of the weights held whole, of the routed experts'
    slots, of the engram row caches, of the plan's copies (bfloat16 panels always; FP8 panels where they fit)."""
    budget: int
    fixed: int
    experts: int
    rows: int
    copies: int
    fp8_panels: bool
    slots: list[int] | None  # a MoE layer's slots, in the model's order; None when every expert is held
    experts_per_layer: list[int]

    @property
    def planned(self) -> int:
        return self.fixed + self.experts + self.rows + self.copies

    def describe(self) -> str:
        gib = 2 ** 30
        held = ("every routed expert" if self.slots is None else
                f"{self.slots[0]} of {self.experts_per_layer[0]} routed experts a layer"
                + (f" ({min(s / n for s, n in zip(self.slots, self.experts_per_layer)):.0%} of a drafter's)"
                   if len(set(self.experts_per_layer)) > 1 else ""))
        return (f"weight memory {self.budget / gib:.2f} GiB: weights held whole {self.fixed / gib:.2f} GiB, "
                f"{held} {self.experts / gib:.2f} GiB, engram rows {self.rows / gib:.2f} GiB, the plan's copies "
                f"{self.copies / gib:.2f} GiB ({'with' if self.fp8_panels else 'without'} FP8 panels)")


def _budget(model: Transformer, budget: int) -> tuple[Budget, dict[str, int]]:
    """Split a resident budget of ``budget`` bytes for the weights, the execution plan's copies of them included
    (:func:`plan_copies`): slots per MoE layer for the routed experts (each layer's own count: a drafter's layers
    have fewer experts) and rows held per engram table (path -> rows; tables that fit whole are left out); FP8
    panels only where everything else fits with them. On the still-empty ``meta`` model, whose experts are cut to
    their slots and whose streamed tables become row caches. Raises ConfigError when not even the router's top-k
    a layer and the least row caches fit."""
    from .moe import MoE
    from .row_cache import MIN_ROWS

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    sizes = [_layer_experts(m) for m in layers]
    tables = {f"layers.{i}.engram.embed": b.engram.embed for i, b in enumerate(model.layers)
              if getattr(b, "engram", None) is not None}
    every = _nbytes({id(t): t for t in list(model.parameters()) + list(model.buffers())}.values())
    experts = sum(n * b for n, b in sizes)
    table_rows = {p: t.num_embeddings if isinstance(t, torch.nn.Embedding) else t.packed.shape[0]
                  for p, t in tables.items()}
    row_bytes = {p: _nbytes(list(t.parameters()) + list(t.buffers())) // table_rows[p] for p, t in tables.items()}
    table_bytes = sum(row_bytes[p] * table_rows[p] for p in tables)
    fixed = every - experts - table_bytes
    bf16_copies, fp8_copies = plan_copies(model)
    whole = fixed + experts + table_bytes + bf16_copies
    if budget >= whole:  # nothing streamed; FP8 panels where they fit too
        panels = budget >= whole + fp8_copies and fp8_copies > 0
        return Budget(budget, fixed, experts, table_bytes, bf16_copies + (fp8_copies if panels else 0), panels,
                      None, [n for n, _ in sizes]), {}
    least_rows = {p: min(n, MIN_ROWS) for p, n in table_rows.items()}
    need = (fixed + bf16_copies + sum(m.gate.top_k * b for m, (_, b) in zip(layers, sizes))
            + sum(row_bytes[p] * n for p, n in least_rows.items()))
    if budget < need:
        top_k = max((m.gate.top_k for m in layers), default=0)
        raise ConfigError(f"weight memory {budget} bytes cannot hold this model: its weights other than the routed "
                          f"experts and engram tables take {fixed + bf16_copies} bytes (the decode step's copies "
                          f"included), each of its {len(layers)} MoE layers needs at least its router's {top_k} "
                          f"experts' slots "
                          f"({max((b for _, b in sizes), default=0)} bytes an expert) and each of its {len(tables)} "
                          f"engram tables at least {MIN_ROWS} rows; give at least {need} bytes "
                          f"({need / 2**30:.2f} GiB)")
    left = budget - fixed - bf16_copies

    def rows_for(share: int) -> dict[str, int]:
        f = min(1.0, share / table_bytes) if table_bytes else 1.0
        return {p: min(n, max(least_rows[p], int(f * n))) for p, n in table_rows.items()}

    rows = rows_for(left // ROW_SHARE if layers else left)
    row_held = sum(row_bytes[p] * n for p, n in rows.items())
    slots = _slots_for(layers, sizes, left - row_held)
    if slots == [n for n, _ in sizes]:  # every expert fits: the tables take the rest
        rows = rows_for(left - experts)
        row_held = sum(row_bytes[p] * n for p, n in rows.items())
    rows = {p: n for p, n in rows.items() if n < table_rows[p]}
    streamed_slots = None if all(s == n for s, (n, _) in zip(slots, sizes)) else slots
    with torch.device("meta"):
        if streamed_slots is not None:
            for m, s in zip(layers, slots):
                _cut_experts(m.experts, s)
        for p, n in rows.items():
            _cut_table(model, p, tables[p], n)
    return Budget(budget, fixed, sum(s * b for s, (_, b) in zip(slots, sizes)), row_held, bf16_copies, False,
                  streamed_slots, [n for n, _ in sizes]), rows


def _cut_experts(e, slots: int) -> None:
    from .packed import PackedExperts, PackedWeights

    if isinstance(e, PackedExperts):
        for name in ("w1", "w2", "w3"):
            p = getattr(e, f"{name}_packed")
            setattr(e, f"{name}_packed", PackedWeights((slots, *p.shape[1:]), p.fmt))
    else:
        for name in ("w1", "w2", "w3"):
            w = getattr(e, name)
            setattr(e, name, torch.nn.Parameter(torch.empty(slots, *w.shape[1:], dtype=w.dtype)))
    e.n_experts = slots


def _cut_table(model: Transformer, path: str, table: torch.nn.Module, rows: int) -> None:
    """Replace the engram table at ``path`` by a row cache holding ``rows`` of its rows (same type and format)."""
    from .packed import PackedEmbedding
    from .row_cache import RowCache

    if isinstance(table, torch.nn.Embedding):
        held = torch.nn.Embedding(rows, table.embedding_dim, dtype=table.weight.dtype)
        total = table.num_embeddings
    else:
        held = PackedEmbedding(rows, table.packed.shape[1], table.packed.fmt)
        held.compute_dtype = table.compute_dtype
        total = table.packed.shape[0]
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent), leaf, RowCache(total, held))


def _attach_caches(model: Transformer, stream: dict, policy: str) -> None:
    """Give every MoE layer of ``model`` whose experts are in slots the cache that streams the others from
    ``stream`` (released name -> reader, :func:`flashserve.model.checkpoint.load_checkpoint`), and every row cache
    its table's reader."""
    from .checkpoint import routed_expert
    from .expert_cache import ExpertCache
    from .moe import MoE
    from .row_cache import RowCache
    from .streamed_ops import key_of

    readers: dict[str, dict[int, dict[str, object]]] = {}
    chain: list[ExpertCache] = []
    for name, read in stream.items():
        if routed_expert(name):
            module, expert, proj = routed_expert(name)
            readers.setdefault(module, {}).setdefault(expert, {})[proj] = read
    for path, m in model.named_modules():
        if isinstance(m, RowCache):
            m.read = stream[f"{path}.weight"]
            model.streamed_rows[int(path.split(".")[1])] = m
            # what the operators take (streamed_ops): plain tensor attributes, which a compiled region's graph reads
            # as its layer's own, as it reads buffers, without their bytes counting as weights
            probe = m.held(torch.zeros(1, dtype=torch.long))  # the dtype and width of the rows it gives
            m.like = probe.new_empty(0, probe.shape[-1])
            m.cache_key = key_of(m)
        if isinstance(m, MoE) and m.experts.n_experts < m.gate.weight.shape[0]:
            n = m.gate.weight.shape[0]
            m.expert_cache = ExpertCache(m.experts, n, readers[f"{path}.experts"], list(range(m.experts.n_experts)),
                                         policy)
            m.cache_key = key_of(m.expert_cache)
            if path.startswith("layers."):  # a forward's streamed layers in order: each reads ahead for the next
                if chain:
                    chain[-1].next, chain[-1].next_gate = m.expert_cache, m.gate
                chain.append(m.expert_cache)


def hold_as_stored(model: Transformer, path: Path) -> list[str]:
    """Make the float32 parameters of :data:`KEEP_STORED` that ``path`` stores in bfloat16 (and that hold at least
    :data:`KEEP_STORED_MIN_ELEMENTS` values) bfloat16, before anything is allocated (``model`` on ``meta``), so the
    loader maps or copies their stored bytes as they are; where the CPU kernels that read bfloat16 panels are not
    available, none (each step would convert them). Returns their names."""
    from . import cpu_kernels
    from .checkpoint import stored_dtypes

    params = dict(model.named_parameters())
    held = [name for name, dtype in stored_dtypes(path, KEEP_STORED).items()
            if dtype == "BF16" and (p := params.get(name)) is not None and p.dtype == torch.float32
            and p.numel() >= KEEP_STORED_MIN_ELEMENTS]
    if not held or not cpu_kernels.dense_rows_available():  # without the kernels each step would convert the head
        return []
    for name in held:
        p = params[name]
        p.data = torch.empty(p.shape, dtype=torch.bfloat16, device=p.device)
    return held


def _load_weights(model: Transformer, path: Path, cfg: ModelConfig, strict: bool, mmap: bool,
                  stream: dict | None = None) -> None:
    """Load a checkpoint folder into ``model`` (mapping what it can with ``mmap``; the report is
    ``model.load_report``); drop the drafters and zero ``bias_vl`` where the folder leaves them out (each said
    once in the log)."""
    from .checkpoint import BIAS_VL, DRAFTERS, VISION, LoadReport, load_checkpoint
    from .mapped import MappedFiles

    dest = model.checkpoint_tensors()
    maps = MappedFiles() if mmap else None
    model.load_report = LoadReport()
    omitted = load_checkpoint(dest, path, cfg, strict=strict, maps=maps, report=model.load_report, stream=stream)
    if maps is not None and maps.maps:
        model._mapped_files = maps  # the maps live as long as the model
    if DRAFTERS in omitted:
        model.mtp = None
        log.info("%s has no MTP/DSpark weights: the drafters are disabled", path)
    if VISION in omitted:
        model.drop_vision()
        log.info("%s has no vision tower: it serves text, and requests with images are refused", path)
    if BIAS_VL in omitted:
        with torch.no_grad():
            for name in omitted[BIAS_VL]:
                dest[name].zero_()
        log.info("%s has no router bias_vl: set to zero (only image positions use it)", path)


def _engram_map_from_folder(model: Transformer, path: Path) -> None:
    """Set the engram class map from the folder's tokenizer, so the reference forward hashes as the engine."""
    hasher = model.engram_hasher
    if hasher is not None and hasher.needs_token_map:
        tokenizer_file = path / "tokenizer.json"
        if tokenizer_file.exists():
            from tokenizers import Tokenizer as HFTokenizer

            from .engram import compressed_token_map

            hasher.set_token_map(*compressed_token_map(HFTokenizer.from_file(str(tokenizer_file))))
        else:
            log.warning("%s has no tokenizer.json: engram hashes raw token ids until a tokenizer's class map "
                        "is set (the engine sets it from the tokenizer it loads)", path)


def _formats(path_or_preset: str | Path, is_preset: bool, quantization: str | None, cfg: ModelConfig) -> dict:
    """Module path -> packed format: the asked method's plan, else the checkpoint's tensors as they are stored
    (presets are float)."""
    from .packed import QUANTIZATIONS, plan, plan_as_stored

    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)} "
                          "(or leave it unset to keep a checkpoint's weights as stored)")
    if quantization is not None and (quantization != W4A8 or is_preset):
        return plan(cfg, quantization)
    if is_preset:
        return {}
    from .checkpoint import packed_dtypes

    stored = plan_as_stored(cfg, packed_dtypes(path_or_preset))
    if quantization == W4A8 and not any(f.name == MXFP4 for path, f in stored.items() if path.endswith(".experts")):
        return plan(cfg, W4A8)  # a checkpoint whose experts are not stored as MXFP4: packed as mxfp4 packs them
    return stored


def load_model(path_or_preset: str | Path, *, dtype: str | torch.dtype = torch.float32, device: str = "cpu",
               fake_quant: bool | None = None, seed: int = 0, with_mtp: bool = True,
               quantization: str | None = None, prepare=None, mmap: bool = True, experts_in_place: bool | None = None,
               mlock: bool = False,
               weight_memory: int | None = None, expert_cache_policy: str = "lru",
               gpu_experts: int | None = None) -> Transformer:
    """Build the model for a preset (seeded random weights) or a checkpoint folder (weights loaded).

    ``fake_quant`` switches the QAT quantisation points on (default: on for V4.1, off for V4): V4.1's FP8
    window rows and FP4 main/index rows (docs/architecture.md#numerics-and-quantisation-points); V4's FP8 KV on non-RoPE
    dims and Hadamard+FP4 indexer (spec Appendix A).
    ``quantization``: unset keeps a checkpoint's weights as stored (FP8 blocks and MXFP4 experts stay packed;
    float checkpoints and presets stay float); ``"int8"``, ``"w8a8"``, ``"fp8"`` or ``"mxfp4"`` packs float
    weights at load (see :func:`flashserve.model.packed.plan`); ``"float"`` unpacks everything (the reference
    path); ``"w4a8"`` keeps MXFP4 experts as stored (packing float ones as ``mxfp4`` does) and multiplies them
    by activations quantized to 8 bits (:func:`activations_in_8_bits`).
    Shards are streamed into the model's parameters one tensor at a time; packed weights never exist as floats.
    ``prepare(model)`` (checkpoint folders only) runs on the still-empty ``meta`` model before anything is
    allocated or read: an expert-parallel rank keeps its experts there (``Experts.first``), so only their
    tensors are read from the files (the others are skipped).
    ``mmap`` (checkpoint folders on the CPU; llama.cpp's default, ``--no-mmap`` there and here turns it off): the
    safetensors files are memory-mapped and every tensor whose stored bytes are what the model holds (FP8 blocks
    kept packed, float tensors of the compute dtype, engram tables) is used where it lies, read from the disk when
    first touched, and so are large MXFP4 experts, one matrix an expert (:mod:`flashserve.model.mapped_experts`);
    the rest (decoded or quantized weights, small experts stacked per layer) is copied. A float32 model on the CPU
    holds large bfloat16 token embeddings and LM head as stored, mapped or copied (:func:`hold_as_stored`).
    ``experts_in_place`` (default: ``mmap``): whether large MXFP4 experts are held one matrix an expert where they
    lie; False with ``mmap`` maps what it can in the module layout of ``mmap=False`` (a compile child of an engine
    that copies its weights: the same graphs, no second copy).
    ``mlock``: the weights' pages are read in and locked in RAM (llama.cpp's ``--mlock``); a failure (the
    ``RLIMIT_MEMLOCK`` limit) is logged and loading goes on. ``model.load_report`` says what was mapped and copied.
    ``weight_memory`` (bytes; checkpoint folders): the weights' resident budget. The weights other than the routed
    experts and the engram tables are held whole; the engram tables keep a sixteenth of the rest (:data:`ROW_SHARE`)
    in row caches that read missing rows from the files (:mod:`flashserve.model.row_cache`), and each MoE layer holds
    as many experts as the remainder allows, in slots, reading the others when the router picks them
    (:mod:`flashserve.model.expert_cache`, evicting by ``expert_cache_policy``: "lru" or "lfu"). A budget below the
    other weights plus top-k experts a layer and the least row caches is refused, with the least that would do.
    ``gpu_experts`` (a device other than the CPU; tests pass ``device="cpu"`` to run both sides there): the model is
    loaded in host memory (mapped), then everything but the routed experts goes to ``device``, where each MoE layer
    holds that many experts; the others are computed on the host (:mod:`flashserve.model.hybrid`), and the engram
    tables stay in host memory too (:mod:`flashserve.model.engram_host`).
    """
    from .packed import pack_model
    from ..gguf import is_gguf_path

    if is_gguf_path(path_or_preset):  # a DeepSeek-V4 GGUF: flashserve.model.gguf_weights, the same options
        from .gguf_weights import load_gguf_model

        return load_gguf_model(path_or_preset, dtype=dtype, device=device, fake_quant=fake_quant, seed=seed,
                               with_mtp=with_mtp, quantization=quantization, prepare=prepare, mmap=mmap,
                               experts_in_place=experts_in_place, mlock=mlock, weight_memory=weight_memory,
                               expert_cache_policy=expert_cache_policy, gpu_experts=gpu_experts)
    name = str(path_or_preset)
    cfg: ModelConfig = load_config(path_or_preset)
    is_preset = name in PRESET_JSON
    if is_preset and name not in RUNNABLE_PRESETS:
        raise ConfigError(f"preset {name!r} has the real model's dimensions and is for arithmetic and planning "
                         f"only; runnable presets: {', '.join(RUNNABLE_PRESETS)}")
    torch_dtype = resolve_dtype(dtype)
    if gpu_experts is not None:
        if isinstance(gpu_experts, bool) or not isinstance(gpu_experts, int) or gpu_experts < 1:
            raise ConfigError(f"gpu_experts: must be an integer >= 1, got {gpu_experts!r}")
        if weight_memory is not None:
            raise ConfigError("gpu_experts and weight_memory cannot be combined: the host holds every expert of a "
                              "hybrid model")
        model = load_model(path_or_preset, dtype=dtype, device="cpu", fake_quant=fake_quant, seed=seed,
                           with_mtp=with_mtp, quantization=quantization, prepare=prepare, mmap=mmap, mlock=mlock)
        return _hybrid(model, gpu_experts, device)
    formats = _formats(path_or_preset, is_preset, quantization, cfg)
    with torch.device("meta"):
        model = Transformer(cfg, with_mtp=with_mtp)
    model.to(torch_dtype)
    keep_fp32(model)  # before any weight is written, so the fp32 leaves are never rounded to ``dtype``
    if weight_memory is not None and is_preset:
        raise ConfigError("weight_memory streams weights from a checkpoint folder; a preset has none (its "
                          "weights are drawn in memory)")
    if weight_memory is not None and torch.device(device).type != "cpu":
        raise ConfigError(f"weight_memory streams routed experts into host memory for CPU steps; on {device} "
                          "hold the experts that fit there with gpu_experts (the others run on the host), or "
                          "load on the CPU (device=cpu)")
    spent, rows = None, {}
    streamed = False
    if not is_preset:
        pack_model(model, formats, quantize=False, compute_dtype=torch_dtype)  # still on meta: no float copy
        if torch_dtype == torch.float32 and torch.device(device).type == "cpu" and prepare is None:
            hold_as_stored(model, Path(path_or_preset))  # what stays a float parameter after packing
        if prepare is not None:
            prepare(model)
        if weight_memory is not None:
            spent, rows = _budget(model, weight_memory)
            streamed = spent.slots is not None or bool(rows)
        elif (mmap if experts_in_place is None else experts_in_place) and prepare is None and \
                torch.device(device).type == "cpu":
            from .mapped_experts import use_in_place

            use_in_place(model)  # large MXFP4 experts used where they lie, one matrix an expert
    model = model.to_empty(device=device)
    for module in model.modules():  # buffers computed, never loaded (rope, engram hashing, packed tables)
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    if is_preset:
        random_init(model, seed)
        pack_model(model, formats, quantize=True, compute_dtype=torch_dtype)
    else:
        stream = {} if streamed else None
        _load_weights(model, Path(path_or_preset), cfg, strict=with_mtp and prepare is None,
                      mmap=mmap and torch.device(device).type == "cpu", stream=stream)
        if stream is not None:
            _attach_caches(model, stream, expert_cache_policy)
    if spent is not None:
        log.info("weights of %s: %s%s", path_or_preset, spent.describe(),
                 "" if spent.slots is None else f"; the others read when routed, evicting the "
                 f"{'least recently used' if expert_cache_policy == 'lru' else 'least used'}")
    if not is_preset:
        _engram_map_from_folder(model, Path(path_or_preset))
    model.fake_quant = cfg.is_v41 if fake_quant is None else bool(fake_quant)
    model.weight_memory = weight_memory
    model.weight_budget = spent  # the engine's plan makes only the copies the budget holds
    if mlock:
        from .mapped import lock_weights

        locked, failed = lock_weights(model)
        if failed:
            log.warning("--mlock: %s; %d bytes locked, the rest may be paged out", failed, locked)
        if hasattr(model, "load_report"):
            model.load_report.locked = locked
    if quantization == W4A8:
        activations_in_8_bits(model)
    if hasattr(model, "load_report"):
        log.info("%s: %s", name, model.load_report.describe())
    return model.eval()
