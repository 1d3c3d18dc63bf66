"""The backend that notes each call of a compiled graph (so that :mod:`.regions` can call it again without dynamo),
and CUDA-graph replay of a whole step."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

import torch

from .weight_arena import regroup_inputs

if TYPE_CHECKING:
    from .step_inputs import StepInputs


class GraphRecorder:
    """A dynamo backend (``backend``: inductor with ``options``, or ``eager``: the graph as traced) that notes each
    call of a graph it made, so that a step can call that graph again without dynamo (:mod:`.regions`). Each graph
    takes the ``arenas`` it reads (:func:`.weight_arena.pack_weights`) instead of the weights inside them
    (:func:`.weight_arena.regroup_inputs`); the noted arguments are the graph's own. Calls are noted per thread
    (a step compiling in the background calls graphs on its own thread while steps are served). With ``artifacts``
    (inductor only) each graph is compiled by ``torch._inductor.standalone_compile`` as a self-contained artifact
    that another process can load and call without dynamo (:mod:`.step_artifacts`)."""

    def __init__(self, backend: str, options: dict, arenas: list[torch.Tensor] = ()):
        self.backend, self.options, self.arenas = backend, options, list(arenas)
        self.artifacts = False
        self._local = threading.local()

    @property
    def calls(self) -> list[tuple]:
        """This thread's noted calls since cleared: (graph module, compiled graph, its arguments, its outputs)."""
        calls = getattr(self._local, "calls", None)
        if calls is None:
            calls = self._local.calls = []
        return calls

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        sources = size_sources(gm)  # dynamo drops its placeholders' sources once compiled
        regrouped = regroup_inputs(gm, example_inputs, self.arenas) if self.arenas else None
        gm, keep, used = regrouped or (gm, range(len(example_inputs)), [])
        gm.meta["size_sources"] = [None] * len(used) + [sources[i] for i in keep]
        inputs = [*used, *(example_inputs[i] for i in keep)]
        if self.backend == "inductor" and self.artifacts:
            compiled = torch._inductor.standalone_compile(gm, inputs, dynamic_shapes="from_tracing_context",
                                                          options={"config_patches": self.options}, aot=True)
        elif self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, inputs, config_patches=self.options)
        elif self.backend == "eager":
            compiled = gm.forward
        else:
            raise ValueError(f"unknown compile backend {self.backend!r} (inductor or eager)")

        def noted(*args):  # dynamo's arguments -> the graph's (the arenas in place of the weights inside them)
            args = (*used, *(args[i] for i in keep))
            out = compiled(*args)
            self.calls.append((gm, compiled, args, out))
            return out

        return noted


def size_sources(gm: torch.fx.GraphModule) -> list[tuple[str, int] | None]:
    """For each placeholder of a graph dynamo made: (argument name, dim) where it is that argument's size, else None."""
    from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource

    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        src = getattr(node.meta.get("grapharg"), "source", None)
        sized = (isinstance(src, TensorPropertySource) and src.prop == TensorProperty.SIZE
                 and isinstance(src.base, LocalSource))
        out.append((src.base.local_name, src.idx) if sized else None)
    return out


INPUTS = ("ids", "start", "slots", "table")


class CudaGraphCall:
    """A step's forward (its regions called directly, no dynamo) recorded once as a CUDA graph for inputs of one
    shape, then replayed: each call copies the step's inputs into the graph's own, replays, and clones the outputs
    (the next replay rewrites them).

    Recorded by us rather than by inductor's ``triton.cudagraphs``: the compiled graph is then the same with
    graphs on and off, so inductor's on-disk cache serves both (a cold compile takes minutes;
    docs/engine-speed.md#cuda-graphs). Recording runs nothing, so the cache the step writes is
    untouched until the first replay; the graph's kernels have run once already (the shape's first step), so nothing is
    tuned or loaded while recording. The graphs of one step share one memory pool: they replay one at a time.
    """

    def __init__(self, forward: Callable, inp: "StepInputs", pool):
        self.inputs = {name: getattr(inp, name).clone() for name in INPUTS}
        self.graph = torch.cuda.CUDAGraph()
        self.replays = 0
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = forward(**self.inputs)

    def __call__(self, inp: "StepInputs") -> tuple[torch.Tensor, torch.Tensor | None]:
        for name, t in self.inputs.items():
            t.copy_(getattr(inp, name))
        self.graph.replay()
        self.replays += 1
        logits, feats = self.out
        return logits.clone(), (None if feats is None else feats.clone())
