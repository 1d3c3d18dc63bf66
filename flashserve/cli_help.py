"""How every ``flashserve`` command prints its ``--help``: each flag's default shown once.

argparse's ``ArgumentDefaultsHelpFormatter`` appends ``(default: X)`` to every help text, also where the text
already says what the default is (``(default: the model's own) (default: None)``). This formatter appends it
only where the text says nothing about the default and the default is a value (not None, not an off switch).
Torch-free: the planner's command uses it too.
"""

from __future__ import annotations

import argparse
import re

_SAYS_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


class HelpFormatter(argparse.HelpFormatter):
    """``formatter_class`` of the ``flashserve`` parsers."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or _SAYS_DEFAULT.search(text):
            return text
        default = action.default
        if default is None or default is argparse.SUPPRESS or default in ((), []):
            return text
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if switch or (not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)):
            return text  # --json style switches (off unless given) and required positionals
        return f"{text} (default: %(default)s)"
