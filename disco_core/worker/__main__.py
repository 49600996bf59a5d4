"""``python -m disco_core.worker``: run a worker process (see :func:`disco_core.worker.main`)."""

from disco_core.worker import main

main()
