"""The compiled decode step as regions: one compiled graph per kind of layer half, not one graph for the whole step.

A step is a prologue (embedding, streams, engram rows), each layer's attention half and MoE half, and an epilogue
(collapse, norm, head). Each is a *region*: a function of the step's tensors and one instance's weights and cache
tensors. Regions of the same kind (:func:`kinds`: the same module structure, attribute values and weight shapes,
and the same place among the layers that share caches and index selections) share one compiled graph. Dynamo
traces a kind once, through its first instance (the *representative*); every other instance calls that graph with
its own tensors in place of the representative's (:class:`RegionCall`), matched by their names within the
instance. Cold compile time then follows the number of kinds, not of layers
(docs/engine-speed.md#regions-one-compiled-graph-per-kind-of-layer).

Every call of a planned region skips dynamo (no guards, no argument gathering): :class:`BoundCall` calls the
compiled graph with the instance's tensors and the step's inputs. A region dynamo could not plan (an argument that is neither
an input, a tensor of the instance, nor a tensor shared by all instances) runs through dynamo for every instance,
which is correct but compiles each instance.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ...model.norms import fp32
from ..fixed_state import FixedBatchState
from .weight_arena import weight_tensors

log = logging.getLogger("flashserve.engine")

# attributes that name a layer rather than describe it: never part of a kind (the relations they imply are, as
# :func:`layer_relations` states them)
IDENTITY = frozenset({"layer", "main_key", "index_key", "src_main", "src_index"})
PLAIN = (int, float, bool, str, type(None))


def named_tensors(root: Any, prefix: str, depth: int = 6) -> dict[str, torch.Tensor]:
    """Tensors reachable from ``root`` (modules' parameters, buffers and tensor attributes; objects' attributes,
    lists, tuples, dicts and functions' closures) by a path that is the same in every object of the same
    structure; a tensor reached twice keeps its first path."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str, d: int) -> None:
        if id(obj) in seen or d > depth:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out[path] = obj
        elif isinstance(obj, nn.Module):
            for name, t in (*obj.named_parameters(), *obj.named_buffers()):
                walk(t, f"{path}.{name}", d + 1)
            for name, m in obj.named_modules():
                for k, v in vars(m).items():
                    if isinstance(v, torch.Tensor):
                        walk(v, f"{path}.{name}.{k}", d + 1)
        elif isinstance(obj, (list, tuple)):
            for k, v in enumerate(obj):
                walk(v, f"{path}[{k}]", d + 1)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}[{k!r}]", d + 1)
        elif callable(obj) and getattr(obj, "__closure__", None):
            for k, c in enumerate(obj.__closure__):
                walk(c.cell_contents, f"{path}<{k}>", d + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not isinstance(obj, PLAIN):
            for k, v in vars(obj).items():
                walk(v, f"{path}.{k}", d + 1)

    walk(root, prefix, 0)
    return out


def fingerprint(module: nn.Module) -> tuple:
    """What a compiled graph of ``module``'s code may have taken as constants: each submodule's type, its plain
    attribute values (numbers, strings, flags, tuples of them; not the ones naming its layer) and the shape,
    dtype and strides of each of its tensors. Two modules with equal fingerprints run the same graph."""
    out: list = []
    for name, m in module.named_modules():
        out.append((name, type(m).__qualname__))
        for k, v in sorted(vars(m).items()):
            if k in IDENTITY or k in ("_parameters", "_buffers", "_modules") or k.startswith("_forward"):
                continue
            if isinstance(v, torch.Tensor):
                out.append((name, k, tuple(v.shape), v.dtype, v.stride()))
            elif isinstance(v, PLAIN) or (isinstance(v, tuple) and all(isinstance(e, PLAIN) for e in v)):
                out.append((name, k, v))
        for k, t in (*m._parameters.items(), *m._buffers.items()):
            out.append((name, k, None if t is None else (tuple(t.shape), t.dtype, t.stride())))
    return tuple(out)


def layer_relations(cfg, layer: int) -> tuple:
    """Where ``layer`` sits among the layers that share caches and selections, in terms that hold for every layer
    of a kind: whether it writes the compressed cache it reads, whether it selects entries for itself (an index
    source) or reuses another layer's selection, and whether it makes or reads V4.1's candidate pool."""
    if cfg.compress_ratios[layer] == 0:
        return ("window",)
    src, isrc, cand = cfg.kv_source(layer), cfg.index_source(layer), cfg.candidate_source_layer_id
    return (src == layer, None if isrc is None else isrc == layer,
            "source" if layer == cand else ("reader" if 0 <= cand < layer else None))


@dataclass(frozen=True)
class Slot:
    """Where a compiled graph's argument comes from at each call: an input of the region (``input``), a size of
    one (``input``, ``dim``), a tensor of the instance by name (``name``), or the same value for every instance."""

    input: int | None = None
    dim: int | None = None
    name: str | None = None
    value: Any = None


class RegionPlan:
    """One compiled graph of a region kind for inputs of one shape: its argument slots and where the region's
    outputs are among the graph's."""

    def __init__(self, compiled: Callable, slots: list[Slot], outputs: list[int | None]):
        self.compiled, self.slots, self.outputs = compiled, slots, outputs

    @classmethod
    def make(cls, call: tuple, inputs: tuple, input_names: tuple[str, ...], result: tuple, names: dict[int, str],
             foreign: set[int]) -> "RegionPlan | None":
        """From the one graph call a region's dynamo call made (``call``: graph module, compiled graph, arguments,
        outputs); None where an argument or output cannot be placed. ``input_names``: the region function's names
        of ``inputs``; ``names``: the representative's tensors by id -> name; ``foreign``: ids of other instances'
        tensors (an argument among them cannot be shared)."""
        gm, compiled, args, out = call
        holders = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        if len(holders) != len(args):
            return None
        given = {id(t): j for j, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
        dims = {}  # a symbolic size -> (input, dim): as dynamo says where it took it, or as an input's shape has it
        for value, src in zip(holders, gm.meta.get("size_sources", ())):
            if isinstance(value, torch.SymInt) and src is not None and src[0] in input_names:
                dims.setdefault(value.node.expr, (input_names.index(src[0]), src[1]))
        for k, a in enumerate(args):
            j = given.get(id(a)) if isinstance(a, torch.Tensor) else None
            if j is not None:
                for d, size in enumerate(getattr(holders[k], "shape", ())):
                    if isinstance(size, torch.SymInt):
                        dims.setdefault(size.node.expr, (j, d))
        slots = []
        for k, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                if id(a) in given:
                    slots.append(Slot(input=given[id(a)]))
                elif id(a) in names:
                    slots.append(Slot(name=names[id(a)]))
                elif id(a) in foreign:
                    return None
                else:  # a tensor no layer owns (the RoPE tables, a codec's table): the same for every instance
                    slots.append(Slot(value=a))
            elif isinstance(holders[k], torch.SymInt):
                if holders[k].node.expr not in dims:
                    return None
                j, d = dims[holders[k].node.expr]
                slots.append(Slot(input=j, dim=d))
            elif isinstance(a, (int, float, bool)) or a is None:
                slots.append(Slot(value=a))
            else:  # a Python object (w8a8's packed weights): dynamo's call gathers it per instance
                return None
        if not isinstance(out, (list, tuple)):
            return None
        outputs = []
        for r in result:
            if r is None:
                outputs.append(None)
                continue
            k = next((k for k, o in enumerate(out) if o is r), None)
            if k is None:
                return None
            outputs.append(k)
        return cls(compiled, slots, outputs)

    def bind(self, tensors: dict[str, torch.Tensor]) -> "BoundCall | None":
        """This graph with one instance's tensors (None: the instance lacks one of them)."""
        args, fill = [], []
        for k, s in enumerate(self.slots):
            if s.name is not None:
                if s.name not in tensors:
                    return None
                args.append(tensors[s.name])
            elif s.input is not None:
                args.append(None)
                fill.append((k, s.input, s.dim))
            else:
                args.append(s.value)
        return BoundCall(self.compiled, args, fill, self.outputs)


class BoundCall:
    """A compiled graph called for one instance: its fixed arguments kept, the region's inputs (or their sizes)
    put in at each call."""

    __slots__ = ("compiled", "args", "fill", "outputs")

    def __init__(self, compiled: Callable, args: list, fill: list[tuple[int, int, int | None]],
                 outputs: list[int | None]):
        self.compiled, self.args, self.fill, self.outputs = compiled, args, fill, outputs

    def __call__(self, inputs: tuple) -> tuple:
        args = self.args.copy()
        for k, j, d in self.fill:
            args[k] = inputs[j] if d is None else inputs[j].shape[d]
        out = self.compiled(*args)
        return tuple(None if k is None else out[k] for k in self.outputs)


class RegionCall:
    """Every instance of one region kind: ``fn(instance objects..., *inputs)`` compiled through the representative
    (the first instance called for a shape), then called directly for each instance with its own tensors."""

    def __init__(self, name: str, fn: Callable, compile_fn: Callable, recorder, foreign: set[int]):
        self.name, self.recorder, self.foreign = name, recorder, foreign
        self.compiled = compile_fn(fn)
        self.input_names = tuple(inspect.signature(fn).parameters)  # objects first, then the inputs
        self.representative: tuple | None = None
        self._names: dict[int, dict[str, torch.Tensor]] = {}  # instance -> its tensors by name
        self._plans: dict[tuple, RegionPlan | None] = {}  # input shapes -> the representative's graph
        self._bound: dict[tuple, BoundCall | None] = {}  # (instance, input shapes) -> its call
        self.unplanned = False  # a graph could not be planned: each instance runs through dynamo

    def plan(self, key: tuple) -> RegionPlan | None:
        """The representative's graph for inputs ``key`` (None: not compiled, or not planned)."""
        return self._plans.get(key)

    def install(self, key: tuple, plan: RegionPlan) -> None:
        """Use ``plan`` (a graph compiled elsewhere, :mod:`.step_artifacts`) for inputs ``key``: every instance
        calls it directly, dynamo never runs for that key."""
        self._plans[key] = plan
        for k in [k for k in self._bound if k[1] == key]:
            del self._bound[k]

    def add(self, instance: int, objects: tuple, tensors: dict[str, torch.Tensor]) -> None:
        if self.representative is None:
            self.representative = (instance, objects)
        self._names[instance] = tensors

    def __call__(self, instance: int, objects: tuple, inputs: tuple, key: tuple, dynamic: Callable) -> tuple:
        bound = self._bound.get((instance, key))
        if bound is not None:
            return bound(inputs)
        rep = self.representative[0]
        if key not in self._plans:
            if instance != rep:  # the step calls each kind's representative (its first layer) first
                raise RuntimeError(f"region {self.name}: instance {instance} called before its representative "
                                   f"{rep} for inputs {key}")
            dynamic(inputs)
            self.recorder.calls.clear()
            result = self.compiled(*objects, *inputs)
            result = result if isinstance(result, tuple) else (result,)
            calls = list(self.recorder.calls)
            names = {id(t): n for n, t in self._names[instance].items()}
            plan = (RegionPlan.make(calls[0], inputs, self.input_names[len(objects):], result, names, self.foreign)
                    if len(calls) == 1 else None)
            self._plans[key] = plan
            if plan is None:
                self.unplanned = True
                log.warning("compiled region %s for inputs %s runs through dynamo: its graph could not be planned "
                            "as a direct call", self.name, key)
            else:
                self._bound[(instance, key)] = plan.bind(self._names[instance])
            return result
        plan = self._plans[key]
        bound = None if plan is None else plan.bind(self._names[instance])
        self._bound[(instance, key)] = bound
        if bound is None:
            dynamic(inputs)
            result = self.compiled(*objects, *inputs)
            return result if isinstance(result, tuple) else (result,)
        return bound(inputs)


# ------------------------------------------------------------------ the regions of a decode step
def _prologue(model, cache, ids, start, slots, table):
    x, pre, _, engram = model.begin(ids, FixedBatchState(cache, slots, table), start=start)
    return x, pre, engram


def _engram(model, block, x, rows, ids):
    return (block.engram(x, rows, model.image_mask(ids)),)


def _attention(model, cache, block, x, pre, ids, start, slots, table, sel_idx, sel_valid, cand, cand_blocks):
    """A layer's attention half; what it publishes for later layers (its index selection, the candidate pool)
    comes back as outputs, what earlier layers published comes in as inputs."""
    ctx = model.context(ids, FixedBatchState(cache, slots, table), start)
    cfg = model.cfg
    if sel_idx is not None:
        ctx.topk[cfg.index_source(block.layer)] = (sel_idx, sel_valid)
    ctx.candidates, ctx.candidate_blocks = cand, cand_blocks
    x, attn_pre = block.attend(x, pre, ctx)
    made = block.layer == cfg.candidate_source_layer_id
    sel_idx, sel_valid = ctx.topk.get(block.layer, (None, None))
    return (x, attn_pre, sel_idx, sel_valid, ctx.candidates if made else None,
            ctx.candidate_blocks if made else None)


def _feed_forward(model, block, x, attn_pre, ids):
    return block.feed_forward(x, attn_pre, ids, model.image_mask(ids))


def _epilogue(model, x, pre):
    return (model.logits_from_streams(x, pre),)


ENGRAM_PARTS = ("engram",)
ATTENTION_PARTS = ("attn_norm", "attn", "hc_attn")
FFN_PARTS = ("ffn_norm", "ffn", "hc_ffn")
HALVES = (ENGRAM_PARTS, ATTENTION_PARTS, FFN_PARTS)  # a layer's regions, each with weight arenas of its own


def _part(block: nn.Module, parts: tuple[str, ...]) -> nn.Module:
    """A module holding only ``parts`` of ``block`` (submodules and parameters by name prefix), for its kind."""
    holder = nn.Module()
    for name, m in block.named_children():
        if name.startswith(parts):
            holder.add_module(name, m)
    for name, p in block.named_parameters(recurse=False):
        if name.startswith(parts):
            holder.register_parameter(name, p)
    for k, v in vars(block).items():  # flags, and tensor attributes of the part (panel copies of its weights);
        # None is an absent submodule (an engram), told by the part's modules
        if k not in IDENTITY and not k.startswith("_") and v is not None and (
                isinstance(v, PLAIN) or (isinstance(v, torch.Tensor) and k.startswith(parts))):
            setattr(holder, k, v)
    return holder


def _layout(block: nn.Module, parts: tuple[str, ...]) -> tuple[int, ...]:
    """Where each weight of a part lies in its storage: in the layer's weight arenas, the same for every layer of
    a kind (a graph reads each weight at a fixed offset of an arena)."""
    return tuple(t.storage_offset() for _, _, t in weight_tensors(block, parts=parts))


class RegionalStep:
    """A decode step's forward as regions (:mod:`this module <.regions>`): compiled per kind, called per instance."""

    def __init__(self, model, cache, compile_fn: Callable, recorder, *, capture: tuple[int, ...] = (),
                 streams: bool = False):
        self.model, self.cache, self.capture, self.streams = model, cache, capture, streams
        self.backend, self.recorder = recorder.backend, recorder
        cfg = model.cfg
        storage = cache.storage.layers

        def arenas(block: nn.Module, parts: tuple[str, ...]) -> dict[str, torch.Tensor]:
            return {f"arena.{a.dtype}": a for a in block.__dict__.get("_weight_arenas", {}).get(parts, ())}

        def tensors(i: int, parts: tuple[str, ...]) -> dict[str, torch.Tensor]:
            """Layer ``i``'s tensors a region of ``parts`` may read, by name: its arenas first, then each weight,
            then (attention) its cache and its source's."""
            block = model.layers[i]
            out = {**arenas(block, parts), **named_tensors(block, "block")}
            if parts == ATTENTION_PARTS:
                out.update(named_tensors(storage[i], "own"))
                if cfg.kv_source(i) not in (None, i):
                    out.update(named_tensors(storage[cfg.kv_source(i)], "source"))
            return out

        owned = [[tensors(i, parts) for parts in HALVES] for i in range(len(model.layers))]
        foreign = {id(t) for halves in owned for names in halves for t in names.values()}
        self.kinds: dict[tuple, RegionCall] = {}

        def region(name: str, fn: Callable, kind: tuple, instance: int, objects: tuple,
                   names: dict[str, torch.Tensor]) -> RegionCall:
            call = self.kinds.get(kind)
            if call is None:
                call = self.kinds[kind] = RegionCall(name, fn, compile_fn, recorder, foreign)
            call.add(instance, objects, names)
            return call

        def kind(block: nn.Module, parts: tuple[str, ...], *more) -> tuple:
            return (parts, fingerprint(_part(block, parts)), _layout(block, parts), *more)

        self.prologue = region("prologue", _prologue, ("prologue",), 0, (model, cache), {})
        self.epilogue = region("epilogue", _epilogue, ("epilogue",), 0, (model,), {})
        # per layer: (its block, the layer whose selection it reuses or None, engram region or None, attention
        # region, MoE region), made once: a step only looks them up
        self.layers = []
        for i, block in enumerate(model.layers):
            engram = None if block.engram is None else region(
                f"engram of layer {i}", _engram, kind(block, ENGRAM_PARTS), i, (model, block), owned[i][0])
            attn = region(f"attention of layer {i}", _attention, kind(block, ATTENTION_PARTS, layer_relations(cfg, i)),
                          i, (model, cache, block), owned[i][1])
            ffn = region(f"feed-forward of layer {i}", _feed_forward, kind(block, FFN_PARTS), i, (model, block),
                         owned[i][2])
            src = cfg.index_source(i)
            self.layers.append((block, src if src != i else None, engram, attn, ffn))

    def __call__(self, ids: torch.Tensor, start: torch.Tensor, slots: torch.Tensor,
                 table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B,R,V] and the captured features [B,R,len(capture),D] or final streams (None without either)."""
        cfg, model, cache = self.model.cfg, self.model, self.cache
        key = (*ids.shape, table.shape[1])  # each region's graph and plan for these input shapes

        def dynamic(inputs: tuple) -> None:  # one graph for every batch size from 2 and every context length
            if ids.shape[0] > 1:
                for t in inputs:
                    if isinstance(t, torch.Tensor) and t.dim():
                        torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(table, 1)

        x, pre, engram = self.prologue(0, (model, cache), (ids, start, slots, table), key, dynamic)
        model.prefetch_rows(engram)  # streamed engram rows: read on the host while the first layers run
        shifted = cfg.shifted_collapse
        sel: dict[int, tuple] = {}
        cand = (None, None)
        feats = []
        for i, (block, src, eng, attn, ffn) in enumerate(self.layers):
            if i in self.capture:
                feats.append(fp32(x).mean(-2))
            if eng is not None:  # its rows contiguous: a view's strides would be sizes of their own
                x, = eng(i, (model, block), (x, model.engram_rows(engram, i).contiguous(), ids), key, dynamic)
            s = sel.get(src, (None, None))
            inputs = (x, pre if shifted else None, ids, start, slots, table, *s, *cand)
            x, attn_pre, si, sv, c, cb = attn(i, (model, cache, block), inputs, key, dynamic)
            if si is not None:
                sel[i] = (si, sv)
            if c is not None or cb is not None:
                cand = (c, cb)
            x, pre = ffn(i, (model, block), (x, attn_pre, ids), key, dynamic)
        logits, = self.epilogue(0, (model,), (x, pre if shifted else None), key, dynamic)
        if self.capture:
            return logits, torch.stack(feats, dim=2)
        return logits, (x if self.streams else None)

    def shared_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors a graph may read that no layer owns (the RoPE tables, a codec's table, the prologue's and
        epilogue's weight arenas) by a name that is the same in every process that builds the same step."""
        out: dict[str, torch.Tensor] = {}
        for parts, arenas in self.model.__dict__.get("_weight_arenas", {}).items():
            for i, a in enumerate(arenas):
                out[f"model.arena[{parts}][{i}]"] = a
        seen = {id(t) for t in out.values()}
        for name, t in (*named_tensors(self.model, "model").items(), *named_tensors(self.cache, "cache").items()):
            if id(t) not in seen:
                seen.add(id(t))
                out[name] = t
        return out

    def describe(self) -> str:
        """What is compiled, in words: the kinds of region, the layers they serve and where inductor keeps them."""
        where = ""
        if self.backend == "inductor":
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            where = f"; inductor's cache: {cache_dir()}"
        kinds = len(self.kinds) - 2
        return (f"{kinds} kinds of layer region (engram, attention, MoE) for {len(self.layers)} layers, a prologue "
                f"and an epilogue ({self.backend}{where})")

    def planned(self) -> bool:
        """Whether every region's graphs are called directly (none runs through dynamo per instance)."""
        return not any(k.unplanned for k in self.kinds.values())
