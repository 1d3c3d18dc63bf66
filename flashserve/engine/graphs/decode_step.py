"""The fixed-shape decode step: batches padded to buckets, compiled once per kind of layer.

A decode batch of ``B`` requests with ``R`` rows each (1 for plain decode, k+1 to verify k drafted tokens) is
padded to the next bucket (1, 2, 4, 8, ... up to ``max_num_seqs``). Padding rows name the cache's scratch slot
and scratch page. The step's inputs are four tensors built on the host from what the scheduler knows (ids,
start positions, slots, page table), so nothing inside the forward reads a value back. The step is compiled as
regions (:mod:`.regions`): the prologue, each layer's engram, attention and MoE halves, the epilogue, each kind
of region compiled once and its graph called directly for every layer of that kind (no guards, no argument
gathering). The batch and page-table widths are marked dynamic, so one graph of each region serves every bucket
from 2 and every context length (plus one for batch 1 on the CPU, and one where the MoE switches from gathered
experts to all experts). On CUDA the whole step is recorded as a CUDA graph per input shape and replayed
(``cuda_graphs``; :class:`.graph_call.CudaGraphCall`); on the CPU inductor's C++ wrapper calls each region's
kernels.
``enforce_eager`` runs the same step without compiling or padding, as vLLM's switch does.

A compiled step can also be compiled in the background (``background``, a compiled CPU step's default): the thread that
serves never enters dynamo. A thread of its own takes each step *key* (bucket, rows a request computes, page-table
width) in turn, on the cache's scratch slot and page: every bucket of one row first, then each key a step asks for
that is not ready yet (rows to verify drafted tokens, a wider table as contexts grow). With a ``child``
(:mod:`.compile_child`, the default where the engine loads its own model) a second process compiles each key and
saves its graphs (:mod:`.step_artifacts`), and the thread only loads and installs them; without one the thread
compiles through the regions itself. A step whose key is ready calls the compiled regions directly; any other runs
eagerly (unpadded) and asks for its key. The forward mode is per thread (:mod:`flashserve.model.modes`), so a
compiling thread traces the compiled implementations while the serving thread runs the eager ones; the thread ends
when nothing is left to compile.
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
import threading
import time
import types
from typing import Callable

import torch

from ...model import modes
from ...model.mapped import release_unused
from ...model.packed import PackedLinear
from ..cache import KVCache
from ..fixed_state import FixedBatchState
from .compile_child import ChildFailed, CompileChild
from .graph_call import CudaGraphCall, GraphRecorder
from .inductor_passes import SinkInputWrites
from .step_inputs import StepInputs
from .regions import HALVES, RegionalStep
from .weight_arena import pack_weights

log = logging.getLogger("flashserve.engine")

# One compiling thread at a time in a process (several engines' steps may compile in the background at once; dynamo
# compiles on one thread at a time, and two at once crashed the interpreter)
_COMPILING = threading.Lock()

# Graphs one step may compile: batch 1, every batch from 2, the MoE's switch to all experts, and again with
# verification rows. Each step's compile keeps its own graphs (``isolate_recompiles``): by default every
# compiled DecodeStep in a process shares ``_eager``'s code object and dynamo's cap of 8 graphs on it, and past
# the cap a later engine's step ran uncompiled without a word (seen in the engine benchmark's fourth engine).
GRAPHS_PER_STEP = 8


def compile_own_graphs(fn: Callable, **kwargs) -> Callable:
    """``torch.compile(fn, **kwargs)`` keeping its own cache of at most ``GRAPHS_PER_STEP`` graphs (each region kind
    compiles the same function: their graphs must not count against each other's cap). Torch 2.13 says so
    (``isolate_recompiles``, ``recompile_limit``); older versions have neither (torch 2.11), and there ``fn`` runs as
    a copy of its code object, on which dynamo hangs its cache and counts its cap
    (``torch._dynamo.config.recompile_limit``, 8 by default)."""
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return torch.compile(fn, recompile_limit=GRAPHS_PER_STEP, isolate_recompiles=True, **kwargs)
    f = getattr(fn, "__func__", fn)
    own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return torch.compile(types.MethodType(own, fn.__self__) if hasattr(fn, "__self__") else own, **kwargs)


def _python_object_ops(model) -> bool:
    """Whether the model calls ops that take a Python object (w8a8's fbgemm kernels), which inductor's C++
    wrapper cannot pass yet ("arg type PyObject is not yet supported by custom_op_wrapper", torch 2.13)."""
    return any(isinstance(m, PackedLinear) and m.kernel is not None for m in model.modules())


def decode_buckets(max_num_seqs: int, one_row_graph: bool = True) -> list[int]:
    """1, then powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself. Sizes from 2 share one graph
    with a dynamic batch dimension; batch 1 is a graph of its own (dynamo specialises a dimension of size 1).
    On the CPU that graph pays: padding one row to 2 would double every matmul, since a 2-row fp32 ``mm`` costs
    1.6-2x a 1-row one (measured: 41 against 66 us for 512x512, 7.4 against 14.6 ms for a 32000x512 LM head).
    Without ``one_row_graph`` (CUDA) a lone request is padded to 2 rows and every batch runs the one graph: a
    cold compile takes minutes there too, so a second graph would double the start-up
    (docs/engine-speed.md#the-fixed-shape-step)."""
    out, b = ([1] if one_row_graph or max_num_seqs == 1 else []), 2
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs] if max_num_seqs > 1 else out


class DecodeStep:
    """Runs padded decode forwards: ``torch.compile`` per bucket, or eager with ``enforce_eager``."""

    def __init__(self, model, cache: KVCache, *, max_num_seqs: int, enforce_eager: bool,
                 backend: str = "inductor", cuda_graphs: bool = True, capture: tuple[int, ...] = (),
                 streams: bool = False, background: bool = False, child: CompileChild | None = None):
        """``capture``: layers whose input features (mean over streams) the step also returns (DSpark);
        ``streams``: return the final streams instead (V4 MTP); ``background``: compile on a thread of its own
        (:meth:`warm_up` starts it), each step eager until its shape is compiled; ``child``: with ``background``,
        a process that compiles each key first, the thread then loading what it left in inductor's cache
        (:mod:`.compile_child`)."""
        self.model, self.cache = model, cache
        self.capture, self.streams = capture, streams
        self.buckets = decode_buckets(max_num_seqs, one_row_graph=cache.device.type == "cpu")
        self.enforce_eager = enforce_eager
        # how the step's forward runs (the model's functions bind their implementation to it, model/modes.py)
        self.mode = modes.for_step(cache.device.type, compiled=not enforce_eager)
        cfg = model.cfg
        # the fewest pages a step reads: enough entries in every cache an indexer selects from that its top-k and
        # candidate-pool sizes stay below the read width, so those size checks never flip (and recompile) as a
        # context grows. Only those caches count: sized by V4's HCA caches (one entry a 128-token page), every
        # 16-row step of the engine benchmark's checkpoint read 16 pages where its requests held 2, and scored
        # 512 index entries a CSA layer for 48 (docs/engine-speed.md#the-fixed-shape-step)
        pool = cfg.candidate_topk_blocks * cfg.candidate_block_size if cfg.candidate_source_layer_id >= 0 else 0
        need = max(cfg.index_topk, pool, 1)
        ratios = cfg.indexed_ratios()
        entries_per_page = cache.page_tokens // max(ratios) if ratios else cache.page_tokens
        self.min_pages = max(2, -(-need // max(entries_per_page, 1)))
        # CUDA graphs replay a direct call per input shape (table widths rounded up to powers of two, so a
        # growing context records a new graph at each doubling only); the cache keeps its addresses as allocated
        self.cuda_graphs = cuda_graphs and cache.device.type == "cuda" and not enforce_eager
        # with CUDA graphs, each input shape's recording (made at its second step, once its regions are planned)
        self._graphs: dict[tuple, CudaGraphCall] = {}
        self._seen: set[tuple] = set()
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.regions: RegionalStep | None = None if enforce_eager else self._compile(backend)
        self.warmup_s = 0.0
        self._started = 0.0
        self.background = background and self.regions is not None and not self.cuda_graphs
        self.child = child if self.background else None
        self.verify_rows: int | None = None  # rows every verification step is padded to (warm_up says)
        self.artifacts = None  # with a child: the graphs it saved, loaded here (and left by earlier starts)
        if self.child is not None:
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            from .step_artifacts import StepArtifacts

            self.artifacts = StepArtifacts(self.regions, os.path.join(cache_dir(), "flashserve-steps"))
            self.child.artifacts = str(self.artifacts.root)
        self.child_s = 0.0  # seconds the child compiled, and this process loaded what it compiled
        self.loaded_s = 0.0
        # with ``background``: the step keys (bucket, rows, table width) the compiled regions serve directly,
        # those asked for, the compiling thread's queue of keys (its unfinished tasks: not run yet), and the shapes
        # (one request?, rows) with graphs; a failed compile leaves every key not run yet eager
        self._ready: set[tuple[int, int, int]] = set()
        self._asked: set[tuple[int, int, int]] = set()
        self._queue: queue.Queue = queue.Queue()
        self.compiled_shapes: set[tuple[bool, int]] = set()
        self.compile_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the queue's consumer: started by whoever queues while there is none
        self._closed = False  # the engine shut down: nothing more is compiled, here or in a child

    def _compile(self, backend: str) -> RegionalStep:
        """The step's regions (:mod:`.regions`), each kind compiled with guards on the tensors it is given only.
        Dynamo would also check every parameter and attribute of the model before each call (1.2 ms of a 20 ms
        step on the engine benchmark's checkpoint); the engine never changes its model after start-up, so those
        checks are skipped. Inductor gets one graph pass of ours (:class:`SinkInputWrites`), without which it
        copied every cache ring a step writes, twice."""
        options = {}
        if backend == "inductor" and self.cache.device.type == "cpu" and not _python_object_ops(self.model):
            # inductor's C++ wrapper calls the step's kernels and external matmuls from C++ instead of from a
            # Python function: about 1.4x at batch 1 on the benchmark's peers checkpoint, for a longer first
            # compile (docs/engine-speed.md#regions-one-compiled-graph-per-kind-of-layer)
            options["cpp_wrapper"] = True
        if backend == "inductor":
            # inductor's wrapper checks every input's sizes and strides at each call; in the C++ wrapper ~1.1 us
            # an input (a microbenchmark of 391 inputs: 732 against 302 us a call). The checks are redundant:
            # dynamo's guards checked the representative's inputs, and direct calls pass tensors of the same
            # shapes (another instance of the kind) and inputs of the shapes their plan was made for
            options["size_asserts"] = False
            options["post_grad_custom_pre_pass"] = SinkInputWrites()  # cache rings written in place
        arenas = []
        if backend == "inductor" and self.cache.device.type == "cpu":
            # the C++ wrapper makes a tensor handle of each input at every call, and most of a region's inputs are
            # its layer's weights: moved into one buffer per dtype and region of a layer (weight_arena), they are one
            # or two. The peers checkpoint at batch 1, same run: 0.936x the step as one graph without them, 0.983x
            # with them
            arenas = [a for block in self.model.layers for parts in HALVES for a in pack_weights(block, parts=parts)]
            arenas += pack_weights(self.model, skip=tuple(self.model.layers))
            # the weights moved out of the mapped files: their pages leave this process (each weight counted once)
            release_unused(self.model)
        recorder = GraphRecorder(backend, options, arenas)
        skip_model_guards = torch.compiler.skip_guard_on_all_nn_modules_unsafe

        def compile_region(fn: Callable) -> Callable:
            return compile_own_graphs(fn, backend=recorder, dynamic=False,
                                      options={"guard_filter_fn": skip_model_guards})

        return RegionalStep(self.model, self.cache, compile_region, recorder, capture=self.capture,
                            streams=self.streams)

    def bucket(self, n: int) -> int:
        """Rows a batch of ``n`` requests is padded to when compiled (eager steps are not padded)."""
        if self.regions is None:
            return n
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} requests exceed the largest decode bucket ({self.buckets[-1]})")

    def rows(self, r: int) -> int:
        """Rows a compiled step of ``r`` rows computes: with a model drafter every verification step has the same
        rows (k+1; a shorter draft's padded as a batch pads shorter drafts to the longest), so that one graph and
        one key serve them all instead of one for each draft length."""
        if self.regions is not None and self.verify_rows is not None and 1 < r < self.verify_rows:
            return self.verify_rows
        return r

    def table_width(self, pages: int) -> int:
        """Page-table columns a compiled step of ``pages`` reads (past a request's pages the columns name the scratch
        page, as padding rows do): with CUDA graphs the next power of two (a recording per doubling); else the next
        of four widths per doubling (5, 6, 7, 8, 10, 12, 14, 16, 20, ...: at most 1.25x the columns), so that a
        growing context makes a new step key, which a compiling child process compiles and saves
        (:mod:`.step_artifacts`), a few times per doubling rather than at every page."""
        if self.regions is None:
            return pages
        if self.cuda_graphs:
            return 1 << (pages - 1).bit_length()
        step = 1 << max(0, (pages - 1).bit_length() - 3)
        return -(-pages // step) * step

    @torch.inference_mode()  # inputs made as inference tensors always, so the compiled guards always match
    def inputs(self, ids: list[list[int]], start: list[int], slots: list[int], pages: list[int]) -> StepInputs:
        """Pad one step's rows to their bucket; ``pages``: how many pages each request holds (table columns
        past them name the scratch page, so padding rows past a request's pages write nowhere that is read)."""
        cache, dev = self.cache, self.cache.device
        B, R = len(ids), len(ids[0])
        Bp, P = self.bucket(B), self.table_width(max(max(pages), self.min_pages))
        compiled = self._compiled_for((Bp, R, P))
        if not compiled:
            Bp, P = B, max(pages)
        pad = Bp - B
        slot_t = torch.tensor(slots + [cache.scratch_slot] * pad, dtype=torch.long, device=dev)
        table = torch.full((Bp, P), cache.scratch_page, dtype=torch.long, device=dev)
        width = min(P, cache.page_table.shape[1])
        table[:B, :width] = cache.page_table[slot_t[:B], :width]
        if R > 1 and min(pages) < width:  # only verification rows can reach past a request's pages
            held = torch.tensor(pages, dtype=torch.long, device=dev)[:, None]
            cols = torch.arange(width, device=dev)[None, :]
            table[:B, :width] = torch.where(cols < held, table[:B, :width], cache.scratch_page)
        return StepInputs(
            ids=torch.tensor(ids + [[0] * R] * pad, dtype=torch.long, device=dev),
            start=torch.tensor(start + [0] * pad, dtype=torch.long, device=dev),
            slots=slot_t, table=table, compiled=compiled)

    def _compiled_for(self, key: tuple[int, int, int]) -> bool:
        """Whether a step of ``key`` (bucket, rows, table width) runs compiled; in the background, a key the
        compiling thread has not run yet runs eagerly and is queued for it (once)."""
        if self.regions is None:
            return False
        if not self.background or key in self._ready:
            return True
        if key not in self._asked and self.compile_error is None:
            self._asked.add(key)
            self._submit(key)
        return False

    @torch.inference_mode()
    def __call__(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [Bp, R, V] of every row (padding rows included: the caller keeps its own), and the captured
        features [Bp, R, len(capture), D] or final streams [Bp, R, n, D] (None without either)."""
        if not inp.compiled:
            return self._eager(inp.ids, inp.start, inp.slots, inp.table)
        if not self.cuda_graphs:
            return self._forward(inp.ids, inp.start, inp.slots, inp.table)
        key = (*inp.ids.shape, inp.table.shape[1])
        graph = self._graphs.get(key)
        if graph is None and key in self._seen and self.regions.planned():
            graph = self._graphs[key] = CudaGraphCall(self._forward, inp, self._pool)
        if graph is not None:
            return graph(inp)
        self._seen.add(key)
        return self._forward(inp.ids, inp.start, inp.slots, inp.table)

    def _forward(self, ids: torch.Tensor, start: torch.Tensor, slots: torch.Tensor,
                 table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        with modes.running(self.mode):
            return self.regions(ids, start, slots, table)

    def _eager(self, ids: torch.Tensor, start: torch.Tensor, slots: torch.Tensor,
               table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        state = FixedBatchState(self.cache, slots, table)
        out = self.model(ids, state, start=start, logits_rows=ids.shape[1], capture=self.capture,
                         return_streams=self.streams)
        if self.capture:
            return out.logits, torch.stack([out.features[L] for L in self.capture], dim=2)
        return out.logits, (out.streams if self.streams else None)

    @torch.inference_mode()
    def warm_up(self, rows: int = 1, verify_rows: int | None = None) -> float:
        """Compile every bucket now (on the scratch slot and page) rather than at the first request of each
        size; returns and logs the seconds it took. An eager step runs the smallest and largest batch once, so
        that what its first steps set up (the w8a8 kernels' weights, torch's own lazy state) is done before the
        engine serves, not during its first request. With ``background`` the eager warm-up runs now and the
        buckets are queued for the compiling thread (:meth:`wait_compiled` waits for it): a lone request's keys first
        (one row, then ``verify_rows``, the rows a speculative step verifies), so that one agent runs compiled as soon
        as can be, then the other buckets."""
        t0 = time.perf_counter()
        self.verify_rows = verify_rows
        width = self.table_width(self.min_pages)  # the columns a step of the fewest pages asks for (inputs())
        if self.background:
            for b in sorted({self.buckets[0], self.buckets[-1]}):
                self._eager(*self._scratch((b, rows, width)))
            log.info("decode step (eager until compiled) warmed up in %.1f s; compiling in the background for "
                     "batches %s: %s", time.perf_counter() - t0, self.buckets, self.regions.describe())
            self._started = time.perf_counter()
            first = [(self.buckets[0], rows, width)]
            if verify_rows is not None and verify_rows != rows:
                first.append((self.buckets[0], verify_rows, width))
            for key in first + [(b, rows, width) for b in self.buckets[1:]]:
                self._asked.add(key)
                self._submit(key)
            return time.perf_counter() - t0
        if self.regions is not None:
            log.info("compiling the decode step for batches %s: %s", self.buckets, self.regions.describe())
        for b in self.buckets if self.regions is not None else sorted({self.buckets[0], self.buckets[-1]}):
            inp = StepInputs(*self._scratch((b, rows, width)), compiled=self.regions is not None)
            for _ in range(2 if self.cuda_graphs else 1):  # compiled, then (CUDA) recorded
                self(inp)
        self.warmup_s = time.perf_counter() - t0
        if self.regions is None:
            log.info("decode step (eager) warmed up in %.1f s", self.warmup_s)
        else:
            log.info("decode step compiled for buckets %s in %.1f s", self.buckets, self.warmup_s)
        return self.warmup_s

    def _scratch(self, key: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
        """Inputs of ``key`` (bucket, rows, table width) on the scratch slot and page: ids, start, slots, table."""
        b, rows, width = key
        dev = self.cache.device
        return (torch.zeros(b, rows, dtype=torch.long, device=dev), torch.zeros(b, dtype=torch.long, device=dev),
                torch.full((b,), self.cache.scratch_slot, dtype=torch.long, device=dev),
                torch.full((b, width), self.cache.scratch_page, dtype=torch.long, device=dev))

    def _submit(self, key: tuple[int, int, int]) -> None:
        """Queue ``key`` for the compiling thread, starting one if none runs."""
        with self._lock:
            if self._closed:
                return
            self._queue.put(key)
            if self.child is not None and not self.artifacts.has(key):
                self.child.submit(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._compile_in_background, name="flashserve-compile",
                                                daemon=True)
                self._thread.start()

    @torch.inference_mode()  # per thread: the compiling thread's tensors must be inference tensors too
    def _compile_in_background(self) -> None:
        """The compiling thread: each queued key through the regions, at a lower CPU priority than the thread that
        serves (Linux gives each thread its own nice value; the compilers it starts inherit it), one engine's
        thread at a time (dynamo compiles on one thread at a time); it ends when the queue is empty."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):  # not Linux, or not allowed: the same priority
            pass
        while True:
            with self._lock:
                try:
                    key = self._queue.get_nowait()
                except queue.Empty:
                    self._thread = None
                    ending = self.child.detach() if self.child is not None else (None, None)
                    break
            b, rows, _ = key
            if self.compile_error is not None or self._closed:  # after a failure or the shutdown: nothing more
                self._queue.task_done()
                continue
            t0 = time.perf_counter()
            loaded = self._load(key)  # saved by an earlier start
            if not loaded and self.child is not None:
                try:
                    self.child_s += self.child.wait(key)["s"]
                    loaded = self._load(key)
                except ChildFailed as e:  # compiled here from now on
                    with self._lock:
                        child, self.child = self.child, None
                    if child is not None:
                        child.close()
                    if self._closed:  # the shutdown ended the child: the queue is drained, not compiled here
                        self._queue.task_done()
                        continue
                    log.warning("%s; the decode step compiles in this process from now on", e)
            try:
                if loaded:  # no dynamo: the installed graphs run once, as a compiled key's first step does
                    self._forward(*self._scratch(key))
                else:
                    with _COMPILING:
                        self._forward(*self._scratch(key))
            except BaseException as e:  # this key and every later one stay eager: slower, still correct
                self.compile_error = e
                self._queue.task_done()
                log.error("compiling the decode step for a batch of %d x %d rows failed after %.1f s; steps not "
                          "compiled yet stay eager: %s: %s", b, rows, time.perf_counter() - t0, type(e).__name__, e)
                continue
            if self.regions.planned():
                self._ready.add(key)
            else:  # each layer would go through dynamo on the serving thread: stay eager
                log.warning("the compiled step for a batch of %d x %d rows is not planned; it stays eager", b, rows)
            shape = (b == 1, rows)
            new = shape not in self.compiled_shapes
            self.compiled_shapes.add(shape)
            self._queue.task_done()
            if set(self.buckets) <= {k[0] for k in self._ready if k[1] == rows} and not self.warmup_s:
                self.warmup_s = time.perf_counter() - self._started
                log.info("decode step compiled in the background for buckets %s in %.1f s; steps of those shapes "
                         "run compiled from now on%s", self.buckets, self.warmup_s, self._child_said())
            elif new and self.warmup_s:
                log.info("decode step compiled in the background for batches %s of %d rows in %.1f s",
                         "of 1" if b == 1 else "from 2", rows, time.perf_counter() - t0)
        CompileChild.end(ending)

    def _load(self, key: tuple[int, int, int]) -> bool:
        """Install every region's graph for ``key`` from the artifacts (a child's, or an earlier start's)."""
        if self.artifacts is None:
            return False
        t = time.perf_counter()
        ok = self.artifacts.load(key)
        self.loaded_s += time.perf_counter() - t
        return ok

    def _child_said(self) -> str:
        if self.artifacts is None:
            return ""
        if not self.child_s:
            return f" (loaded in {self.loaded_s:.1f} s from what earlier starts compiled)"
        return (f" (a child process compiled for {self.child_s:.1f} s; loading its graphs here took "
                f"{self.loaded_s:.1f} s)")

    def close(self) -> None:
        """End the compiling child process, if one runs, and compile nothing more (the engine's shutdown)."""
        with self._lock:
            self._closed = True
            child = self.child
        if child is not None:
            child.close()

    def state(self) -> str:
        """What decode steps run: "compiling" (in the background: a batch or rows shape asked for has no graphs
        yet, and runs eagerly), "compiled", or "eager"."""
        if self.regions is None:
            return "eager"
        if self.background and self.compile_error is None and {(k[0] == 1, k[1]) for k in self._asked} - \
                self.compiled_shapes:
            return "compiling"
        return "compiled" if not self.background or self._ready else "eager"

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until the compiling thread has run every key queued so far (at most ``timeout`` seconds); whether
        the step is compiled (for every key asked so far)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.02)
        return self.regions is not None and self.compile_error is None and not self._queue.unfinished_tasks
