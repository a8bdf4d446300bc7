"""``python -m cupool.validate``: see ``cupool.validate.runner``."""

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())
