"""``python -m disco_socket HOST PORT N``: run a node agent (see :mod:`disco_socket.cli`)."""

import sys

from disco_socket.cli import module_main

sys.exit(module_main())
