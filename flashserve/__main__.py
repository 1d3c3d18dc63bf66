"""``python -m flashserve`` runs the command line."""

from .cli import run

run()
