"""python -m router --host 127.0.0.1 --port 8001 --redis-url redis://127.0.0.1:6379/0

python -m router keys create|list|revoke --tenant T, python -m router tenants set|list:
see router/keys.py."""

from __future__ import annotations

import argparse
import asyncio
import sys

from common import logging
from router import keys, processes
from router.policy import POLICIES
from router.settings import RouterSettings


def parse_args(argv: list[str]) -> RouterSettings:
    parser = argparse.ArgumentParser(
        prog="python -m router",
        description="One KServe v2 gRPC endpoint over the worker replicas registered in Redis. "
        "Every flag can also be set as MESHSERVE_ROUTER_<FLAG>.",
    )
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument(
        "--processes",
        type=int,
        help="router processes sharing the port (SO_REUSEPORT), each with its own router id "
        "(<router-id>-<i>) and metrics port (<metrics-port>+i); 1 = this process serves",
    )
    parser.add_argument("--redis-url")
    parser.add_argument("--router-id")
    parser.add_argument(
        "--policy",
        choices=list(POLICIES),
        help="p2c is KV-aware for replicas that report KV occupancy; p2c_depth ignores it",
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        help="sessions (request parameter session_id) remembered for affinity; 0 = off",
    )
    parser.add_argument("--poll-seconds", type=float)
    parser.add_argument("--registry-ttl-seconds", type=float)
    parser.add_argument("--sample-max-age-ms", type=int)
    parser.add_argument("--default-timeout-seconds", type=float)
    parser.add_argument("--eject-base-seconds", type=float)
    parser.add_argument(
        "--stall-seconds",
        type=float,
        help="a replica with calls in flight and no fresh depth sample for this long gets a "
        "health probe with this timeout; no answer ejects it and retries its calls elsewhere",
    )
    parser.add_argument(
        "--no-accounting",
        dest="accounting",
        action="store_false",
        default=None,
        help="do not count calls (only to measure what accounting costs)",
    )
    parser.add_argument("--accounting-wait-seconds", type=float)
    parser.add_argument(
        "--accounting-when-slow",
        choices=["answer", "unavailable"],
        help="when a success's record is not in Redis after --accounting-wait-seconds: "
        "answer anyway (kept in memory) or answer UNAVAILABLE (not billed)",
    )
    parser.add_argument("--max-inflight", type=int, help="calls in the router at once")
    parser.add_argument("--max-inflight-per-model", type=int)
    parser.add_argument(
        "--answer-margin-ms", type=float, help="deadline left below which no OK is sent"
    )
    parser.add_argument("--metrics-port", type=int)
    parser.add_argument(
        "--http-port",
        type=int,
        help="serve OpenAI's API and KServe v2 REST on this port too (0 = off; docs/http.md)",
    )
    parser.add_argument("--http-host", help="default: --host")
    parser.add_argument("--http-max-body-bytes", type=int, help="a larger body is refused (413)")
    parser.add_argument("--http-body-timeout-seconds", type=float)
    parser.add_argument("--http-header-timeout-seconds", type=float)
    parser.add_argument("--metrics-host", help="default 127.0.0.1")
    parser.add_argument(
        "--no-auth",
        dest="auth",
        action="store_false",
        default=None,
        help="serve without API keys: refused unless --host is 127.0.0.1 (make run)",
    )
    parser.add_argument("--auth-cache-seconds", type=float)
    parser.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key")
    parser.add_argument("--mesh-ca", help="CA of the workers' certificates: mutual TLS to them")
    parser.add_argument("--mesh-cert", help="the router's client certificate for the workers")
    parser.add_argument("--mesh-key")
    parser.add_argument(
        "--redis-password-file", help="else MESHSERVE_ROUTER_REDIS_PASSWORD, else none"
    )
    parser.add_argument(
        "--reflection",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gRPC server reflection; default: on only when bound to 127.0.0.1",
    )
    parser.add_argument("--grace-seconds", type=float)
    parser.add_argument("--log-level")
    args = parser.parse_args(argv)
    return RouterSettings(**{k: v for k, v in vars(args).items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("keys", "tenants"):
        return keys.main(argv)
    settings = parse_args(argv)
    logging.configure(settings.log_level, settings.log_json)
    if settings.processes > 1:
        return processes.supervise(settings)
    from router.server import serve

    try:
        asyncio.run(serve(settings))
    except ValueError as e:  # a setting the router refuses to start with
        print(f"meshserve router: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
