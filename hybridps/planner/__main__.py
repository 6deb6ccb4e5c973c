"""``python -m hybridps.planner``: the ``hybridps plan`` command on its own."""

import sys

from hybridps.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
