"""`python -m densetrain` is the `densetrain` command."""

import sys

from densetrain.cli.main import main

sys.exit(main())
