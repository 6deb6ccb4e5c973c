"""``python -m hybridps``: the tools, same as ``hybridps``."""

import sys

from hybridps.cli import main

if __name__ == "__main__":
    sys.exit(main())
