"""``python -m hisparse``: the command line."""

import sys

from hisparse.cli import main

if __name__ == "__main__":
    sys.exit(main())
