"""`python -m densetrain` is the `densetrain` command."""

from densetrain.cli.main import entry

entry()
