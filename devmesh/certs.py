"""python -m devmesh certs --out DIR [--host NAME ...]: a dev CA and the mesh's certificates.

Writes into DIR (keys mode 0600):

- ca.pem / ca.key: the CA (10 years; keep ca.key off the machines that serve);
- router.pem / router.key: the router's server certificate, for its clients' TLS;
- worker.pem / worker.key: the workers' server certificate (mutual TLS with the router);
- mesh-client.pem / mesh-client.key: the router's client certificate: a worker started
  with `--tls-client-ca ca.pem` accepts only clients that present it (or another this CA
  signed for client use).

Every server certificate names localhost, 127.0.0.1 and each --host (compose service names:
router, worker-1, ...). EC P-256 keys, 1 year. For development and compose: a real
deployment takes its certificates from its own CA.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = (
    "localhost",
    "127.0.0.1",
    "router",
    "worker-1",
    "worker-2",
    "worker-3",
    "worker-tp",
)


@dataclass(frozen=True)
class MeshCerts:
    """The files `make_certs` writes, by role."""

    root: Path

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    def cert(self, name: str) -> Path:
        return self.root / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.root / f"{name}.key"

    def complete(self) -> bool:
        names = ("router", "worker", "mesh-client")
        return self.ca.exists() and all(
            self.cert(n).exists() and self.key(n).exists() for n in names
        )


def _name(common: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshserve dev"),
            x509.NameAttribute(NameOID.COMMON_NAME, common),
        ]
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _san(hosts: tuple[str, ...]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_certs(out: Path, hosts: tuple[str, ...] = DEFAULT_HOSTS, days: int = 365) -> MeshCerts:
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("meshserve dev CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    certs = MeshCerts(out)
    certs.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write_key(out / "ca.key", ca_key)
    roles = {
        "router": (ExtendedKeyUsageOID.SERVER_AUTH, True),
        "worker": (ExtendedKeyUsageOID.SERVER_AUTH, True),
        "mesh-client": (ExtendedKeyUsageOID.CLIENT_AUTH, False),
    }
    for name, (usage, server) in roles.items():
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(f"meshserve {name}"))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server:
            builder = builder.add_extension(_san(hosts), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        certs.cert(name).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(certs.key(name), key)
    return certs
