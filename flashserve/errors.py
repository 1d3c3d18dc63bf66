"""The one base class of errors caused by the user's input (config, checkpoint, request, CLI value).

Entry points catch :class:`UserError` to report the message without a traceback; anything else is a bug.
Torch-free, so every part of the package can derive from it.
"""


class UserError(ValueError):
    """Bad input from the user; the message says exactly what is wrong."""
