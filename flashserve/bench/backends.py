"""Where benchmark requests go: an OpenAI-compatible server over HTTP, or an engine in this process.

Both stream every request and note when each chunk carrying new tokens arrives; chunks without new text or
tokens (a chat stream's opening role chunk, the final usage chunk) are not tokens and are not timed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import UserError
from .datasets import SampleRequest
from .metrics import RequestResult, chunk_times_to_result

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class Sampling:
    """Sampling settings sent with every request (recorded in the result JSON)."""

    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None  # per-request sampling seed: sent only when --request-seed is given
    extra_body: dict[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    name: str

    async def start(self) -> None: ...

    async def send(self, req: SampleRequest, sampling: Sampling) -> RequestResult: ...

    async def server_metrics(self) -> str | None: ...

    async def close(self) -> None: ...


def _chunk_text(data: dict[str, Any]) -> str:
    """New text in one streamed chunk of either endpoint (answer and reasoning)."""
    choices = data.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    delta = c.get("delta") or {}
    return (delta.get("reasoning_content") or "") + (delta.get("content") or "")


class OpenAIBackend:
    """Streams ``/v1/completions`` or ``/v1/chat/completions`` with httpx; output tokens from the final
    ``usage`` chunk (``stream_options.include_usage``), else counted with the benchmark's tokenizer."""

    def __init__(self, base_url: str, endpoint: str, model: str, count_tokens: Any, api_key: str | None = None,
                 timeout_s: float = 600.0):
        if endpoint not in ENDPOINTS:
            raise UserError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
        self.name = "openai-chat" if endpoint.endswith("chat/completions") else "openai"
        self.base_url, self.endpoint, self.model = base_url.rstrip("/"), endpoint, model
        self.count_tokens = count_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.client: Any = None

    async def start(self) -> None:
        try:
            import httpx
        except ImportError:
            raise UserError("bench against a --base-url needs httpx (a dependency of flashserve): "
                            "pip install httpx") from None
        self.client = httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        try:
            resp = await self.client.get(self.base_url + "/v1/models")
        except httpx.HTTPError as exc:
            await self.close()
            raise UserError(f"--base-url: cannot reach {self.base_url}: {exc}") from None
        if not self.model:  # the server's first model, as an OpenAI client would list it
            models = resp.json().get("data") or [] if resp.status_code == 200 else []
            if not models:
                await self.close()
                raise UserError(f"--served-model-name: {self.base_url}/v1/models lists no model; name one")
            self.model = models[0]["id"]

    def _body(self, req: SampleRequest, s: Sampling) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.output_len, "temperature": s.temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.name == "openai-chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if s.ignore_eos:
            body["ignore_eos"] = True
        if s.seed is not None:
            body["seed"] = s.seed
        return {**body, **s.extra_body}

    async def send(self, req: SampleRequest, sampling: Sampling) -> RequestResult:
        import httpx

        times: list[float] = []
        text, usage_tokens = [], None
        start = time.perf_counter()
        try:
            async with self.client.stream("POST", self.base_url + self.endpoint, json=self._body(req, sampling)) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    return RequestResult(req.prompt_len, error=f"HTTP {resp.status_code}: {body[:300]}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    data = json.loads(payload)
                    now = time.perf_counter() - start
                    if piece := _chunk_text(data):
                        times.append(now)
                        text.append(piece)
                    if data.get("usage"):
                        usage_tokens = data["usage"].get("completion_tokens")
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            return RequestResult(req.prompt_len, error=f"{type(exc).__name__}: {exc}")
        generated = "".join(text)
        n_out = usage_tokens if usage_tokens is not None else len(self.count_tokens(generated))
        result = chunk_times_to_result(req.prompt_len, times, n_out)
        result.generated_text = generated
        return result

    async def server_metrics(self) -> str | None:
        import httpx

        try:
            resp = await self.client.get(self.base_url + "/metrics")
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None


class EngineBackend:
    """An in-process :class:`~flashserve.engine.LLMEngine` stepped by the server's engine loop thread."""

    name = "flashserve-engine"

    def __init__(self, model: str, **engine_options: Any):
        self.model, self.options = model, engine_options
        self.loop: Any = None
        self._ids = itertools.count()

    async def start(self) -> None:
        from ..engine import EngineConfig
        from ..entrypoints.engines import create_engine
        from ..server.engine_loop import EngineLoop

        # LLMEngine, or rank 0 of a sharded engine (--tensor-parallel-size, --enable-expert-parallel, ...)
        engine = create_engine(EngineConfig(model=self.model, **self.options))
        await asyncio.to_thread(engine.wait_compiled)  # measure the step the engine settles on, not its compile
        self.loop = EngineLoop(engine)
        self.loop.start()

    @staticmethod
    def params(output_len: int, sampling: Sampling) -> Any:
        """The request's ``SamplingParams``: the run's settings, then ``--extra-body`` fields by the engine's
        names (vLLM's: ``top_p``, ``top_k``, ``min_p``, ``stop``, ``repetition_penalty``, ...), as a server
        merges the body; a field the engine does not have is a :class:`UserError`."""
        from ..engine import SamplingParams

        known = {f.name for f in dataclasses.fields(SamplingParams)} - {"output_kind"}
        unknown = sorted(set(sampling.extra_body) - known)
        if unknown:
            raise UserError(f"--extra-body: {', '.join(unknown)} {'is not a' if len(unknown) == 1 else 'are not'} "
                            f"sampling parameter{'s' * (len(unknown) > 1)} of the in-process engine "
                            f"(it takes {', '.join(sorted(known))})")
        fields = {"max_tokens": output_len, "temperature": sampling.temperature, "ignore_eos": sampling.ignore_eos,
                  "seed": sampling.seed, **sampling.extra_body}
        try:
            return SamplingParams(**fields, output_kind="delta")
        except (TypeError, ValueError) as exc:
            raise UserError(f"--extra-body: {exc}") from None

    async def send(self, req: SampleRequest, sampling: Sampling) -> RequestResult:
        params = self.params(req.output_len, sampling)
        times: list[float] = []
        text, n_out = [], 0
        start = time.perf_counter()
        try:
            stream = await self.loop.add(f"bench-{next(self._ids)}", req.prompt, params)
            while (out := await stream.get()) is not None:
                new = out.outputs[0].delta_token_ids
                if new:
                    times.append(time.perf_counter() - start)
                    n_out += len(new)
                    text.append(out.outputs[0].delta_text)
        except Exception as exc:  # a refused request (too long, queue full) is a failed request, as over HTTP
            return RequestResult(req.prompt_len, error=f"{type(exc).__name__}: {exc}")
        result = chunk_times_to_result(req.prompt_len, times, n_out)
        result.generated_text = "".join(text)
        return result

    async def server_metrics(self) -> str | None:
        """The engine's counters as a server's ``/metrics`` would show them (speculative acceptance included),
        read once the last step's outputs are out (a step holds the engine until its counters are updated)."""
        from ..server.metrics import ServerMetrics

        metrics = ServerMetrics(self.model)
        metrics.update_engine(await asyncio.to_thread(self.loop.engine.stats))
        return metrics.render().decode()

    async def close(self) -> None:
        if self.loop is not None:
            self.loop.stop()
            shutdown = getattr(self.loop.engine, "shutdown", None)  # a sharded engine's workers
            if shutdown is not None:
                shutdown()
            self.loop = None
