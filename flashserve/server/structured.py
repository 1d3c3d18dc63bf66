"""Chat requests' structured-output fields as engine :class:`Constraint`s: ``response_format`` as a JSON schema,
``tool_choice`` ``"required"`` or a named function as a Lark grammar of V4.1's DSML tool-call block.

In thinking mode the constraint starts after ``</think>``: the reasoning runs free, as vLLM does with a
reasoning parser, and the answer (or the call) is what must match.
"""

from __future__ import annotations

import json
from typing import Any

from . import chat_encoding as ce
from .protocol import ChatRequest


def _lark_str(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _param_rule(name: str, schema: Any, dsml: str, defs: dict[str, Any]) -> str:
    """One ``<｜DSML｜ parameter ...>value</｜DSML｜ parameter>`` line: strings raw, other values as JSON (with the
    tool schema's ``$defs`` / ``definitions``, which a ``$ref`` in the parameter may point into)."""
    schema = schema if isinstance(schema, dict) else {}
    is_str = schema.get("type") == "string"
    head = f'"<" {dsml} {_lark_str(f" parameter name={json.dumps(name)} string={json.dumps(str(is_str).lower())}>")}'
    tail = f'{dsml} " parameter>"'
    n = schema.get("maxLength")
    if is_str and isinstance(schema.get("enum"), list):
        value = "(" + " | ".join(_lark_str(str(v)) for v in schema["enum"]) + ") \"</\""
    elif is_str and isinstance(n, int) and n >= 0:
        value = f'/[^<]{{0,{n}}}/ "</"'  # a regex cannot count characters and allow "<" but not "</" at once
    elif is_str:
        # raw text up to the closing "</", "<" allowed (code, HTML): one terminal with its "</", or the lexer,
        # having read a "<" into the text, could not give it back to the closing tag
        value = r"/([^<]|<[^\/])*<\//"
    else:
        value = "%json " + json.dumps({**defs, **(schema or {})}) + ' "</"'
    return f"{head} {value} {tail}"


def _invoke_rule(fn: dict[str, Any], dsml: str) -> str:
    """One ``<｜DSML｜ invoke name="f">`` block: required parameters always, the others optionally, in order."""
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    defs = {k: params[k] for k in ("$defs", "definitions") if isinstance(params.get(k), dict)}
    parts = []
    for k, sub in props.items():
        line = f'"\\n" {_param_rule(k, sub, dsml, defs)}'
        parts.append(line if k in required else f"({line})?")
    name = json.dumps(fn["name"])
    head = f'"<" {dsml} {_lark_str(f" invoke name={name}>")}'
    return f'{head} {" ".join(parts)} "\\n</" {dsml} " invoke>"'


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None, dsml_id: int) -> str:
    """Lark grammar of a DSML calls block: one or more calls of any tool, or exactly one call of ``name``."""
    dsml = f"<[{dsml_id}]>"
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    invokes = [f"invoke{i}: {_invoke_rule(fn, dsml)}" for i, fn in enumerate(fns)]
    alt = " | ".join(f"invoke{i}" for i in range(len(fns)))
    calls = "invoke" if name is not None else 'invoke ("\\n" invoke)*'
    return "\n".join([f'start: "<" {dsml} " calls>\\n" {calls} "\\n</" {dsml} " calls>"', f"invoke: {alt}",
                      *invokes])


def chat_constraint(req: ChatRequest, thinking: bool, tokenizer: Any) -> Any:
    """The engine Constraint a chat request asks for, or None."""
    from flashserve.engine.sampling_params import Constraint

    after = tokenizer.token_to_id(ce.THINK_END) if thinking else None
    rf = req.response_format
    if rf is not None:
        schema = {"type": "object"} if rf["type"] == "json_object" else rf["schema"]
        return Constraint("json", json.dumps(schema), after=after, param="response_format")
    if req.tool_choice in ("required", "named") and req.tools:
        dsml_id = tokenizer.token_to_id(ce.DSML)
        return Constraint("lark", tool_call_grammar(req.tools, req.tool_name, dsml_id), after=after,
                          param="tool_choice")
    return None
