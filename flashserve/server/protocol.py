"""Request parsing and validation for the OpenAI-compatible API, and the OpenAI error shape.

Every problem with user input raises :class:`APIError` (400 unless stated), which the app turns into
``{"error": {"message", "type", "param", "code"}}``. Validation is hand-written rather than left to a model
library so that each field gets an exact check (no silent coercion of ``"1"`` or ``true`` to numbers, no NaN),
and so the ``param`` of the error names the offending field (``messages[2].content``). The sampling fields are
not listed here: they are those :class:`SamplingParams` declares with :class:`RequestLimits`, read by one loop.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any

from ..engine.sampling_params import MAX_N, RequestLimits, SamplingParams

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_STOP_LEN = 1000
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(param: str | None, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(message, param=param, code=code)


# Anthropic's error types by HTTP status
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error"}


def anthropic_error(body: dict[str, Any], status: int) -> dict[str, Any]:
    """An OpenAI error body (:func:`error_body`) in Anthropic's shape, as ``/v1/messages`` answers errors."""
    err = body.get("error", {})
    message = err.get("message", "error")
    if err.get("param"):
        message = f"{err['param']}: {message}"
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


# ---------------------------------------------------------------------------------------------------------
# body decoding
# ---------------------------------------------------------------------------------------------------------

def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_json_body(raw: bytes) -> dict[str, Any]:
    """Bytes -> JSON object. Invalid UTF-8, invalid JSON (NaN/Infinity included), non-objects: 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.strip():
        raise APIError("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError("request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:
        raise APIError(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object", code="invalid_json")
    if _has_lone_surrogate(body):
        raise APIError("request body contains an unpaired UTF-16 surrogate escape", code="invalid_encoding")
    return body


def _has_lone_surrogate(obj: Any, depth: int = 0) -> bool:
    if depth > 64:
        raise APIError("request body is nested too deeply", code="invalid_json")
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(obj, dict):
        return any(_has_lone_surrogate(k, depth + 1) or _has_lone_surrogate(v, depth + 1) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_lone_surrogate(v, depth + 1) for v in obj)
    return False


# ---------------------------------------------------------------------------------------------------------
# typed getters
# ---------------------------------------------------------------------------------------------------------

_MISSING = object()


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def get_bool(body: dict, name: str, default: bool | None) -> bool | None:
    v = body.get(name, None)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"'{name}' must be a boolean, got {_type_name(v)}", "invalid_type")
    return v


def get_int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None,
            param: str | None = None) -> int | None:
    v = body.get(name, None)
    param = param or name
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 63:
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(param, f"'{param}' must be an integer, got {_type_name(v)}", "invalid_type")
    if lo is not None and v < lo:
        raise invalid(param, f"'{param}' must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise invalid(param, f"'{param}' must be <= {hi}, got {v}")
    return v


def get_float(body: dict, name: str, default: float | None, lo: float | None = None, hi: float | None = None,
              lo_open: bool = False) -> float | None:
    v = body.get(name, None)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(name, f"'{name}' must be a number, got {_type_name(v)}", "invalid_type")
    v = float(v)
    if not math.isfinite(v):
        raise invalid(name, f"'{name}' must be finite")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise invalid(name, f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise invalid(name, f"'{name}' must be <= {hi}, got {v}")
    return v


def get_str(body: dict, name: str, default: str | None, param: str | None = None) -> str | None:
    v = body.get(name, None)
    if v is None:
        return default
    if not isinstance(v, str):
        raise invalid(param or name, f"'{param or name}' must be a string, got {_type_name(v)}", "invalid_type")
    return v


def get_stop(body: dict) -> list[str] | None:
    v = body.get("stop", None)
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise invalid("stop", "'stop' must be a string or an array of strings", "invalid_type")
    if len(v) > MAX_STOP:
        raise invalid("stop", f"'stop' may hold at most {MAX_STOP} sequences")
    for i, s in enumerate(v):
        if not isinstance(s, str):
            raise invalid(f"stop[{i}]", f"'stop[{i}]' must be a string, got {_type_name(s)}", "invalid_type")
        if not s:
            raise invalid(f"stop[{i}]", "stop sequences must not be empty")
        if len(s) > MAX_STOP_LEN:
            raise invalid(f"stop[{i}]", f"stop sequences are limited to {MAX_STOP_LEN} characters")
    return v or None


def get_stop_token_ids(body: dict, vocab_size: int) -> list[int] | None:
    ids = body.get("stop_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise invalid("stop_token_ids", "'stop_token_ids' must be an array of integers", "invalid_type")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise invalid("stop_token_ids", f"'stop_token_ids' holds ids outside [0, {vocab_size}): {bad[:5]}")
    return ids or None


def get_logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's ``{"token id": bias}`` with biases in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise invalid("logit_bias", "'logit_bias' must be an object mapping token ids to biases", "invalid_type")
    if len(bias) > 1024:
        raise invalid("logit_bias", "'logit_bias' may hold at most 1024 tokens")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise invalid("logit_bias", f"'logit_bias' keys must be token ids, got {key!r}", "invalid_type") from None
        if not 0 <= tid < vocab_size:
            raise invalid("logit_bias", f"'logit_bias' token id {tid} is outside [0, {vocab_size})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise invalid("logit_bias", f"'logit_bias[{key}]' must be a number in [-100, 100], got {value!r}")
        out[tid] = float(value)
    return out or None


# ---------------------------------------------------------------------------------------------------------
# sampling fields
# ---------------------------------------------------------------------------------------------------------

# readers of the request fields whose JSON value is not a number or a boolean: (body, vocab_size) -> value
_READERS = {"stop": lambda body, _: get_stop(body), "stop_token_ids": get_stop_token_ids,
            "logit_bias": get_logit_bias}


def _request_fields() -> list[tuple[str, type, RequestLimits]]:
    """(name, declared type without ``None``, limits) of each SamplingParams field a request sets."""
    hints = typing.get_type_hints(SamplingParams)
    out = []
    for f in dataclasses.fields(SamplingParams):
        if "request" in f.metadata:
            typ = next(t for t in typing.get_args(hints[f.name]) or [hints[f.name]] if t is not type(None))
            if typ not in (bool, int, float) and f.name not in _READERS:
                raise TypeError(f"SamplingParams.{f.name}: no request reader for {typ}")
            out.append((f.name, typ, f.metadata["request"]))
    return out


REQUEST_FIELDS = _request_fields()


def _parse_sampling(body: dict, *, vocab_size: int) -> SamplingParams:
    """The request's sampling fields, read as :class:`SamplingParams` declares them: each field that carries
    :class:`RequestLimits`, under its own name, checked against its declared type and those limits (numbers and
    booleans) or by its reader (stop sequences, token ids); a field the request leaves out keeps its default.
    The endpoint sets max_tokens and logprobs, whose request fields differ between the APIs."""
    given: dict[str, Any] = {}
    for name, typ, lim in REQUEST_FIELDS:
        if typ is bool:
            value = get_bool(body, name, None)
        elif typ is int:
            value = get_int(body, name, None, lim.lo, lim.hi)
        elif typ is float:
            value = get_float(body, name, None, lim.lo, lim.hi, lim.lo_open)
        else:
            value = _READERS[name](body, vocab_size)
        if value is not None:
            given[name] = value
    params = SamplingParams(**given)
    best_of = get_int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != params.n:
        raise invalid("best_of", "'best_of' different from 'n' is not supported", "unsupported_value")
    if params.seed is not None:
        params.seed %= 2 ** 63  # into [0, 2**63): the engine's seed + choice index stays a valid torch seed
    return params


# ---------------------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------------------

@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    sampling: SamplingParams  # the request's sampling fields; the handler sets max_tokens, logprobs, constraint
    max_tokens: int | None = None  # max_completion_tokens or max_tokens; None: what the context leaves
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"  # none | auto | required | named
    tool_name: str | None = None  # the function a named tool_choice forces
    response_format: dict[str, Any] | None = None  # {"type": "json_object"} or {"type": "json_schema", "schema": ...}
    thinking: bool | None = None
    reasoning_effort: str | int | None = None
    drop_thinking: bool = True
    add_generation_prompt: bool = True
    user: str | None = None


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    sampling: SamplingParams  # the request's sampling fields; the handler sets max_tokens and logprobs
    max_tokens: int | None = None  # 0: echo the prompt only; None: the server's default
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None
    echo: bool = False
    user: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _parse_stream(body: dict) -> tuple[bool, bool, bool]:
    stream = get_bool(body, "stream", False)
    so = body.get("stream_options")
    include_usage = continuous = False
    if so is not None:
        if not isinstance(so, dict):
            raise invalid("stream_options", "'stream_options' must be an object", "invalid_type")
        if not stream:
            raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise invalid("stream_options.include_usage", "'stream_options.include_usage' must be a boolean",
                          "invalid_type")
        include_usage = bool(iu)
        cu = so.get("continuous_usage_stats")
        if cu is not None and not isinstance(cu, bool):
            raise invalid("stream_options.continuous_usage_stats", "must be a boolean", "invalid_type")
        continuous = bool(cu)
    return stream, include_usage, continuous


def _parse_response_format(body: dict) -> dict[str, Any] | None:
    """``text`` -> None; ``json_object`` and ``json_schema`` -> what the output must be (the schema compiles later,
    in the structured-output backend, which names what it cannot handle)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise invalid("response_format", "'response_format' must be an object with a string 'type'", "invalid_type")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise invalid("response_format.type", f"response_format type {kind!r} is not supported; use 'text', "
                      "'json_object' or 'json_schema'", "unsupported_value")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise invalid("response_format.json_schema", "'response_format.json_schema' must be an object with a "
                      "'schema'", "invalid_type")
    schema = js.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise invalid("response_format.json_schema.schema", "'response_format.json_schema.schema' must be a JSON "
                      "schema object", "invalid_schema")
    return {"type": "json_schema", "schema": schema, "name": js.get("name")}


def _check_json_schema(schema: Any, param: str, depth: int = 0) -> None:
    """A light structural check of a tool's JSON schema (not a full metaschema validation)."""
    if depth > 32:
        raise invalid(param, "tool parameter schema is nested too deeply", "invalid_schema")
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise invalid(param, f"'{param}' must be a JSON schema object", "invalid_schema")
    t = schema.get("type")
    known = {"object", "array", "string", "number", "integer", "boolean", "null"}
    if t is not None:
        types = t if isinstance(t, list) else [t]
        if not types or any(not isinstance(x, str) or x not in known for x in types):
            raise invalid(f"{param}.type", f"'{param}.type' must be one of {sorted(known)}", "invalid_schema")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise invalid(f"{param}.properties", f"'{param}.properties' must be an object", "invalid_schema")
        for k, v in props.items():
            _check_json_schema(v, f"{param}.properties.{k}", depth + 1)
    req = schema.get("required")
    if req is not None and (not isinstance(req, list) or any(not isinstance(x, str) for x in req)):
        raise invalid(f"{param}.required", f"'{param}.required' must be an array of strings", "invalid_schema")
    items = schema.get("items")
    if items is not None:
        if isinstance(items, list):
            for i, it in enumerate(items):
                _check_json_schema(it, f"{param}.items[{i}]", depth + 1)
        else:
            _check_json_schema(items, f"{param}.items", depth + 1)
    enum = schema.get("enum")
    if enum is not None and not isinstance(enum, list):
        raise invalid(f"{param}.enum", f"'{param}.enum' must be an array", "invalid_schema")


def _parse_tools(body: dict) -> tuple[list[dict[str, Any]] | None, str, str | None]:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools", "'tools' must be an array", "invalid_type")
        out = []
        for i, t in enumerate(tools):
            p = f"tools[{i}]"
            if not isinstance(t, dict):
                raise invalid(p, f"'{p}' must be an object", "invalid_type")
            if t.get("type", "function") != "function":
                raise invalid(f"{p}.type", f"'{p}.type' must be 'function'")
            fn = t.get("function")
            if not isinstance(fn, dict):
                raise invalid(f"{p}.function", f"'{p}.function' must be an object", "invalid_type")
            name = fn.get("name")
            if not isinstance(name, str) or not _TOOL_NAME.match(name):
                raise invalid(f"{p}.function.name", f"'{p}.function.name' must be 1-64 characters of a-z, A-Z, "
                              "0-9, '_', '.', '-'", "invalid_schema")
            if name in names:
                raise invalid(f"{p}.function.name", f"duplicate tool name {name!r}", "invalid_schema")
            names.append(name)
            desc = fn.get("description")
            if desc is not None and not isinstance(desc, str):
                raise invalid(f"{p}.function.description", f"'{p}.function.description' must be a string",
                              "invalid_type")
            params = fn.get("parameters")
            if params is not None:
                if not isinstance(params, dict):
                    raise invalid(f"{p}.function.parameters", f"'{p}.function.parameters' must be a JSON schema "
                                  "object", "invalid_schema")
                _check_json_schema(params, f"{p}.function.parameters")
            strict = fn.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise invalid(f"{p}.function.strict", f"'{p}.function.strict' must be a boolean", "invalid_type")
            # the function object is rendered into the prompt as given (as the reference encoder does)
            out.append({"type": "function", "function": fn})
        tools = out or None
    mode, forced = "auto", None
    if choice is not None:
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise invalid("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or a named function")
            mode = choice
        elif isinstance(choice, dict):
            fn = choice.get("function")
            if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise invalid("tool_choice", "named 'tool_choice' must be {'type': 'function', 'function': "
                              "{'name': ...}}", "invalid_type")
            if fn["name"] not in names:
                raise invalid("tool_choice.function.name", f"tool_choice names {fn['name']!r}, which is not in "
                              "'tools'")
            mode, forced = "named", fn["name"]
        else:
            raise invalid("tool_choice", "'tool_choice' must be a string or an object", "invalid_type")
        if mode in ("required", "named") and not tools:
            raise invalid("tool_choice", f"tool_choice {choice!r} needs 'tools'")
    return tools, mode, forced


# the V4.1 tokenizer's image token, one per image (docs/architecture.md#image-span)
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"


@dataclass(frozen=True)
class ImageRef:
    """One image of a request: a data URL's bytes, or a remote URL to fetch; ``param`` names its part."""

    param: str
    data: bytes | None = None
    url: str | None = None


def openai_image_part(part: dict[str, Any], param: str) -> ImageRef:
    """``{"type": "image_url", "image_url": {"url": ...}}`` (or the URL as a string)."""
    from ..engine.images import ImageError, bytes_from_data_url

    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise invalid(f"{param}.image_url.url", f"'{param}.image_url.url' must be a string URL", "invalid_type")
    if url.startswith("data:"):
        try:
            return ImageRef(param, data=bytes_from_data_url(url))
        except ImageError as e:
            raise invalid(f"{param}.image_url.url", str(e), "invalid_image") from None
    if url.startswith(("http://", "https://")):
        return ImageRef(param, url=url)
    raise invalid(f"{param}.image_url.url", "image URLs must be data: URLs (or http(s) when the server allows "
                  "remote images)", "invalid_image")


def _parse_content(content: Any, param: str, allow_none: bool, images: list | None = None) -> Any:
    """Text of a message's content; image parts (user messages only: ``images`` collects them, in order)
    become the image placeholder in the text."""
    if content is None:
        if allow_none:
            return None
        raise invalid(param, f"'{param}' must not be null", "invalid_type")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            pp = f"{param}[{j}]"
            if not isinstance(part, dict):
                raise invalid(pp, f"'{pp}' must be a content part object", "invalid_type")
            ptype = part.get("type")
            if ptype in ("text", "input_text"):
                if not isinstance(part.get("text"), str):
                    raise invalid(f"{pp}.text", f"'{pp}.text' must be a string", "invalid_type")
                texts.append(part["text"])
            elif ptype in ("image_url", "input_image") and images is not None:
                images.append(openai_image_part(part, pp))
                texts.append(IMAGE_PLACEHOLDER)
            elif isinstance(ptype, str):
                where = "in user messages only" if ptype in ("image_url", "input_image") else "text and image_url"
                raise invalid(f"{pp}.type", f"content part type {ptype!r} is not supported here ({where})",
                              "unsupported_value")
            else:
                raise invalid(f"{pp}.type", f"'{pp}.type' must be a string", "invalid_type")
        return "\n\n".join(texts)
    raise invalid(param, f"'{param}' must be a string or an array of content parts", "invalid_type")


def _parse_messages(body: dict) -> list[dict[str, Any]]:
    msgs = body.get("messages", _MISSING)
    if msgs is _MISSING or msgs is None:
        raise invalid("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(msgs, list):
        raise invalid("messages", "'messages' must be an array", "invalid_type")
    if not msgs:
        raise invalid("messages", "'messages' must not be empty", "empty_array")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(p, f"'{p}' must be an object", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{p}.role", f"'{p}.role' must be one of {list(ROLES)}, got {role!r}")
        # OpenAI's "developer" role is the system prompt of newer clients: encode it as one
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        has_calls = role == "assistant" and m.get("tool_calls") not in (None, [])
        if role != "assistant" and "content" not in m:
            raise invalid(f"{p}.content", f"'{p}.content' is required", "missing_required_parameter")
        images: list | None = [] if role == "user" else None
        msg["content"] = _parse_content(m.get("content"), f"{p}.content", allow_none=(role == "assistant"),
                                        images=images)
        if images:
            msg["images"] = images
        if role == "assistant" and msg["content"] is None and not has_calls and not m.get("reasoning_content"):
            raise invalid(f"{p}.content", f"'{p}.content' is required unless 'tool_calls' is set",
                          "missing_required_parameter")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise invalid(f"{p}.name", f"'{p}.name' must be a string", "invalid_type")
        if role == "assistant":
            for key in ("reasoning_content", "reasoning"):
                v = m.get(key)
                if v is not None:
                    if not isinstance(v, str):
                        raise invalid(f"{p}.{key}", f"'{p}.{key}' must be a string", "invalid_type")
                    msg["reasoning_content"] = v
            if has_calls:
                calls = m["tool_calls"]
                if not isinstance(calls, list):
                    raise invalid(f"{p}.tool_calls", f"'{p}.tool_calls' must be an array", "invalid_type")
                msg["tool_calls"] = []
                for j, tc in enumerate(calls):
                    q = f"{p}.tool_calls[{j}]"
                    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
                        raise invalid(q, f"'{q}' must be an object with a 'function' object", "invalid_type")
                    fn = tc["function"]
                    if not isinstance(fn.get("name"), str) or not fn["name"]:
                        raise invalid(f"{q}.function.name", f"'{q}.function.name' must be a non-empty string",
                                      "invalid_type")
                    args = fn.get("arguments", "{}")
                    if isinstance(args, dict):
                        args = json.dumps(args, ensure_ascii=False)
                    if not isinstance(args, str):
                        raise invalid(f"{q}.function.arguments", f"'{q}.function.arguments' must be a JSON string",
                                      "invalid_type")
                    tcid = tc.get("id")
                    if tcid is not None and not isinstance(tcid, str):
                        raise invalid(f"{q}.id", f"'{q}.id' must be a string", "invalid_type")
                    msg["tool_calls"].append({"id": tcid or f"call_{i}_{j}", "type": "function",
                                              "function": {"name": fn["name"], "arguments": args}})
        if role == "tool":
            tcid = m.get("tool_call_id")
            if tcid is not None and not isinstance(tcid, str):
                raise invalid(f"{p}.tool_call_id", f"'{p}.tool_call_id' must be a string", "invalid_type")
            msg["tool_call_id"] = tcid
        out.append(msg)
    return out


def _parse_common(body: dict) -> tuple[str | None, str | None]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "'model' must be a string", "invalid_type")
    user = get_str(body, "user", None)
    return model, user


def _parse_thinking(value: Any) -> bool | None:
    """DeepSeek's API field: ``{"type": "enabled" | "disabled"}`` (``chat_template_kwargs`` wins over it)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "disabled"):
        raise invalid("thinking", "'thinking' must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}")
    return value["type"] == "enabled"


def parse_chat_request(body: dict, *, vocab_size: int) -> ChatRequest:
    model, user = _parse_common(body)
    messages = _parse_messages(body)
    sampling = _parse_sampling(body, vocab_size=vocab_size)
    max_tokens = get_int(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, 1)
    stream, include_usage, continuous = _parse_stream(body)
    logprobs = bool(get_bool(body, "logprobs", False))
    top_logprobs = get_int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
    if top_logprobs and not logprobs:
        raise invalid("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    response_format = _parse_response_format(body)
    tools, tool_choice, tool_name = _parse_tools(body)
    if response_format is not None and tool_choice in ("required", "named"):
        raise invalid("response_format", "'response_format' cannot be combined with a forced 'tool_choice'")
    get_bool(body, "parallel_tool_calls", True)
    kwargs = body.get("chat_template_kwargs")
    thinking = None
    drop_thinking = True
    effort: Any = None
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object", "invalid_type")
        for key in ("thinking", "enable_thinking"):
            if key in kwargs and kwargs[key] is not None:
                if not isinstance(kwargs[key], bool):
                    raise invalid(f"chat_template_kwargs.{key}", f"'chat_template_kwargs.{key}' must be a boolean",
                                  "invalid_type")
                thinking = kwargs[key]
        if kwargs.get("drop_thinking") is not None:
            if not isinstance(kwargs["drop_thinking"], bool):
                raise invalid("chat_template_kwargs.drop_thinking", "must be a boolean", "invalid_type")
            drop_thinking = kwargs["drop_thinking"]
        if kwargs.get("reasoning_effort") is not None:
            effort = kwargs["reasoning_effort"]
    if thinking is None:
        thinking = _parse_thinking(body.get("thinking"))
    if body.get("reasoning_effort") is not None:
        effort = body["reasoning_effort"]
    if effort is not None:
        from .chat_encoding import effort_value

        if effort != "none":
            try:
                effort_value(effort)
            except ValueError as e:
                raise invalid("reasoning_effort", str(e)) from None
    add_gen = get_bool(body, "add_generation_prompt", True)
    return ChatRequest(model=model, messages=messages, sampling=sampling, max_tokens=max_tokens, stream=stream,
                       include_usage=include_usage, continuous_usage=continuous, logprobs=logprobs,
                       top_logprobs=top_logprobs or 0, tools=tools, tool_choice=tool_choice, tool_name=tool_name,
                       response_format=response_format, thinking=thinking, reasoning_effort=effort,
                       drop_thinking=drop_thinking, add_generation_prompt=add_gen, user=user)


def parse_completion_request(body: dict, *, vocab_size: int) -> CompletionRequest:
    model, user = _parse_common(body)
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("prompt", "'prompt' is required", "missing_required_parameter")
    raw = body["prompt"]
    prompts: list[str | list[int]]
    if isinstance(raw, str):
        prompts = [raw]
    elif isinstance(raw, list):
        if not raw:
            raise invalid("prompt", "'prompt' must not be empty", "empty_array")
        if all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
            prompts = [raw]
        elif all(isinstance(x, str) for x in raw):
            prompts = list(raw)
        elif all(isinstance(x, list) for x in raw):
            prompts = []
            for i, x in enumerate(raw):
                if not x or any(isinstance(t, bool) or not isinstance(t, int) for t in x):
                    raise invalid(f"prompt[{i}]", f"'prompt[{i}]' must be a non-empty array of token ids",
                                  "invalid_type")
                prompts.append(x)
        else:
            raise invalid("prompt", "'prompt' must be a string, an array of strings, an array of token ids or an "
                          "array of token-id arrays", "invalid_type")
    else:
        raise invalid("prompt", "'prompt' must be a string or an array", "invalid_type")
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise invalid(param, f"'{param}' must not be empty")
        else:
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise invalid(param, f"'{param}' holds token ids outside [0, {vocab_size}): {bad[:5]}")
    if len(prompts) > 64:
        raise invalid("prompt", "at most 64 prompts per request")
    sampling = _parse_sampling(body, vocab_size=vocab_size)
    max_tokens = get_int(body, "max_tokens", None, 0)
    if len(prompts) * sampling.n > 128:
        raise invalid("n", "'n' times the number of prompts must be at most 128")
    stream, include_usage, continuous = _parse_stream(body)
    logprobs = get_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = bool(get_bool(body, "echo", False))
    if body.get("suffix") is not None:
        raise invalid("suffix", "'suffix' is not supported", "unsupported_value")
    if max_tokens == 0 and not echo:
        raise invalid("max_tokens", "'max_tokens' must be >= 1 (0 is only meaningful with 'echo')")
    return CompletionRequest(model=model, prompts=prompts, sampling=sampling, max_tokens=max_tokens, stream=stream,
                             include_usage=include_usage, continuous_usage=continuous, logprobs=logprobs, echo=echo,
                             user=user)
