"""Offline API: ``LLM(model, **engine_options).generate(prompts, params)`` and ``LLM.stream``."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator

from ..engine.engine_config import EngineConfig
from ..engine.sampling_params import SamplingParams
from ..engine.sequence import RequestOutput


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        """``model``: a preset, a checkpoint folder, or None for the embedded default (:mod:`flashserve.models`)."""
        from ..models import resolve_model
        from .engines import create_engine

        # LLMEngine unless sharded
        self.engine = create_engine(EngineConfig(model=resolve_model(model), **engine_options))
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        """An ``LLM`` over an already-built ``EngineConfig`` (what the CLI derives from its flags)."""
        return cls(**dataclasses.asdict(config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @staticmethod
    def _normalize(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]
        return prompts

    @staticmethod
    def _parts(prompt) -> tuple[str | list[int], list]:
        """A prompt as vLLM takes it: text, token ids, or ``{"prompt": text | "prompt_token_ids": ids,
        "multi_modal_data": {"image": image | [images]}}`` (PIL images or encoded bytes, one per image
        placeholder, in order)."""
        if not isinstance(prompt, dict):
            return prompt, []
        text = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if text is None:
            raise ValueError("prompt: a dict prompt needs 'prompt' (text) or 'prompt_token_ids'")
        images = (prompt.get("multi_modal_data") or {}).get("image", [])
        return text, (list(images) if isinstance(images, (list, tuple)) else [images])

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        prompts = self._normalize(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("params: one SamplingParams per prompt, or one for all")
        # only the last output of each request is returned: let the engine build nothing before it
        plist = [dataclasses.replace(sp, output_kind="final_only") for sp in plist]
        order = []
        try:
            for p, sp in zip(prompts, plist):
                rid = f"gen-{next(self._ids)}"
                text, images = self._parts(p)
                self.engine.add_request(rid, text, sp, images=images)
                order.append(rid)
        except Exception:  # a bad prompt rejects the whole call: withdraw the ones already queued
            for rid in order:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in order]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a :class:`RequestOutput` (with ``delta_text`` / ``delta_token_ids``) per step that produced
        tokens for this prompt, the last one with ``finished=True``."""
        rid = f"stream-{next(self._ids)}"
        text, images = self._parts(prompt)
        self.engine.add_request(rid, text, params or SamplingParams(), images=images)
        try:
            while True:
                done = False
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        done = out.finished
                if done or not self.engine.has_unfinished_requests():
                    return
        finally:
            self.engine.abort_request(rid)
