"""``python -m gangrun``: the ``gangrun`` command."""

import sys

from .cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
