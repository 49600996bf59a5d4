"""Fixtures shared by the disco-rpc test files."""

from __future__ import annotations

import pytest

from disco_core.testing.leftovers import (  # noqa: F401  (hooks: a run's own TMPDIR; leftovers fail it)
    pytest_configure,
    pytest_sessionfinish,
    pytest_unconfigure,
)


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key (paths)."""
    from disco_core.testing.tls import make_certificate

    return make_certificate(tmp_path_factory.mktemp("tls"))
