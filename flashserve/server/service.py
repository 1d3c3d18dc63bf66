"""What every endpoint shares: the engine loop, the model's names and limits, prompt encoding, a request's
final :class:`SamplingParams`, submission, and the drain state of a shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import chat_encoding, images
from .engine_loop import EngineDeadError, EngineLoop, RequestStream
from .jinja_template import BUILTIN, JinjaTemplate, TemplateError
from .logprobs import TokenStrings
from .metrics import ServerMetrics
from .protocol import DEFAULT_MAX_REQUEST_BYTES, APIError, ChatRequest, invalid
from .stats_log import StatsLogger

if TYPE_CHECKING:
    from ..engine.interface import Engine
    from ..engine.sampling_params import SamplingParams

# Special tokens that carry meaning for the chat parsers and therefore stay in chat text.
_KEEP_IN_CHAT = {chat_encoding.THINK_START, chat_encoding.THINK_END, chat_encoding.DSML, chat_encoding.SYSTEM}


@dataclass
class ServerConfig:
    model_name: str
    served_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    default_thinking: bool = True
    chat_template: str = "auto"  # auto | v41 | plain | a Jinja template file
    reasoning_effort_table: str = chat_encoding.DEFAULT_EFFORT_TABLE  # V4.1 effort budgets (EFFORT_TABLES)
    completion_default_max_tokens: int = 16
    max_model_len: int | None = None
    log_stats_interval: float = 0.0  # seconds between busy-engine log lines; 0: none
    allow_remote_images: bool = False  # fetch http(s) image URLs (off: only data: URLs and base64 blocks)
    model_root: str | None = None  # the preset or checkpoint folder served (``root`` of the model card)

    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.model_name,) + tuple(self.served_names)))


def _engine_import():
    from flashserve.engine import QueueFullError, RequestError

    return QueueFullError, RequestError


class Server:
    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.cfg = config
        self.tokenizer = engine.tokenizer
        self.vocab_size = int(self.tokenizer.vocab_size)
        self.is_v41 = bool(getattr(getattr(engine, "model_config", None), "is_v41", False))
        mml = config.max_model_len or getattr(engine, "max_model_len", None)
        self.max_model_len = int(mml) if mml else 4096
        self.jinja = None if config.chat_template in BUILTIN else JinjaTemplate.load(config.chat_template)
        self.use_v41 = {"v41": True, "plain": False}.get(config.chat_template,
                                                         self.jinja is None and self.is_v41 and self._has_v41_tokens())
        self.metrics = ServerMetrics(config.model_name)
        self.stats_log = StatsLogger(config.log_stats_interval)
        self.loop = EngineLoop(engine, on_stats=self._on_stats)
        self.created = int(time.time())
        self.draining = False
        self.token_strings = TokenStrings(self.tokenizer)
        specials = dict(getattr(self.tokenizer, "special_tokens", {}) or {})
        is_special = getattr(self.tokenizer, "is_special", None)
        self._strip = sorted((s for s, i in specials.items()
                              if s not in _KEEP_IN_CHAT and (is_special is None or is_special(i))),
                             key=len, reverse=True)
        self.bos_text = next((s for s, i in specials.items()
                              if i == getattr(self.tokenizer, "bos_token_id", -1)), None)

    def _on_stats(self, stats: dict) -> None:
        self.metrics.update_engine(stats)
        self.stats_log.update(stats)

    def _has_v41_tokens(self) -> bool:
        need = [chat_encoding.BOS, chat_encoding.USER, chat_encoding.ASSISTANT, chat_encoding.THINK_END]
        try:
            return all(self.tokenizer.token_to_id(t) is not None for t in need)
        except Exception:
            return False

    # -- shutdown ------------------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Refuse new requests (503); running ones go on."""
        self.draining = True

    def end_running(self) -> None:
        """End every request still running (the shutdown timeout passed); handlers answer with 'abort'."""
        self.loop.abort_all()

    # -- prompts -------------------------------------------------------------------------------------------
    def strip_specials(self, text: str) -> str:
        for s in self._strip:
            if s in text:
                text = text.replace(s, "")
        return text

    def check_model(self, model: str | None) -> str:
        """The served name a request asks for; an unknown one is a 404, as OpenAI and vLLM answer it."""
        if model is None:
            return self.cfg.model_name
        if model not in self.cfg.names():
            raise APIError(f"The model '{model}' does not exist; this server serves {list(self.cfg.names())}",
                           status=404, param="model", code="model_not_found")
        return model

    def chat_constraint(self, req: ChatRequest, thinking: bool) -> Any:
        """The structured-output constraint of a chat request (None when it asks for none)."""
        from .structured import chat_constraint

        forces_call = req.tool_choice in ("required", "named")
        if forces_call and not self.use_v41:
            raise invalid("tool_choice", "forcing a tool call needs the V4.1 chat format (DSML tool calls)",
                          "unsupported_value")
        return chat_constraint(req, thinking, self.tokenizer)

    def encode_chat(self, req: ChatRequest) -> tuple[str, bool]:
        """Prompt text of a chat, and whether the model starts in thinking mode."""
        tools = req.tools if req.tool_choice != "none" else None
        if self.jinja is not None:
            return self._render_jinja(req, tools)
        if not self.use_v41:
            return chat_encoding.encode_plain(req.messages, tools=tools, bos=self.bos_text,
                                              add_generation_prompt=req.add_generation_prompt), False
        try:
            thinking, effort = chat_encoding.resolve_mode(req.thinking, req.reasoning_effort,
                                                          self.cfg.default_thinking, self.cfg.reasoning_effort_table)
        except ValueError as e:
            raise invalid("reasoning_effort", str(e)) from None
        text = chat_encoding.encode_v41(req.messages, thinking=thinking, reasoning_effort=effort, tools=tools,
                                        drop_thinking=req.drop_thinking,
                                        add_generation_prompt=req.add_generation_prompt)
        return text, thinking

    def _special_text(self, token_id: int | None) -> str | None:
        specials = getattr(self.tokenizer, "special_tokens", {}) or {}
        return next((s for s, i in specials.items() if i == token_id), None)

    def tokenizer_info(self) -> dict[str, Any]:
        """``GET /tokenizer_info`` (vLLM's fields: those of ``tokenizer_config.json`` and ``tokenizer_class``).
        The server adds no special tokens to a prompt it tokenizes, hence ``add_bos_token: false``; the chat
        template is there only when one is served from a Jinja file (V4.1's encoder is code, not a template)."""
        tok = self.tokenizer
        specials = getattr(tok, "special_tokens", {}) or {}
        from ..engine.tokenizer import PAD

        info: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
            "bos_token": self.bos_text, "eos_token": self._special_text(tok.eos_token_id),
            "pad_token": PAD if PAD in specials else None, "model_max_length": self.max_model_len,
            "clean_up_tokenization_spaces": False,
        }
        if self.jinja is not None:
            info["chat_template"] = self.jinja.source
        return info

    def _render_jinja(self, req: ChatRequest, tools: list | None) -> tuple[str, bool]:
        special = {"bos_token": self.bos_text, "eos_token": self._special_text(self.tokenizer.eos_token_id)}
        try:
            return self.jinja.render(req.messages, tools, req.add_generation_prompt, special)
        except TemplateError as e:
            raise invalid("messages", f"the chat template failed on these messages: {e}") from None

    async def tokenize(self, text: str) -> list[int]:
        if len(text) > 50_000:  # long prompts off the event loop
            return await asyncio.to_thread(self.tokenizer.encode, text)
        return self.tokenizer.encode(text)

    def check_length(self, n_prompt: int, max_tokens: int | None, param: str, default: int | None) -> int:
        """The max_tokens to run with: the asked number if it fits, else a context_length_exceeded error."""
        L = self.max_model_len
        if n_prompt >= L:
            raise APIError(f"This model's maximum context length is {L} tokens; the prompt has {n_prompt} tokens "
                           "(no room left to generate)", param=param, code="context_length_exceeded")
        room = L - n_prompt
        if max_tokens is None:
            return room if default is None else min(default, room)
        if n_prompt + max_tokens > L:
            raise APIError(f"This model's maximum context length is {L} tokens; the prompt has {n_prompt} tokens "
                           f"and max_tokens asks for {max_tokens} more", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    # -- requests ------------------------------------------------------------------------------------------
    def sampling_params(self, sampling: SamplingParams, **decided: Any) -> SamplingParams:
        """What the engine runs: the request's sampling fields with what its endpoint decided (max_tokens,
        logprobs, constraint, ...), streamed as deltas, checked against this model."""
        _, RequestError = _engine_import()
        params = dataclasses.replace(sampling, output_kind="delta", **decided)
        try:
            params.validate(self.vocab_size)
        except RequestError as e:
            msg = str(e)
            raise invalid(msg.split(":", 1)[0].strip() or None, msg) from None
        return params

    def check_admitting(self) -> None:
        if self.draining:
            raise APIError("The server is shutting down; retry on another instance", status=503,
                           type="server_error", code="shutting_down", headers={"Retry-After": "1"})

    async def prepare_images(self, refs: list) -> list:
        """Preprocessed images of a request (a 400 naming the part for any it cannot use)."""
        return await images.prepare_images(refs, self.engine, self.cfg.allow_remote_images)

    def expanded_ids(self, prompt_ids: list[int], imgs: list) -> list[int]:
        return images.expanded_ids(prompt_ids, imgs, self.engine.model_config.image_token_id)

    async def submit(self, rid: str, prompt_ids: list[int], params: Any, imgs: list | None = None) -> RequestStream:
        QueueFullError, RequestError = _engine_import()
        self.check_admitting()
        try:
            return await self.loop.add(rid, prompt_ids, params, imgs or [])
        except QueueFullError as e:
            raise APIError(f"The server is busy (waiting queue full): {e}; retry later", status=429,
                           type="rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"}) from None
        except RequestError as e:
            msg = str(e)
            code = "context_length_exceeded" if "long" in msg or "context" in msg else "invalid_value"
            raise APIError(msg, param=None, code=code) from None
        except EngineDeadError as e:
            raise APIError(f"The engine is not running: {e}", status=503, type="server_error",
                           code="engine_unavailable") from None

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.loop.abort(s.request_id)
