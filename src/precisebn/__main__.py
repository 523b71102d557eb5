"""``python -m precisebn``: the command line."""

from .cli import run

run()
