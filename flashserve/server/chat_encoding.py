"""Chat prompt encoders: the DeepSeek-V4.1 "DSML" format (docs/architecture.md#tokenizer-and-chat-format) and a plain
fallback.

Input messages are OpenAI chat messages that :mod:`flashserve.server.protocol` has already validated and
normalised (``content`` is a string or ``None``; assistant ``tool_calls`` are OpenAI dicts; ``tool`` messages
carry ``tool_call_id``). The encoders return prompt *text*; the special-token strings in it are turned into
their ids by the tokenizer.

V4.1 layout (one conversation)::

    BOS [<｜System｜> Reasoning Effort: N (...)\\n\\n]      (thinking mode, first message only)
    [<｜System｜>]system text [\\n\\n## Tools ...]           (first-position system message)
    <｜User｜>text | <tool_result>..</tool_result>            (tool results merge into user turns)
    <｜Assistant｜></think>answer[\\n\\n<｜DSML｜ calls>..]<EOS>   (history; reasoning dropped unless tools)
    <｜Assistant｜><think>                                   (generation header, thinking mode)
    <｜Assistant｜></think>                                  (generation header, chat mode)
"""

from __future__ import annotations

import copy
import json
from typing import Any, Iterable

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

# V4.1 tags carry a space after ｜DSML｜ (V4 had none).
CALLS_TAG = DSML + " calls"
INVOKE_TAG = DSML + " invoke"
PARAM_TAG = DSML + " parameter"

# Reasoning-effort tables: each named level (and ``None``, a request that names none) -> the budget N of the
# "Reasoning Effort: N" line ("none" switches thinking off instead, see resolve_mode).
#   released:    DeepSeek-V4.1's released encoder (low 50, high 75, max 100, default high); DeepSeek's API maps
#                minimal to low and medium and xhigh to high.
#   pre-release: the encoder of the pre-release checkpoints (low 25, high 50, xhigh 75, max 100, default high).
EFFORT_TABLES: dict[str, dict[str | None, int]] = {
    "released": {None: 75, "minimal": 50, "low": 50, "medium": 75, "high": 75, "xhigh": 75, "max": 100},
    "pre-release": {None: 50, "minimal": 25, "low": 25, "medium": 50, "high": 50, "xhigh": 75, "max": 100},
}
DEFAULT_EFFORT_TABLE = "released"
EFFORT_NAMES = ("minimal", "low", "medium", "high", "xhigh", "max")

_EFFORT_LINE = "Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

_TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{calls}>" block like the following:

<{calls}>
<{invoke} name="$TOOL_NAME">
<{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{param}>
...
</{invoke}>
<{invoke} name="$TOOL_NAME2">
...
</{invoke}>
</{calls}>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {ts}), you MUST output your complete reasoning inside {ts}...{te} BEFORE any tool calls or final response.

Otherwise, output directly after {te} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True, default=str)


def render_tools(tools: Iterable[dict[str, Any]]) -> str:
    """The "## Tools" system section; ``tools`` are OpenAI tool dicts (``{"type": "function", "function": {...}}``)."""
    schemas = "\n".join(_json(t["function"]) for t in tools)
    return _TOOLS_SECTION.format(calls=CALLS_TAG, invoke=INVOKE_TAG, param=PARAM_TAG, ts=THINK_START, te=THINK_END,
                                 schemas=schemas)


def _effort_table(table: str) -> dict[str | None, int]:
    try:
        return EFFORT_TABLES[table]
    except KeyError:
        raise ValueError(f"unknown reasoning-effort table {table!r}; known: {', '.join(EFFORT_TABLES)}") from None


def effort_value(effort: str | int | None, table: str = DEFAULT_EFFORT_TABLE) -> int:
    """A reasoning effort as the V4.1 integer 1..100: a level name (or None, the default) looked up in ``table``
    (see EFFORT_TABLES), an integer as it is. Raises ValueError for anything else."""
    budgets = _effort_table(table)
    if effort is None:
        return budgets[None]
    if isinstance(effort, bool):
        raise ValueError("reasoning_effort must be a level name or an integer in [1, 100]")
    if isinstance(effort, int):
        if 1 <= effort <= 100:
            return effort
        raise ValueError("reasoning_effort must be an integer in [1, 100]")
    if isinstance(effort, str) and effort in EFFORT_NAMES:
        return budgets[effort]
    raise ValueError(f"reasoning_effort must be one of none, {', '.join(EFFORT_NAMES)} or an integer in [1, 100]")


def resolve_mode(thinking: bool | None, reasoning_effort: str | int | None, default_thinking: bool = True,
                 table: str = DEFAULT_EFFORT_TABLE) -> tuple[bool, int]:
    """(thinking?, effort) for one request: ``chat_template_kwargs.thinking`` wins; ``reasoning_effort="none"``
    selects chat mode and any other effort thinking mode; otherwise ``default_thinking``."""
    if reasoning_effort == "none":
        return (bool(thinking) if thinking is not None else False), effort_value(None, table)
    eff = effort_value(reasoning_effort, table)
    if thinking is None:
        thinking = True if reasoning_effort is not None else default_thinking
    return bool(thinking), eff


def encode_tool_arguments(arguments: Any) -> str:
    """OpenAI ``function.arguments`` (a JSON string, maybe double-encoded, or a dict) as DSML parameters."""
    args = arguments
    for _ in range(2):
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                break
    if not isinstance(args, dict):
        args = {"arguments": arguments}
    lines = []
    for key, value in args.items():
        is_str = isinstance(value, str)
        text = value if is_str else _json(value)
        lines.append(f'<{PARAM_TAG} name="{key}" string="{"true" if is_str else "false"}">{text}</{PARAM_TAG}>')
    return "\n".join(lines)


def encode_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    invokes = []
    for tc in tool_calls:
        fn = tc.get("function") or {}
        invokes.append(f'<{INVOKE_TAG} name="{fn.get("name", "")}">\n'
                       f'{encode_tool_arguments(fn.get("arguments", "{}"))}\n</{INVOKE_TAG}>')
    return f"<{CALLS_TAG}>\n" + "\n".join(invokes) + f"\n</{CALLS_TAG}>"


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # list of content parts (protocol only lets text parts through)
    return "\n\n".join(p.get("text", "") for p in content if isinstance(p, dict))


def _merge_user_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results become ``<tool_result>`` blocks of user turns; consecutive user/tool messages share one turn."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        role = msg["role"]
        if role in ("user", "tool"):
            if role == "tool":
                block = {"type": "tool_result", "id": msg.get("tool_call_id") or "", "text": _text(msg.get("content"))}
            else:
                block = {"type": "text", "text": _text(msg.get("content"))}
            if out and out[-1]["role"] == "user":
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block]})
        else:
            out.append(dict(msg))
    # tool results in the order of the preceding assistant's calls
    order: dict[str, int] = {}
    for msg in out:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            order = {tc.get("id"): i for i, tc in enumerate(msg["tool_calls"]) if tc.get("id")}
        elif msg["role"] == "user" and order:
            results = [b for b in msg["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1:
                it = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))
                msg["blocks"] = [next(it) if b["type"] == "tool_result" else b for b in msg["blocks"]]
    return out


def _last_user_index(messages: list[dict[str, Any]]) -> int:
    """Last user/developer turn; a system message after the first position counts as a user turn in V4.1."""
    for i in range(len(messages) - 1, -1, -1):
        role = messages[i]["role"]
        if role in ("user", "developer") or (role == "system" and i > 0):
            return i
    return -1


def encode_v41(messages: list[dict[str, Any]], *, thinking: bool = True, reasoning_effort: str | int | None = None,
               tools: list[dict[str, Any]] | None = None, drop_thinking: bool = True,
               add_bos: bool = True, add_generation_prompt: bool = True,
               effort_table: str = DEFAULT_EFFORT_TABLE) -> str:
    """Encode an OpenAI conversation in the V4.1 DSML prompt format (effort names read in ``effort_table``)."""
    effort = effort_value(reasoning_effort, effort_table)
    msgs = [dict(m) for m in copy.deepcopy(messages)]
    for m in msgs:
        if "reasoning" in m and "reasoning_content" not in m:
            m["reasoning_content"] = m["reasoning"]
    if tools:
        system = next((m for m in msgs if m["role"] == "system"), None)
        if system is None:
            system = {"role": "system", "content": ""}
            msgs.insert(0, system)
        system["tools"] = tools
    msgs = _merge_user_turns(msgs)

    drop = drop_thinking and not tools
    if thinking and drop:
        last = _last_user_index(msgs)
        kept = []
        for i, m in enumerate(msgs):
            if m["role"] in ("user", "system") or i >= last:
                kept.append(m)
            elif m["role"] == "assistant":
                m = dict(m)
                m.pop("reasoning_content", None)
                kept.append(m)
            # developer messages before the last user turn are dropped
        msgs = kept

    last_user = _last_user_index(msgs)
    out = [BOS] if add_bos else []
    n = len(msgs)
    for i, m in enumerate(msgs):
        role = m["role"]
        is_last = i == n - 1
        effort_prompt = _EFFORT_LINE.format(n=effort) if (i == 0 and thinking) else ""
        part = SYSTEM if i == 0 and (effort_prompt or role == "system") else ""
        part += effort_prompt
        if role == "system":
            if i > 0:
                part += SYSTEM
            part += _text(m.get("content"))
            if m.get("tools"):
                part += "\n\n" + render_tools(m["tools"])
        elif role == "developer":
            part += USER + _text(m.get("content"))
            if m.get("tools"):
                part += "\n\n" + render_tools(m["tools"])
        elif role == "user":
            pieces = [f"<tool_result>{b['text']}</tool_result>" if b["type"] == "tool_result" else b["text"]
                      for b in m["blocks"]]
            part += USER + "\n\n".join(pieces)
        elif role == "assistant":
            calls = "\n\n" + encode_tool_calls(m["tool_calls"]) if m.get("tool_calls") else ""
            reasoning = ""
            if thinking and (not drop or i > last_user):
                reasoning = (m.get("reasoning_content") or "") + THINK_END
            part += reasoning + _text(m.get("content")) + calls + EOS
        else:  # pragma: no cover - protocol rejects other roles
            raise ValueError(f"unknown role {role!r}")
        out.append(part)

        if is_last and not add_generation_prompt:
            continue
        if not is_last and msgs[i + 1]["role"] != "assistant":
            continue
        if role in ("user", "developer") or (role == "system" and i > 0) or (is_last and role in ("system", "assistant")):
            if thinking and (not drop or i >= last_user):
                out.append(ASSISTANT + THINK_START)
            else:
                out.append(ASSISTANT + THINK_END)
    return "".join(out)


def encode_plain(messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                 bos: str | None = None, add_generation_prompt: bool = True) -> str:
    """Fallback template for checkpoints without the V4.1 encoder: role-prefixed plain text.
    Tool schemas go into the system text; tool results appear as ``Tool result:`` turns."""
    lines = []
    if tools:
        lines.append("System: You can call these tools:\n" + "\n".join(_json(t["function"]) for t in tools))
    for m in messages:
        role = m["role"]
        text = _text(m.get("content"))
        if role in ("system", "developer"):
            lines.append(f"System: {text}")
        elif role == "user":
            lines.append(f"User: {text}")
        elif role == "tool":
            lines.append(f"Tool result: {text}")
        else:
            if m.get("tool_calls"):
                text = (text + "\n" if text else "") + "\n".join(
                    f"Tool call: {(tc.get('function') or {}).get('name', '')}"
                    f"({(tc.get('function') or {}).get('arguments', '')})" for tc in m["tool_calls"])
            lines.append(f"Assistant: {text}")
    prompt = "\n\n".join(lines)
    if add_generation_prompt:
        prompt += "\n\nAssistant:"
    return (bos or "") + prompt
