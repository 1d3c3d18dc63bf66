"""Compiled decode-step graphs called without dynamo once dynamo has run them (see :class:`DirectCall`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from .weight_arena import regroup_inputs

if TYPE_CHECKING:
    from .step_inputs import StepInputs


class GraphRecorder:
    """A dynamo backend (inductor with ``options``) that notes each call of a graph it compiled, so that a step
    can call that graph again without dynamo (:class:`DirectCall`). With ``arenas`` (:func:`.weight_arena.
    pack_weights`), each graph takes the arenas instead of the weights inside them (:func:`regroup_inputs`)."""

    def __init__(self, options: dict, arenas: list[torch.Tensor] = ()):
        self.options, self.arenas = options, list(arenas)
        self.calls: list[tuple] = []  # (graph module, compiled graph, its arguments, its outputs) since cleared

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        regrouped = regroup_inputs(gm, example_inputs, self.arenas) if self.arenas else None
        arenas = self.arenas if regrouped else []
        gm, keep = regrouped or (gm, range(len(example_inputs)))
        compiled = compile_fx(gm, [*arenas, *(example_inputs[i] for i in keep)], config_patches=self.options)

        def noted(*args):  # dynamo's arguments -> the graph's (the arenas in place of the weights inside them)
            args = (*arenas, *(args[i] for i in keep))
            out = compiled(*args)
            self.calls.append((gm, compiled, args, out))
            return out

        return noted


INPUTS = ("ids", "start", "slots", "table")


def tensors_within(root, depth: int = 6) -> list[torch.Tensor]:
    """Tensors reachable from ``root`` through lists, tuples, dicts, object attributes and functions' closures."""
    out, seen, todo = [], set(), [(root, 0)]
    while todo:
        obj, d = todo.pop()
        if id(obj) in seen or d > depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, (list, tuple)):
            todo += [(o, d + 1) for o in obj]
        elif isinstance(obj, dict):
            todo += [(o, d + 1) for o in obj.values()]
        elif callable(obj) and getattr(obj, "__closure__", None):
            todo += [(c.cell_contents, d + 1) for c in obj.__closure__]
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            todo += [(o, d + 1) for o in vars(obj).values()]
    return out


class DirectCall:
    """One compiled graph called as dynamo's code would call it, for inputs of the shapes it was seen with.

    Dynamo's own call costs 0.6-1.0 ms of a 3.4-5.2 ms batch-1 step on the benchmark's peers checkpoint (its
    guards, and bytecode that gathers the model's 300-400 parameter and cache tensors as the graph's arguments).
    The arguments other than the step's inputs are the model's and the cache's tensors, which the engine never
    replaces after start-up (the assumption its guards already make: ``skip_guard_on_all_nn_modules_unsafe``).
    """

    def __init__(self, compiled, args: list, tensors: dict[int, str], sizes: dict[int, tuple[str, int]],
                 outputs: tuple[int, int | None]):
        self.compiled, self.args, self.tensors, self.sizes, self.outputs = compiled, args, tensors, sizes, outputs

    @classmethod
    def plan(cls, calls: list[tuple], inp: "StepInputs", logits: torch.Tensor, feats: torch.Tensor | None,
             fixed: set[int]) -> "DirectCall | None":
        """From the graph calls one dynamo call made: None unless it was one graph whose arguments are the step's
        inputs (by identity), sizes of them, and tensors of ``fixed`` (ids of tensors never replaced), and whose
        outputs are exactly the step's."""
        if len(calls) != 1:
            return None
        gm, compiled, args, out = calls[0]
        holders = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        if len(holders) != len(args):
            return None
        given = {name: getattr(inp, name) for name in INPUTS}
        tensors = {i: name for i, a in enumerate(args) for name, t in given.items() if a is t}
        dims = {}  # symbol of an input's size -> (input, dim)
        for i, name in tensors.items():
            for d, size in enumerate(getattr(holders[i], "shape", ())):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(size.node.expr, (name, d))
        sizes = {}
        for i, a in enumerate(args):
            if i in tensors:
                continue
            if isinstance(a, torch.Tensor):
                if id(a) not in fixed:  # made for this call, or an attribute that may be replaced: keep dynamo
                    return None
                continue
            value = holders[i]
            if not isinstance(value, torch.SymInt) or value.node.expr not in dims:
                return None
            sizes[i] = dims[value.node.expr]
        results = [logits] + ([] if feats is None else [feats])
        if not isinstance(out, (list, tuple)) or len(out) != len(results):
            return None
        where = [next((j for j, o in enumerate(out) if o is r), None) for r in results]
        if None in where:
            return None
        return cls(compiled, list(args), tensors, sizes, (where[0], where[1] if feats is not None else None))

    def __call__(self, inp: "StepInputs") -> tuple[torch.Tensor, torch.Tensor | None]:
        args = list(self.args)
        for i, name in self.tensors.items():
            args[i] = getattr(inp, name)
        for i, (name, d) in self.sizes.items():
            args[i] = getattr(inp, name).shape[d]
        out = self.compiled(*args)
        li, fi = self.outputs
        return out[li], (None if fi is None else out[fi])


class CudaGraphCall:
    """A :class:`DirectCall` recorded once as a CUDA graph for inputs of one shape, then replayed: each call copies
    the step's inputs into the graph's own, replays, and clones the outputs (the next replay rewrites them).

    Recorded by us rather than by inductor's ``triton.cudagraphs``: the compiled graph is then the same with
    graphs on and off, so inductor's on-disk cache serves both (a cold compile takes minutes;
    docs/engine-speed.md#cuda-graphs). Recording runs nothing, so the cache the step writes is
    untouched until the first replay; the graph's kernels have run once already (dynamo's call), so nothing is
    tuned or loaded while recording. The graphs of one step share one memory pool: they replay one at a time.
    """

    def __init__(self, direct: DirectCall, inp: "StepInputs", pool):
        self.inputs = {name: getattr(inp, name).clone() for name in INPUTS}
        self.graph = torch.cuda.CUDAGraph()
        self.replays = 0
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = direct(SimpleNamespace(**self.inputs))

    def __call__(self, inp: "StepInputs") -> tuple[torch.Tensor, torch.Tensor | None]:
        for name, t in self.inputs.items():
            t.copy_(getattr(inp, name))
        self.graph.replay()
        self.replays += 1
        logits, feats = self.out
        return logits.clone(), (None if feats is None else feats.clone())
