"""`python -m router --processes N`: N router processes on one port, one per core.

A Python router is one event loop on one core; a machine with more cores runs several. Each
process is a whole router (its own registry view, Redis connections and accounting) and
binds the same host:port with SO_REUSEPORT, so the kernel spreads client connections over
them. They share only Redis: each counts its calls under its own router id (its own batch
stream, `meshserve:calls:{router}`), and the ledger sums every router's stream, so the
accounting stays exact with any number of processes.

This parent process only supervises: it starts the N processes (spawned, not forked: gRPC
must not cross a fork), restarts one that exits, and on SIGTERM or SIGINT passes SIGTERM on
and waits while each drains (`--grace-seconds`) and writes its last batch. A process that
exits before it served (a port another program holds, a bad setting) stops the whole
router instead of restarting in a loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import signal
import sys
import threading
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as EventType

import structlog

from common import logging
from router.process.settings import RouterSettings

log = structlog.get_logger()

POLL_S = 0.5
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def child_settings(settings: RouterSettings, index: int) -> RouterSettings:
    """Process `index`'s settings: one process; its own router id (`<id>-<index>` when an id
    was given, else the default, which holds its pid) and metrics port (`port + index`)."""
    return settings.model_copy(
        update={
            "processes": 1,
            "shared_port": True,
            "router_id": f"{settings.router_id}-{index}" if settings.router_id else None,
            "metrics_port": settings.metrics_port + index if settings.metrics_port else 0,
        }
    )


def _die_with_parent() -> None:
    """SIGTERM this process when the supervisor dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG), so no router process outlives it holding the port."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _run_child(settings: RouterSettings, ready: EventType) -> None:
    from router.process.server import serve  # imported here: the supervisor itself needs no gRPC

    _die_with_parent()
    logging.configure(settings.log_level, settings.log_json)
    asyncio.run(serve(settings, on_ready=ready.set))


def supervise(settings: RouterSettings) -> int:
    """Run `settings.processes` routers on one port until SIGTERM or SIGINT; the exit code."""
    if settings.port == 0:
        raise SystemExit(
            f"--processes {settings.processes} needs a fixed --port (not 0): every process "
            "must bind the same one"
        )
    context = multiprocessing.get_context("spawn")
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def start(index: int) -> tuple[BaseProcess, EventType]:
        ready = context.Event()  # set once the process serves
        process = context.Process(
            target=_run_child,
            args=(child_settings(settings, index), ready),
            name=f"router-{index}",
        )
        process.start()
        return process, ready

    children = [start(i) for i in range(settings.processes)]
    log.info(
        "router_processes_started",
        processes=settings.processes,
        address=f"{settings.host}:{settings.port}",
        pids=[p.pid for p, _ in children],
    )
    code = 0
    all_ready = False
    while not stop.wait(POLL_S):
        if not all_ready and all(ready.is_set() for _, ready in children):
            # the port answers once the first process serves; until the last one has bound
            # it, every connection lands on those already serving
            all_ready = True
            log.info("router_processes_ready", processes=settings.processes)
        for index, (process, ready) in enumerate(children):
            if process.is_alive():
                continue
            exitcode = process.exitcode
            log.warning("router_process_exited", index=index, pid=process.pid, code=exitcode)
            if not ready.is_set():
                log.error("router_process_failed_at_start", index=index, code=exitcode)
                code = 1
                stop.set()
                break
            children[index] = start(index)
    for process, _ in children:
        if process.is_alive() and process.pid is not None:
            process.terminate()  # SIGTERM: the process drains and flushes its accounting
    for process, _ in children:
        process.join(settings.grace_seconds + 5.0)
        if process.is_alive():
            log.error("router_process_killed", pid=process.pid)
            process.kill()
            process.join(5.0)
    log.info("router_processes_stopped", processes=settings.processes)
    return code
