"""``python -m gangrun``: the ``gangrun`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
