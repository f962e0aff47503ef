"""python -m flashtile ...: the `flashtile` command (flashtile.cli)."""

import sys

from flashtile.cli import main

sys.exit(main())
