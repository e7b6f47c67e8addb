"""python -m devmesh certs --out DIR [--host NAME ...]: the mesh's dev CA and certificates
(devmesh/certs.py); python -m devmesh redis-users --out DIR [--split]: Redis ACL users per
role with their password files (devmesh/redis_acl.py; --split for Redis 7's read/write key
permissions, as compose runs). `make run` is `python -m devmesh.launch`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import paths
from devmesh.certs import DEFAULT_HOSTS, make_certs
from devmesh.redis_acl import make_users


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    certs = sub.add_parser("certs", help="a dev CA, the router's and workers' certificates")
    certs.add_argument("--out", type=Path, default=paths.build("certs"))
    certs.add_argument(
        "--host",
        action="append",
        default=[],
        help=f"a name the servers are reached by (always: {', '.join(DEFAULT_HOSTS)})",
    )
    certs.add_argument("--days", type=int, default=365)
    users = sub.add_parser("redis-users", help="Redis ACL users per role, password files")
    users.add_argument("--out", type=Path, default=paths.build("secrets"))
    users.add_argument("--split", action="store_true", help="Redis 7: %%R~ read-only keys")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "redis-users":
        made_users = make_users(args.out, args.split)
        print(f"ACL file {made_users.acl_file}; password files redis-<role>.password beside it")
        return 0
    made = make_certs(args.out, (*DEFAULT_HOSTS, *args.host), args.days)
    print(f"certificates in {made.root}: ca.pem, router.pem, worker.pem, mesh-client.pem")
    return 0


if __name__ == "__main__":
    sys.exit(main())
