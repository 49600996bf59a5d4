"""Conformance kits: reusable pytest suites that plugins run against themselves.

A channel plugin proves it honours the session contract with:

.. code-block:: python

    import pytest
    import disco_core as disco
    from disco_core.testing import ChannelContract

    class TestMyChannel(ChannelContract):
        workers_are_processes = True     # workers 1..N-1 may be killed by the death tests

        @pytest.fixture
        def make_session(self):
            def make(num_workers, num_groups=1):
                return disco.Session.create("mine", num_workers=num_workers, num_groups=num_groups)
            return make

The worker-side helpers live in :mod:`disco_core.testing.funcs` (``testing.*``
global functions); the kit imports that module on every worker.

A CCL plugin does the same with :class:`CCLContract`, whose ``make_session(num_workers,
num_groups=1, **ccl_options)`` fixture returns a session with the CCL initialised
(``session_maker(disco.ProcessSession, "mine")`` makes one); its class attributes say
what the CCL supports (dtypes, timeouts, process workers).
"""

from .ccl_kit import CCLContract, session_maker
from .channel_kit import FUNCS_MODULE, ChannelContract

__all__ = ["ChannelContract", "CCLContract", "FUNCS_MODULE", "session_maker"]
