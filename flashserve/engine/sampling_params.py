"""Per-request sampling parameters and the engine's errors."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError


class RequestError(UserError):
    """A request the engine cannot accept (bad parameters, empty or too-long prompt); the message names the field."""


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; retry later."""


OUTPUT_KINDS = ("cumulative", "delta", "final_only")
CONSTRAINT_KINDS = ("json", "lark")
MAX_LOGIT_BIAS = 100.0
MAX_N = 16  # choices one HTTP request may ask for


@dataclass(frozen=True)
class RequestLimits:
    """Marks a sampling field that an OpenAI-style HTTP request sets, under the field's own name (OpenAI's and
    vLLM's) with a JSON value of the field's type, which must lie in [lo, hi] (``lo`` excluded when ``lo_open``).
    These are the API's limits, tighter than :meth:`SamplingParams.validate`'s where OpenAI caps a field
    (``temperature`` <= 2). :mod:`flashserve.server.protocol` reads every field that carries them."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False


def _http(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> dict[str, RequestLimits]:
    """The metadata of a field an HTTP request sets (:class:`RequestLimits`)."""
    return {"request": RequestLimits(lo, hi, lo_open)}


@dataclass(frozen=True)
class Constraint:
    """What the output must match, enforced by a token mask (:mod:`flashserve.engine.guided`): a JSON schema
    (``kind="json"``, ``text`` its JSON) or a Lark grammar (``kind="lark"``). With ``after`` set, the output runs
    free until that token (V4.1 reasoning until ``</think>``) and is constrained from the next one. ``param``
    names the request field in errors."""

    kind: str
    text: str
    after: int | None = None
    param: str = "constraint"


@dataclass
class SamplingParams:
    """How one request samples. Each field a request body sets is declared here once, with its HTTP limits
    (:class:`RequestLimits`); the server sets the others (max_tokens, logprobs, constraint) from its own rules."""

    n: int = field(default=1, metadata=_http(1, MAX_N))
    max_tokens: int = 16
    temperature: float = field(default=1.0, metadata=_http(0.0, 2.0))
    top_p: float = field(default=1.0, metadata=_http(0.0, 1.0, lo_open=True))
    top_k: int = field(default=0, metadata=_http(-1))  # 0 or -1: off
    min_p: float = field(default=0.0, metadata=_http(0.0, 1.0))
    # an HTTP request's seed is any 64-bit integer, signed or unsigned (the server folds it below 2**63)
    seed: int | None = field(default=None, metadata=_http(-(2 ** 63), 2 ** 64 - 1))
    presence_penalty: float = field(default=0.0, metadata=_http(-2.0, 2.0))
    frequency_penalty: float = field(default=0.0, metadata=_http(-2.0, 2.0))
    repetition_penalty: float = field(default=1.0, metadata=_http(0.0, 2.0, lo_open=True))
    stop: list[str] | None = field(default=None, metadata=_http())
    stop_token_ids: list[int] | None = field(default=None, metadata=_http())
    ignore_eos: bool = field(default=False, metadata=_http())
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = field(default=True, metadata=_http())
    # what each RequestOutput carries (as vLLM's RequestOutputKind): "cumulative": text, token ids and
    # logprobs so far; "delta": only what is new since the previous output; "final_only": one output at the end
    output_kind: str = "cumulative"
    # token id -> added to its logit (OpenAI's [-100, 100])
    logit_bias: dict[int, float] | None = field(default=None, metadata=_http())
    constraint: Constraint | None = None  # structured output (JSON schema, grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self, vocab_size: int) -> None:
        def bad(name: str, why: str) -> None:
            raise RequestError(f"{name}: {why}")

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0):
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if not (self.repetition_penalty > 0.0):
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
                bad("stop", "must be a list of non-empty strings")
        if self.stop_token_ids is not None:
            if not all(isinstance(t, int) and 0 <= t < vocab_size for t in self.stop_token_ids):
                bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
        if self.output_kind not in OUTPUT_KINDS:
            bad("output_kind", f"must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        self._validate_structure(vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0 or v > min(vocab_size, 20)):
                bad(name, f"must be an integer in [0, {min(vocab_size, 20)}], got {v!r}")

    def _validate_structure(self, vocab_size: int) -> None:
        if self.logit_bias is not None:
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                    raise RequestError(f"logit_bias: token ids must be in [0, {vocab_size}), got {t!r}")
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                    raise RequestError(f"logit_bias: biases must be numbers in [-100, 100], got {b!r} for {t}")
        c = self.constraint
        if c is not None and (not isinstance(c, Constraint) or c.kind not in CONSTRAINT_KINDS):
            raise RequestError(f"constraint: must be a Constraint of kind {' or '.join(CONSTRAINT_KINDS)}")
