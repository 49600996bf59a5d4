"""Fixtures shared by the disco-rpc test files."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from disco_core.testing.leftovers import (  # noqa: F401  (hooks: a run's own TMPDIR; leftovers fail it)
    pytest_configure,
    pytest_sessionfinish,
    pytest_unconfigure,
)


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key (paths), made by the openssl CLI."""
    if not shutil.which("openssl"):
        pytest.skip("the openssl command is not available to make a certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    r = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        capture_output=True,
    )  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {r.stderr.decode()[:200]}")
    return str(cert), str(key)
