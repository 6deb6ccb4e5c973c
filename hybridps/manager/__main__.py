"""``python -m hybridps.manager``: the node daemon, same as ``hybridps-manager``."""

import sys

from hybridps.cli import manager_main

if __name__ == "__main__":
    sys.exit(manager_main())
