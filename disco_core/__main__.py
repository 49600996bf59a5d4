"""``python -m disco_core``: the ``disco`` command."""

import sys

from .cli import main

sys.exit(main())
