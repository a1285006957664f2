"""``python -m wrapperroute``: the same as the ``wrapperroute`` console script."""

import sys

from .cli import main

sys.exit(main())
