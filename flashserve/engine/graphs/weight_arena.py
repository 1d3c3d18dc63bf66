"""Weights in one buffer per dtype, and compiled graphs that take those buffers instead of each weight.

Inductor's C++ wrapper turns every input of a compiled graph into a tensor handle at every call: ~0.6 us an
input on the machines measured here (a compiled function of 391 inputs took 255 us a call, the same work
from 2 inputs 20 us). A decode step's inputs are mostly the model's weights, which never change after start-up.
Each layer's weights are moved into buffers of its own, one per dtype (:func:`pack_weights`), laid out in the
order of its modules, so layers of one kind (the same modules, shapes and dtypes) hold each weight at the same
offset of their buffers; :func:`regroup_inputs` rewrites a graph dynamo made so that it takes the buffers and
reads each weight as a fixed view of one, which then serves every layer of the kind. Inductor folds a view's
offset into its kernels' indexing, so a call makes a handful of handles for the weights instead of one each.
"""

from __future__ import annotations

import torch
from torch import nn

ALIGN = 64  # bytes: each storage starts on a cache line, as the allocator's own blocks do


@torch.no_grad()
def pack_weights(model: nn.Module, skip: tuple[nn.Module, ...] = (),
                 parts: tuple[str, ...] | None = None) -> list[torch.Tensor]:
    """Move every parameter and buffer of ``model`` (CPU tensors; not those of the modules in ``skip``; with
    ``parts``, only those whose name starts with one of them) into one buffer per dtype, in the order of its
    modules, each tensor re-pointed at a view of it with its shape, strides and values; tensors that shared a
    storage still share one. Returns the buffers. Each storage is copied and then released (unless something else
    holds it), so memory peaks at the model plus its largest storage: a new buffer's pages are touched only as
    they are filled. Tensors packed before keep their buffers (two engines over one model)."""
    packed = model.__dict__.setdefault("_weight_arenas", {})
    done = packed.get(parts)
    if done is not None and all(_within(t, done) for _, _, t in weight_tensors(model, skip, parts)):
        return done
    arenas = []
    for dtype, storages in _by_dtype(model, skip, parts).items():
        size = torch.empty((), dtype=dtype).element_size()
        line = max(ALIGN // size, 1)
        starts, total = [], 0
        for storage, _ in storages:
            starts.append(total)
            total += -(-storage.nbytes() // size // line) * line
        arena = torch.empty(total, dtype=dtype)
        raw = arena.view(torch.uint8)
        for j, start in enumerate(starts):
            storage, users = storages[j]
            storages[j] = None  # the last reference of ours, so the old storage goes once its users are moved
            raw[start * size:start * size + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            del storage
            for module, name, shape, stride, offset in users:
                _repoint(module, name, arena.as_strided(shape, stride, start + offset))
        arenas.append(arena)
    packed[parts] = arenas
    return arenas


def _by_dtype(model: nn.Module, skip: tuple[nn.Module, ...], parts: tuple[str, ...] | None
              ) -> dict[torch.dtype, list[list]]:
    """The storages of ``model``'s tensors by dtype, each ``[storage, [(module, name, shape, stride, offset)]]``
    (a storage read as two dtypes is left out: it stays where it is)."""
    groups: dict[int, list] = {}  # storage address -> [storage, users, dtypes]
    for module, name, t in weight_tensors(model, skip, parts):
        group = groups.setdefault(t.untyped_storage().data_ptr(), [t.untyped_storage(), [], set()])
        group[1].append((module, name, t.shape, t.stride(), t.storage_offset()))
        group[2].add(t.dtype)
    out: dict[torch.dtype, list[list]] = {}
    for storage, users, dtypes in groups.values():
        if len(dtypes) == 1:
            out.setdefault(dtypes.pop(), []).append([storage, users])
    return out


def weight_tensors(model: nn.Module, skip: tuple[nn.Module, ...] = (), parts: tuple[str, ...] | None = None
             ) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, name, tensor) of every non-empty CPU parameter and buffer, not those of ``skip``'s modules, and
    with ``parts`` only those whose name within ``model`` starts with one of them."""
    skipped = {id(m) for s in skip for m in s.modules()}
    out = []
    for path, module in model.named_modules():
        if id(module) in skipped:
            continue
        for kind in (module._parameters, module._buffers):
            for name, t in kind.items():
                full = f"{path}.{name}" if path else name
                if t is not None and t.device.type == "cpu" and t.numel() and (parts is None or full.startswith(parts)):
                    out.append((module, name, t))
    return out


def _within(t: torch.Tensor, arenas: list[torch.Tensor]) -> bool:
    return any(t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() for a in arenas)


def _repoint(module: nn.Module, name: str, view: torch.Tensor) -> None:
    if name in module._parameters:
        module._parameters[name].data = view  # the same Parameter object, its data moved
    else:
        module._buffers[name] = view


def regroup_inputs(gm: torch.fx.GraphModule, example_inputs: list, arenas: list[torch.Tensor]
                   ) -> tuple[torch.fx.GraphModule, list[int], list[torch.Tensor]] | None:
    """A copy of ``gm`` (a graph dynamo made, called with ``example_inputs``) in which every input that is a view
    of one of ``arenas`` is a fixed ``as_strided`` view of that arena, the positions of the inputs it keeps and
    the arenas it reads: call it with ``(*used, *(args[i] for i in keep))``. None where no input lies in an
    arena. (``gm`` itself stays as it is: dynamo reads its inputs afterwards.)"""
    where = {a.untyped_storage().data_ptr(): k for k, a in enumerate(arenas)}
    hits = {i: where[x.untyped_storage().data_ptr()] for i, x in enumerate(example_inputs)
            if isinstance(x, torch.Tensor) and not isinstance(x, torch._subclasses.FakeTensor)
            and x.device.type == "cpu" and x.untyped_storage().data_ptr() in where}
    if not hits:
        return None
    used = sorted(set(hits.values()))
    graph, copies = torch.fx.Graph(), {}
    graph.output(graph.graph_copy(gm.graph, copies))
    for old, new in copies.items():  # aot_autograd asks each input of dynamo's graphs for its source
        if old.op == "placeholder":
            new._dynamo_source = getattr(old, "_dynamo_source", None)
    nodes = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(nodes[0]):
        heads = {k: graph.placeholder(f"weight_arena_{k}") for k in used}
    fake_mode = torch._guards.detect_fake_mode()
    for k, head in heads.items():
        head._dynamo_source = None  # not in the user's code
        if fake_mode is not None:
            head.meta["example_value"] = fake_mode.from_tensor(arenas[k], static_shapes=True)
    with graph.inserting_after(nodes[-1]):
        for i, k in sorted(hits.items(), reverse=True):
            x, node = example_inputs[i], nodes[i]
            view = graph.call_function(torch.ops.aten.as_strided.default,
                                       (heads[k], tuple(x.shape), tuple(x.stride()), x.storage_offset()))
            if fake_mode is not None:
                with fake_mode:
                    view.meta["example_value"] = heads[k].meta["example_value"].as_strided(
                        x.shape, x.stride(), x.storage_offset())
            node.replace_all_uses_with(view)
            graph.erase_node(node)
    graph.lint()
    out = torch.fx.GraphModule(gm, graph)
    out.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        out._param_name_to_source = gm._param_name_to_source
    return out, [i for i in range(len(example_inputs)) if i not in hits], [arenas[k] for k in used]
