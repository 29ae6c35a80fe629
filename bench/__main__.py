"""``python -m collectives.bench`` (or ``python -m bench`` from a checkout): the bench CLI."""

import sys

from .cli import main

sys.exit(main())
