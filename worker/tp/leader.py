"""A shard group's processes: rank 0 (the leader, inside the gRPC worker) and ranks 1..N-1.

The leader spawns the other ranks (`python -m worker --tp-rank R`, killed by the kernel if the
leader dies: PR_SET_PDEATHSIG), and for each request broadcasts (op, model, arg) and the
input arrays; every rank then runs the same segments, joined by all-reduce. For an LLM one
call is one engine step (worker/tp/llm_step.py): the lock is held per step, never per
generation, and other requests' steps and heartbeats run between steps. While idle the
leader sends a heartbeat (a broadcast and an all-reduce) every `heartbeat_s`, so a rank
that hangs is found within the collective timeout even without traffic, and the waiting
ranks never time out. A rank that exits or a collective that fails marks the group failed
for good: calls get UNAVAILABLE and the worker leaves the registry and exits, so the
launcher restarts the whole group. Any other exception in a forward pass fails that request
only (every rank hits it at the same point); the group goes on.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import structlog

from common.errors import Unavailable
from common.shard_format import OP_NOOP, OP_STOP
from worker.runtime import run_error
from worker.settings import WorkerSettings
from worker.tp.parallel import CollectiveError, TpGroup, destroy_tp_group
from worker.tp.runtime import execute

log = structlog.get_logger()

PR_SET_PDEATHSIG = 1


PARENT_PID = "MESHSERVE_TP_PARENT_PID"  # the leader's pid, in a rank's environment


def die_with_parent() -> None:
    """In a rank, first thing: SIGKILL when the leader that spawned it exits (Linux), and
    exit at once if it already has. Set by the rank itself, not in a preexec_fn: Python code
    in a forked child of a process with gRPC's threads running can abort (SIGABRT)."""
    parent = os.environ.get(PARENT_PID)
    if parent is None:
        return
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):
        os._exit(1)  # the leader died before the signal was armed


def rank_args(settings: WorkerSettings, repository: Path, rank: int, master_port: int) -> list[str]:
    """`python -m worker` flags for rank `rank` of rank 0's group, started beside it: the
    group's settings from rank 0's, no health server (--port 0)."""
    s = settings
    return [
        *("--model-repository", str(repository), "--tp", str(s.tp)),
        *("--tp-rank", str(rank), "--tp-master-addr", s.tp_master_addr),
        *("--tp-master-port", str(master_port), "--tp-backend", s.tp_backend),
        *("--tp-timeout-seconds", str(s.tp_timeout_seconds), "--providers", s.providers),
        *("--intra-op-threads", str(s.intra_op_threads), "--log-level", s.log_level),
        *("--port", "0"),
    ]


def spawn_ranks(
    settings: WorkerSettings, repository: Path, master_port: int
) -> list[subprocess.Popen]:
    """Ranks 1..N-1 of rank 0's group, as `python -m worker --tp-rank R` beside it."""
    return [
        subprocess.Popen(
            [sys.executable, "-m", "worker", *rank_args(settings, repository, rank, master_port)],
            env={**os.environ, PARENT_PID: str(os.getpid())},
        )
        for rank in range(1, settings.tp)
    ]


def heartbeat(group: TpGroup) -> None:
    group.all_reduce(np.zeros(1, np.float32))


def follow(models: list, group: TpGroup) -> None:
    """Ranks 1..N-1: run whatever rank 0 broadcasts, until it says stop."""
    while True:
        (op, index, arg), arrays = group.broadcast((OP_NOOP, 0, 0))
        if op == OP_STOP:
            return
        if op == OP_NOOP:
            heartbeat(group)
            continue
        try:
            execute(models[index], group, op, arg, arrays)
        except CollectiveError:
            raise
        except Exception as e:  # every rank fails alike on the same input; rank 0 answers
            log.warning("tp_rank_request_failed", error=f"{type(e).__name__}: {e}"[:500])


class Leader:
    """Rank 0: one operation at a time over the group; watches the other ranks."""

    def __init__(
        self,
        models: list,  # RankModel or worker.tp.llm_step.RankSteps, by index
        group: TpGroup,
        children: list[subprocess.Popen],
        heartbeat_s: float,
    ) -> None:
        self.models = models
        self.group = group
        self.children = children
        self.heartbeat_s = heartbeat_s
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stopping = False
        self._on_failure: Callable[[str], None] = lambda reason: None
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)

    def start(self, on_failure: Callable[[str], None]) -> None:
        self._on_failure = on_failure
        self._watcher.start()

    def call(self, index: int, op: int, arg: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        with self._lock:
            if self.failure is not None:
                raise Unavailable(f"TP group failed ({self.failure}); it is restarting")
            try:
                _, arrays = self.group.broadcast((op, index, arg), arrays)
                out = execute(self.models[index], self.group, op, arg, arrays)
            except CollectiveError as e:
                self._fail(str(e))
                raise Unavailable(f"TP group failed during this call: {e}") from e
            except Exception as e:
                # Not the group's failure: this request's (every rank runs the same segments
                # on the same inputs, so each fails at the same point, before the same
                # collective, and the group stays in step). Should one rank alone fail, the
                # next collective times out and the group restarts, as for any hang.
                raise run_error(self.models[index].shards.model, e) from e
            finally:
                self._last = time.monotonic()
        return out

    def _watch(self) -> None:
        while not self._stopping and self.failure is None:
            for rank, child in enumerate(self.children, start=1):
                code = child.poll()
                if code is not None and not self._stopping:
                    self._fail(f"rank {rank} exited with code {code}")
                    return
            idle = time.monotonic() - self._last
            if idle >= self.heartbeat_s and self._lock.acquire(blocking=False):
                try:
                    if self.failure is None and not self._stopping:
                        self.group.broadcast((OP_NOOP, 0, 0))
                        heartbeat(self.group)
                except CollectiveError as e:
                    self._fail(str(e))
                finally:
                    self._last = time.monotonic()
                    self._lock.release()
            time.sleep(0.05)

    def _fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        log.error("tp_group_failed", reason=reason, world=self.group.world)
        self._on_failure(reason)

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the ranks to stop (if the group still works), then make sure they are gone."""
        self._stopping = True
        if self.failure is None and self._lock.acquire(timeout=timeout):
            try:
                self.group.broadcast((OP_STOP, 0, 0))
            except CollectiveError:
                pass
            finally:
                self._lock.release()
        for child in self.children:
            try:
                child.wait(timeout if self.failure is None else 0.5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(5)
        if self.failure is None:
            destroy_tp_group()
