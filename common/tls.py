"""TLS for the mesh's gRPC: credentials from PEM files (made by `python -m devmesh certs`).

- The router serves TLS to clients when given a certificate and key.
- A worker given a client CA serves mutual TLS: it accepts only clients that present a
  certificate from that CA (the router's mesh certificate), so it cannot be called around
  the router.
- The router dials workers with the CA that signed their certificates and its own client
  certificate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path}: {e}") from e


def server_credentials(
    cert: Path, key: Path, client_ca: Path | None = None
) -> grpc.ServerCredentials:
    """TLS with this certificate; with `client_ca`, clients must present a certificate it
    signed (mutual TLS)."""
    return grpc.ssl_server_credentials(
        [(_read(key, "TLS key"), _read(cert, "TLS certificate"))],
        root_certificates=_read(client_ca, "client CA") if client_ca else None,
        require_client_auth=client_ca is not None,
    )


def channel_credentials(
    ca: Path | None, cert: Path | None = None, key: Path | None = None
) -> grpc.ChannelCredentials:
    """Trust `ca` (None: the system's roots); present `cert`/`key` when given (mutual TLS)."""
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "CA certificate") if ca else None,
        private_key=_read(key, "TLS key") if key else None,
        certificate_chain=_read(cert, "TLS certificate") if cert else None,
    )


def add_port(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None
) -> int:
    """Bind `address`, with TLS when credentials are given."""
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def aio_channel(
    address: str, credentials: grpc.ChannelCredentials | None, options: list | None = None
) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


def channel(
    address: str, credentials: grpc.ChannelCredentials | None, options: list | None = None
) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """--ca (TLS), --cert/--key (mutual TLS): what a CLI that calls the mesh takes."""
    parser.add_argument("--ca", type=Path, help="TLS: trust this CA (PEM)")
    parser.add_argument("--cert", type=Path, help="mutual TLS: this client's certificate")
    parser.add_argument("--key", type=Path, help="mutual TLS: its key")


def client_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """The channel credentials add_client_arguments' flags ask for; None: plaintext."""
    return channel_credentials(args.ca, args.cert, args.key) if args.ca else None
