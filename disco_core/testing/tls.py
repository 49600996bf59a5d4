"""Certificates for tests of TLS: made with ``cryptography`` (a test dependency of the
core and a dependency of the network plugins), so no test needs the ``openssl``
command (the tests that used it skipped where it was missing)."""

from __future__ import annotations

import datetime
import ipaddress
import os

__all__ = ["make_certificate"]


def make_certificate(directory: str | os.PathLike, name: str = "cert") -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and ``localhost``, valid for a day.

    Parameters
    ----------
    directory : str or os.PathLike
        Where ``{name}.pem`` and ``{name}.key`` are written.
    name : str
        The files' stem (two certificates in one folder need two names).

    Returns
    -------
    tuple of str
        The paths of the certificate and of its private key (PEM, unencrypted). The
        certificate is its own CA: a context that trusts it (``cafile=``) verifies it,
        on either side of a connection.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())  # (fast to make, unlike RSA)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"disco-test-{name}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path = os.path.join(os.fspath(directory), f"{name}.pem")
    key_path = os.path.join(os.fspath(directory), f"{name}.key")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert_path, key_path
