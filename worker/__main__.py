"""python -m worker --model-repository DIR --host 127.0.0.1 --port PORT"""

from __future__ import annotations

import asyncio
import sys

from common import cli, logging
from perfmodel.profiles import ProfileError
from worker.config import ConfigError
from worker.runtime import GpuRequired, ModelLoadError
from worker.server import BindFailed, GroupFailed, serve
from worker.settings import WorkerSettings


def parse_args(argv: list[str]) -> WorkerSettings:
    return cli.parse(
        WorkerSettings,
        argv,
        prog="python -m worker",
        description="Serve an ONNX model repository over the KServe v2 gRPC API.",
    )


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(sys.argv[1:] if argv is None else argv)
    if settings.tp_rank:
        return run_rank(settings)
    logging.configure(settings.log_level, settings.log_json)
    try:
        asyncio.run(serve(settings))
    except (BindFailed, ConfigError, GpuRequired, ModelLoadError, ProfileError) as e:
        print(f"meshserve worker: {e}", file=sys.stderr)
        return 2
    except GroupFailed as e:
        print(f"meshserve worker: tensor-parallel group failed: {e}", file=sys.stderr)
        return 3
    return 0


def run_rank(settings: WorkerSettings) -> int:
    """A non-zero rank of a shard group: started by rank 0 beside it, or one per host
    (--tp-master-port)."""
    if not 0 < settings.tp_rank < settings.tp or not settings.tp_master_port:
        print(
            f"meshserve worker: --tp-rank {settings.tp_rank} needs --tp N with N > "
            f"{settings.tp_rank} and --tp-master-port (rank 0's port), got --tp {settings.tp} "
            f"--tp-master-port {settings.tp_master_port}",
            file=sys.stderr,
        )
        return 2
    from worker.tp import rank  # torch: only a shard group needs it

    return rank.run(settings)


if __name__ == "__main__":
    sys.exit(main())
