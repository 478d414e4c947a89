"""`python -m batchspec`: the same command line as `batchspec`."""

from .cli import app

app(prog_name="batchspec")
