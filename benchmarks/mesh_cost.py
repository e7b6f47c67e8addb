"""What a local mesh's processes have spent so far: the Lua scripts its Redis ran, and the CPU
seconds of its router, workers and Redis (with their children) and of this process, the
client. Read before and after a slice of load, the differences per call are what a call costs
the cores, whatever else runs on them (benchmarks/tenants.py)."""

from __future__ import annotations

import os
from pathlib import Path

from devmesh.processes import LocalMesh, Process


def scripts_run(mesh: LocalMesh) -> int:
    """Lua scripts Redis has run so far (EVALSHA and EVAL, every user)."""
    stats: dict = mesh.redis_client("admin").info("commandstats")  # type: ignore[assignment]
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


def cpu_seconds(mesh: LocalMesh) -> dict[str, float]:
    """CPU time (user + system) so far of the mesh's router, worker and Redis processes (and
    their children), and of this process: the client."""
    pids: dict[str, list[Process | None]] = {
        "router": [mesh.router],
        "worker": list(mesh.workers.values()),
        "redis": [mesh.redis_server],
    }
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for role, processes in pids.items():
        roots = {p.popen.pid for p in processes if p is not None and p.popen is not None}
        out[role] = sum(_cpu_ticks(pid) for pid in _with_children(roots)) / tick
    usage = os.times()
    out["client"] = usage.user + usage.system
    return out


def _with_children(roots: set[int]) -> set[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found = set(roots)
    while True:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        if not more:
            return found
        found |= more


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime
