"""python -m common.health ADDRESS [--service S] [--ca CA [--cert C --key K]]: exit 0 when
grpc.health.v1 says SERVING (over TLS with --ca; mutual TLS with --cert/--key too).

What the images' HEALTHCHECKs run: it needs the core install only (no numpy), so the
router image has it too. `python -m client health` is the same check.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import tls


def check(channel: grpc.Channel, service: str = "", timeout: float = 3.0) -> str:
    """grpc.health.v1 status name: SERVING, NOT_SERVING, SERVICE_UNKNOWN or UNKNOWN."""
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=timeout
    )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m common.health", description=__doc__)
    parser.add_argument("address")
    parser.add_argument("--service", default="")
    parser.add_argument("--timeout", type=float, default=3.0)
    tls.add_client_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    credentials = tls.client_credentials(args)
    try:
        with tls.channel(args.address, credentials) as channel:
            status = check(channel, args.service, args.timeout)
    except grpc.RpcError as e:
        print(f"{e.code().name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
