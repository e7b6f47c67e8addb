"""python -m client {health,metadata,infer} ADDRESS ...: one call from the command line.

`health` exits 0 when grpc.health.v1 answers SERVING (the compose healthchecks use it).
TLS: --ca (and --cert/--key for a worker's mutual TLS); an API key from MESHSERVE_API_KEY.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
import numpy as np

from client.client import Client
from common import dtypes, tls

API_KEY_VARIABLE = "MESHSERVE_API_KEY"  # the router's tenants: never a flag


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    health = sub.add_parser("health", help="exit 0 if SERVING")
    health.add_argument("address")
    health.add_argument("--service", default="")
    health.add_argument("--timeout", type=float, default=3.0)
    meta = sub.add_parser("metadata", help="server metadata, or a model's")
    meta.add_argument("address")
    meta.add_argument("model", nargs="?")
    infer = sub.add_parser("infer", help="one request: --text, or ones of the model's shape")
    infer.add_argument("address")
    infer.add_argument("model")
    infer.add_argument("--text", nargs="+")
    infer.add_argument("--timeout", type=float, default=30.0)
    for p in (health, meta, infer):
        tls.add_client_arguments(p)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    credentials = tls.client_credentials(args)
    with Client(
        args.address,
        timeout=getattr(args, "timeout", 10.0),
        credentials=credentials,
        api_key=os.environ.get(API_KEY_VARIABLE),
    ) as client:
        try:
            if args.command == "health":
                status = client.health(args.service)
                print(status)
                return 0 if status == "SERVING" else 1
            if args.command == "metadata":
                print(client.model_metadata(args.model) if args.model else client.server_metadata())
                return 0
            if args.text:
                print(client.infer_text(args.model, args.text))
                return 0
            meta = client.model_metadata(args.model)
            inputs = {
                t.name: np.ones([1 if d < 0 else d for d in t.shape], dtypes.NUMPY[t.datatype])
                for t in meta.inputs
            }
            for name, array in client.infer(args.model, inputs).outputs.items():
                print(name, array.dtype, array.shape, array.tolist())
            return 0
        except grpc.RpcError as e:
            print(f"{e.code().name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
            return 1


if __name__ == "__main__":
    sys.exit(main())
