"""python -m router --host 127.0.0.1 --port 8001 --redis-url redis://127.0.0.1:6379/0

python -m router keys create|list|revoke --tenant T, python -m router tenants set|list:
see router/tenancy/keys.py."""

from __future__ import annotations

import asyncio
import sys

from common import cli, logging
from router.process import processes
from router.process.settings import RouterSettings
from router.tenancy import keys


def parse_args(argv: list[str]) -> RouterSettings:
    return cli.parse(
        RouterSettings,
        argv,
        prog="python -m router",
        description="One KServe v2 gRPC endpoint over the worker replicas registered in Redis.",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("keys", "tenants"):
        return keys.main(argv)
    settings = parse_args(argv)
    logging.configure(settings.log_level, settings.log_json)
    if settings.processes > 1:
        return processes.supervise(settings)
    from router.process.server import serve

    try:
        asyncio.run(serve(settings))
    except ValueError as e:  # a setting the router refuses to start with
        print(f"meshserve router: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
