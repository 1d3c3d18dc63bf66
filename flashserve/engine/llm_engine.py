"""``LLMEngine``: requests in, one schedule → run → sample → postprocess per ``step()``, outputs out."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time

import torch

from ..config import ConfigError
from ..model.expert_cache import cache_stats, expert_caches
from ..model.hybrid import REBALANCE_STEPS, hybrid_layers, hybrid_stats, rebalance
from ..model.row_cache import row_cache_stats, row_caches
from ..model.mapped import page_in, weights_held
from ..model.mapped_experts import eager_only
from ..model.packed import prepare_kernels

from . import preflight
from .cache import KVCache
from .detokenizer import IncrementalDetokenizer
from .engine_config import EngineConfig
from .execution import plan_execution
from .kernel_check import check_kernels
from .guided import Guides
from .images import ImageInput, ImageLimits, ImageSpan, expand_placeholders, load_images
from .graphs.compile_child import CompileChild
from .graphs.decode_step import DecodeStep
from .model_runner import ModelRunner
from .sampling_params import QueueFullError, RequestError, SamplingParams
from .scheduler import Scheduler
from .sequence import RequestGroup, RequestOutput, Sequence
from .spec_config import SpeculativeConfig
from .spec_config import describe as describe_speculation
from .speculative import SpecStats, make_drafter, speculation_allowed
from .threads import set_threads
from .tokenizer import load_tokenizer, set_engram_token_map

log = logging.getLogger("flashserve.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None, warm_up: bool = True, compile_only: bool = False):
        from ..model.loader import load_model, resolve_dtype

        self.config = c = config
        set_threads(c.threads)  # before loading: a bad value fails fast, and loading uses the threads
        pre = preflight.check(c, model.cfg if model is not None else None)  # every option, before loading
        device = c.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} asked but CUDA is not available")
        self.spec = spec = SpeculativeConfig.parse(c.speculative_config, c.model)
        log.info(describe_speculation(spec, c.speculative_config))
        self.dtype = torch.float64 if c.dtype in ("float64", "fp64", torch.float64) else resolve_dtype(c.dtype)
        with_mtp = spec is not None and spec.method in ("mtp", "dspark")
        self.model = model if model is not None else load_model(c.model, dtype=self.dtype, device=device,
                                                                fake_quant=c.fake_quant, with_mtp=with_mtp,
                                                                quantization=c.quantization,
                                                                # a compile child maps what the parent copies, in
                                                                # the parent's module layout, and locks nothing
                                                                mmap=c.mmap or compile_only, experts_in_place=c.mmap,
                                                                mlock=c.mlock and not compile_only,
                                                                weight_memory=pre.weight_bytes,
                                                                expert_cache_policy=c.expert_cache_policy,
                                                                gpu_experts=c.gpu_experts)
        self.dtype = self.model.dtype
        prepare_kernels(self.model)  # w8a8: fbgemm's copies of the weights, before a decode step is compiled
        self.model_config = cfg = self.model.cfg
        self.tokenizer = load_tokenizer(c.tokenizer or c.model, cfg.vocab_size)
        set_engram_token_map(self.model, self.tokenizer)
        self.max_model_len = pre.max_model_len
        cache_dtype = c.cache_dtype or ("packed" if cfg.is_v41 else "float")
        if cache_dtype not in ("packed", "float"):
            raise ValueError(f"cache_dtype must be 'packed' or 'float', got {cache_dtype!r}")
        self.cache = KVCache(cfg, dtype=self.dtype, device=self.model.embed.weight.device,
                             packed=cache_dtype == "packed", kv_memory=pre.kv_bytes,
                             max_num_seqs=c.max_num_seqs, block_size=c.block_size, num_pages=c.num_pages,
                             spare_rows=spec.num_speculative_tokens if spec else 0,
                             draft_stages=cfg.num_nextn_predict_layers if spec and spec.method == "dspark" else 0,
                             draft_layers=1 if spec and spec.method == "mtp" else 0)
        try:
            self.drafter = make_drafter(spec, self.model, self.cache) if spec else None
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.spec_stats = SpecStats()
        log.info(self.cache.describe(self.max_model_len))
        self.scheduler = Scheduler(self.cache, max_num_seqs=c.max_num_seqs,
                                   max_num_batched_tokens=c.max_num_batched_tokens, prefill_chunk=c.prefill_chunk,
                                   enable_prefix_caching=c.enable_prefix_caching,
                                   num_layers=cfg.num_hidden_layers, is_v41=cfg.is_v41,
                                   encoder_layers=cfg.decoder_start, prefix_replay=c.prefix_replay)
        eager = bool(c.enforce_eager)
        self.expert_caches = expert_caches(self.model)  # found once: stats() runs every step
        self.row_caches = row_caches(self.model)
        self.hybrid = hybrid_layers(self.model)  # experts split between the GPU and the host (gpu_experts)
        if self.cache.device.type == "cpu":  # before eager_only: a refused kernel can leave layers eager-only
            check_kernels(self.model)
        why = eager_only(self.model)
        if not eager and why is not None:
            log.info("%s: decode steps run eagerly (the routing is read on the host between a layer's router and "
                     "its experts)", why)
            eager = True
        background = (c.background_compile if c.background_compile is not None
                      else self.cache.device.type == "cpu") and not eager
        rows = c.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        self.plan = plan_execution(self.model, device=self.cache.device.type, compiled=not eager, rows=rows,
                                   int8_kernel=c.int8_kernel)
        budget = getattr(self.model, "weight_budget", None)
        if budget is not None:
            held = weights_held(self.model)
            log.info("weight memory: %.2f GiB budget, %.2f GiB held by the weights and the plan's copies of them "
                     "(%.2f GiB of them mapped from the files)", budget.budget / 2**30, held["total"] / 2**30,
                     held["mapped"] / 2**30)
        if not eager and c.compile_cache is not None:  # inductor reads it when it first compiles
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(c.compile_cache)
        child = self._compile_child(model is not None) if background else None
        step = DecodeStep(self.model, self.cache, max_num_seqs=c.max_num_seqs, enforce_eager=eager,
                          backend=c.compile_backend, cuda_graphs=c.cuda_graphs,
                          capture=self.drafter.capture if self.drafter else (),
                          streams=bool(getattr(self.drafter, "streams", False)), background=background, child=child)
        # the weights used where they lie in the mapped files (those a compiled step's weight arenas did not copy)
        # faulted in on a thread of their own (MAP_POPULATE's effect without waiting for it); --mlock has read and
        # locked them already, and a compiling child (compile_only) never decodes
        self.page_in = page_in(self.model) if not compile_only and not c.mlock else None
        if warm_up:  # a sharded engine's ranks warm up together once all are ready (their steps' collectives)
            # a model drafter drafts k tokens a step: its verification key compiled right after one row's
            step.warm_up(verify_rows=1 + spec.num_speculative_tokens if with_mtp else None)
            self.plan.finish()
            log.info(self.plan.describe())
        self.encoder_only = cfg.is_v41 and not c.exact_prefill
        self.guides = Guides(self.tokenizer, cfg.vocab_size)  # structured outputs (compiled on first use)
        self.generator = torch.Generator(device=self.model.embed.weight.device).manual_seed(c.seed)
        self.runner = ModelRunner(self.model, self.cache, step, guides=self.guides, generator=self.generator,
                                  drafter=self.drafter)
        self.groups: dict[str, RequestGroup] = {}
        self.lock = threading.RLock()  # add/abort may come from another thread than step()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        self.image_limits = ImageLimits()  # per request; the server sets its own from its flags
        self.reads_images = self.model.vision is not None
        self.failure: BaseException | None = None  # one process: a failure is an exception of step() itself
        self.exit_on_failure = False

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    images: list | None = None) -> None:
        """Queue a request. ``images`` (encoded bytes, ``PIL.Image`` or preprocessed
        :class:`~flashserve.engine.images.ImageInput`): one per image placeholder of the prompt, in order."""
        with self.lock:
            self._add_request(request_id, prompt, params, images or [])

    def _add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                     images: list) -> None:
        params = params or SamplingParams()
        cfg = self.model_config
        params.validate(cfg.vocab_size)
        if params.constraint is not None:
            self.guides.check(params.constraint)  # a schema the backend cannot compile: RequestError (400)
        if request_id in self.groups:
            raise RequestError(f"request_id: {request_id!r} is already running")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            if any(t < 0 or t >= cfg.vocab_size for t in ids):
                raise RequestError(f"prompt: token ids must be in [0, {cfg.vocab_size})")
        if not ids:
            raise RequestError("prompt: empty prompt")
        inputs = load_images(images, cfg.vision if self.model.vision is not None else None, self.image_limits)
        if inputs or (cfg.image_token_id is not None and cfg.image_token_id in ids):  # a placeholder needs its image
            ids, starts = expand_placeholders(ids, inputs, cfg.image_token_id)
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt: {len(ids)} tokens leaves no room in max_model_len {self.max_model_len}")
        if -(-(len(ids) + 1) // self.cache.page_tokens) > self.cache.num_pages:
            raise RequestError(f"prompt: {len(ids)} tokens need more cache pages than the engine has "
                               f"({self.cache.num_pages} pages of {self.cache.page_tokens} tokens)")
        waiting = sum(1 for s in self.scheduler.waiting if s.num_preemptions == 0)
        if params.n > self.config.max_waiting:
            raise RequestError(f"n: {params.n} completions exceed the waiting queue's capacity "
                               f"({self.config.max_waiting} sequences)")
        if waiting + params.n > self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} sequences); retry later")
        group = RequestGroup(request_id, text, ids, params, time.monotonic())
        if inputs:  # every check passed: now run the vision tower, once per request
            group.images = self._embed_images(inputs, starts)
        exact = not self.encoder_only or params.prompt_logprobs is not None
        dev = self.model.embed.weight.device
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=dev).manual_seed(params.seed + i)
            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                           stop=params.stop)
            seq = Sequence(group, i, ids, params, detok, gen)
            seq.exact = exact
            group.seqs.append(seq)
            self.scheduler.add(seq)
        self.groups[request_id] = group
        self.prompt_tokens_total += len(ids)

    @torch.inference_mode()
    def _embed_images(self, inputs: list[ImageInput], starts: list[int]) -> list[ImageSpan]:
        dev = self.model.embed.weight.device
        return [ImageSpan(s, inp.span_tokens, inp.digest, self.model.embed_image(inp.patches.to(dev), inp.grid.patches))
                for s, inp in zip(starts, inputs)]

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its pages and slot at once (no further outputs)."""
        with self.lock:
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One schedule → forward(s) → sample → postprocess; outputs of requests that produced tokens."""
        with self.lock:
            return self._step()

    @torch.inference_mode()
    def _step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        self.num_steps += 1
        touched: dict[str, RequestGroup] = {}
        for seq in sched.failed:
            seq.finish_reason = "length"
            seq.detok.finish()
            self.scheduler.finish(seq)
            touched[seq.group.request_id] = seq.group
        decode = [s for s, _ in sched.chunks if s.prefill_done]
        prefills = [(s, n) for s, n in sched.chunks if not s.prefill_done]
        if decode:
            self._decode(decode, touched)
        if prefills:
            self._prefill(prefills, touched)
        self._propose()
        if self.hybrid and self.num_steps % REBALANCE_STEPS == 0:  # the most used experts into the GPU's slots
            rebalance(self.hybrid)
        return self._outputs(touched)

    def _decode(self, seqs: list[Sequence], touched: dict[str, RequestGroup]) -> None:
        """One forward over every decoding sequence's pending token and drafts; each sequence then takes the
        tokens verification emits (just the sampled one without drafts) and what its rejected rows wrote to
        the cache is rolled back."""
        R = 1 + max(len(s.draft) for s in seqs)
        emitted, feats = self.runner.run_decode(seqs)
        kept, starts, counts = [], [], []
        for i, s in enumerate(seqs):
            start, out = s.num_computed, emitted[i]
            s.spec.record(len(s.draft), len(out) - 1)
            self.spec_stats.record(len(s.draft), len(out) - 1)
            s.draft, s.draft_probs = [], None
            for tid, lp in out:
                self._append(s, tid, lp)
                if s.finished:  # its slot and pages are free already
                    break
            touched[s.group.request_id] = s.group
            if not s.finished:
                s.num_computed = start + len(out)  # the pending token and the accepted drafts
                self.scheduler.register(s)
                self.scheduler.trim_pages(s)
                kept.append(i)
                starts.append(start)
                counts.append(len(out))
        back = [seqs[i] for i, n in zip(kept, counts) if n < R]  # rows past the accepted ones were written
        h = self.cache.storage.history.shape[1]
        self.cache.rollback([s.slot for s in back], [s.num_computed for s in back],
                            [s.tokens[max(0, s.num_computed - h):s.num_computed] for s in back])
        if self.drafter is not None and kept:
            self.drafter.observe([seqs[i] for i in kept], starts, counts, None if feats is None else feats[kept])

    def _prefill(self, prefills: list[tuple[Sequence, int]], touched: dict[str, RequestGroup]) -> None:
        sampled, observed = self.runner.run_prefill(prefills)
        for seq, n in prefills:
            seq.num_computed += n
            if seq.num_computed == seq.num_tokens:
                self.cache.drop_stash(seq.slot)
                seq.prefill_done = True
            self.scheduler.register(seq)
        for seq, tid, lp in sampled:
            self._append(seq, tid, lp)
            touched[seq.group.request_id] = seq.group
        for seq, start, rows, f in observed:
            if not seq.finished:
                self.drafter.observe([seq], [start], [rows], f)

    def _propose(self) -> None:
        """Draft the next step's tokens for every decoding sequence that may speculate (none while more
        sequences decode than ``disable_by_batch_size``)."""
        if self.drafter is None:
            return
        decoding = [s for s in self.scheduler.running if s.prefill_done]
        limit = self.spec.disable_by_batch_size
        if limit is not None and len(decoding) > limit:
            for s in decoding:
                s.draft = []
            return
        room = self.max_model_len - 1
        want = [s for s in decoding if not s.draft and speculation_allowed(s.params) and s.num_tokens < room]
        if not want:
            return
        k = self.spec.num_speculative_tokens
        for s, d in zip(want, self.drafter.propose(want, k, self.generator)):
            # never past the length limit or max_tokens: the last emitted token is the target's own
            n = max(min(len(d.tokens), room - s.num_tokens, s.params.max_tokens - s.num_output - 1), 0)
            s.draft = list(d.tokens[:n])
            s.draft_probs = None if d.probs is None else d.probs[:n]

    def _outputs(self, touched: dict[str, RequestGroup]) -> list[RequestOutput]:
        outputs = []
        for rid, group in touched.items():
            if group.finished:
                self.groups.pop(rid, None)
            elif group.params.output_kind == "final_only":
                continue
            outputs.append(group.make_output())
        return outputs

    def _append(self, seq: Sequence, tid: int, lp: dict[int, float] | None) -> None:
        p = seq.params
        seq.tokens.append(tid)
        if seq.counts is not None:
            seq.counts.add(tid)
        self.generation_tokens_total += 1
        if seq.logprobs is not None:
            seq.logprobs.append(lp or {})
        reason = stop_reason = None
        if not p.ignore_eos and tid == self.tokenizer.eos_token_id:
            reason = "stop"
        elif p.stop_token_ids and tid in p.stop_token_ids:
            reason, stop_reason = "stop", tid
        matched = seq.detok.add(tid)
        if matched is not None:
            reason, stop_reason = "stop", matched
        if reason is None and (seq.num_output >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            flushed = seq.detok.finish()
            if flushed is not None:  # the last bytes completed a stop string
                reason, stop_reason = "stop", flushed
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.finish(seq)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the decode step's background compile, at most ``timeout`` seconds (benchmarks that measure the
        compiled step); whether decode steps are compiled now or from the next step on."""
        return self.runner.decode_step.wait_compiled(timeout)

    def _compile_child(self, model_given: bool) -> CompileChild | None:
        """The child process a background compile's work goes to (``compile_child``), or None: its options are this
        engine's, with the step compiled in the foreground there, this engine's page count (the cache's shapes are
        the graphs' shapes) and its threads."""
        c = self.config
        # under a weight budget a child would hold a second budget's worth of expert slots (copies, not maps): the
        # step compiles in this process instead, unless asked for
        wanted = c.compile_child if c.compile_child is not None else (not model_given and c.weight_memory is None
                                                                        and c.compile_backend == "inductor")
        if not wanted:
            return None
        if model_given:
            raise ConfigError("compile_child: a model passed to the engine cannot be rebuilt in a child process")
        options = {**dataclasses.asdict(c), "enforce_eager": False, "background_compile": False,
                   "compile_child": False, "num_pages": self.cache.num_pages, "threads": torch.get_num_threads(),
                   "device": self.cache.device.type}
        try:
            json.dumps(options)
        except TypeError as e:
            log.info("the decode step compiles in this process: its options are not all JSON (%s)", e)
            return None
        return CompileChild(options)

    def shutdown(self) -> None:
        """Ends the decode step's compiling child process, if one runs (the :class:`~.interface.Engine`
        interface)."""
        try:
            self.runner.decode_step.close()
        finally:
            if self.page_in is not None:
                self.page_in.stop(timeout=5.0)

    # ------------------------------------------------------------ introspection
    def stats(self) -> dict:
        s = self.scheduler
        q = s.prefix_query_tokens
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "kv_pages_used": self.scheduler.pool.num_used,
            "kv_pages_total": self.cache.num_pages,
            "kv_page_tokens": self.cache.page_tokens,
            "kv_bytes_per_token": self.cache.bytes_per_token,
            "prefix_cache_hit_rate": (s.prefix_hit_tokens / q) if q else 0.0,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_preemptions": s.num_preemptions,
            "num_steps": self.num_steps,
            "spec_decode": self.spec_stats.as_dict() if self.spec is not None else None,
            "decode_step": self.runner.decode_step.state(),
            "expert_cache": cache_stats(self.expert_caches),
            "engram_row_cache": row_cache_stats(self.row_caches),
            "hybrid_experts": hybrid_stats(self.hybrid),
        }
