"""Certificates made in the test (`cryptography`): a CA, and server and client certificates
it signs for 127.0.0.1 and localhost, as PEM files (tests/test_tls.py, tests/test_nats_tls.py)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None,
          issuer_key: ec.EllipticCurvePrivateKey, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    b = (x509.CertificateBuilder().subject_name(name)
         .issuer_name(issuer.subject if issuer is not None else name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def write_pki(d: Path) -> dict[str, str]:
    """A CA (`ca`), a server certificate for 127.0.0.1 (`server`, `server_key`) and a client
    certificate (`client`, `client_key`), as PEM files in folder `d`: name -> path."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("kvloop test CA", ca_key, None, ca_key, ca=True)
    files: dict[str, str] = {}
    for name, data in (("ca", ca.public_bytes(serialization.Encoding.PEM)),):
        (d / f"{name}.pem").write_bytes(data)
        files[name] = str(d / f"{name}.pem")
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(f"kvloop {who}", key, ca, ca_key, ca=False)
        (d / f"{who}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{who}.key").write_bytes(_key_pem(key))
        files[who], files[f"{who}_key"] = str(d / f"{who}.pem"), str(d / f"{who}.key")
    return files
