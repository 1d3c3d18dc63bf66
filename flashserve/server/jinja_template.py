"""``--chat-template FILE``: a Jinja chat template, rendered as Hugging Face and vLLM render one (sandboxed,
``trim_blocks``/``lstrip_blocks``, ``raise_exception``), for checkpoints whose prompt format is neither V4.1's
DSML encoder nor the plain fallback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UserError
from .chat_encoding import THINK_START

BUILTIN = ("auto", "v41", "plain")


class TemplateError(Exception):
    """The template raised or failed while rendering one request."""


def _raise(message: str) -> None:
    raise TemplateError(message)


class JinjaTemplate:
    def __init__(self, source: str, origin: str):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            undefined=jinja2.ChainableUndefined)
        env.globals["raise_exception"] = _raise
        self.source = source
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise UserError(f"--chat-template: {origin} is not a valid Jinja template: {e}") from None

    @classmethod
    def load(cls, path: str) -> "JinjaTemplate":
        try:
            return cls(Path(path).read_text(), path)
        except OSError as e:
            raise UserError(f"--chat-template: {path!r} is neither {', '.join(BUILTIN)} nor a readable template "
                            f"file ({e.strerror})") from None

    def render(self, messages: list[dict[str, Any]], tools: list | None, add_generation_prompt: bool,
               special: dict[str, str | None]) -> tuple[str, bool]:
        """(prompt text, whether it opens a thought: the prompt ends with ``<think>``)."""
        import jinja2

        try:
            text = self.template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        **special)
        except (TemplateError, jinja2.TemplateError, TypeError, ValueError) as e:
            raise TemplateError(str(e)) from None
        return text, text.rstrip().endswith(THINK_START)
