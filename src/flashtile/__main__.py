"""python -m flashtile ...: the `flashtile` command (flashtile.cli)."""

import sys

from flashtile.cli import main

if __name__ == "__main__":  # importing the module (pkgutil.walk_packages) runs nothing
    sys.exit(main())
