"""A Redis that can fail over, on 127.0.0.1: a primary, replicas and sentinels (one binary,
redis-server, in `--sentinel` mode for the sentinels), for the tests and to try Sentinel out.

The mesh's processes reach it with `SentinelGroup.url`:
redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/mesh/0 (common/redis_conn.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from common import redis_conn
from devmesh.processes import Process, free_port, redis_process, redis_server_binary, wait_redis

SERVICE = "mesh"


@dataclass
class SentinelGroup:
    root: Path
    replicas: int = 1
    sentinels: int = 3
    down_after_ms: int = 1000  # a primary silent this long is down (once a quorum agrees)
    servers: dict[int, Process] = field(default_factory=dict)  # port -> redis-server
    sentinel_ports: list[int] = field(default_factory=list)
    sentinel_processes: list[Process] = field(default_factory=list)
    first_primary: int = 0

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self, timeout: float = 20.0) -> SentinelGroup:
        self.first_primary = free_port()
        self._server(self.first_primary)
        for _ in range(self.replicas):
            self._server(free_port(), "--replicaof", "127.0.0.1", str(self.first_primary))
        quorum = self.sentinels // 2 + 1
        for i in range(self.sentinels):
            port = free_port()
            conf = self.root / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.root}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.first_primary} {quorum}\n"
                f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            args = [redis_server_binary(), str(conf), "--sentinel"]
            log = self.root / f"sentinel-{i}.log"
            self.sentinel_processes.append(Process(f"sentinel-{i}", args, log).start())
            self.sentinel_ports.append(port)
        self.wait_ready(timeout)
        return self

    def _server(self, port: int, *extra: str) -> None:
        data = self.root / f"redis-{port}"
        self.servers[port] = redis_process(port, self.root, data_dir=data, extra=extra).start()
        wait_redis(port)

    def sentinel(self, i: int = 0) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[i], decode_responses=True, socket_timeout=2)

    def primary_port(self) -> int:
        # the raw command: redis-py 6.4's parser for the named one fails on a plain client
        host_port = self.sentinel().execute_command("SENTINEL", "get-master-addr-by-name", SERVICE)
        return int(host_port[1])

    def wait_ready(self, timeout: float) -> None:
        """Until every sentinel knows the others and the replicas, and each replica is in
        sync: a failover can then happen."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                views = [
                    _info(self.sentinel(i), "sentinel")["master0"] for i in range(self.sentinels)
                ]
                ready = all(
                    v["status"] == "ok"
                    and int(v["sentinels"]) == self.sentinels
                    and int(v["slaves"]) == self.replicas
                    for v in views
                )
                linked = all(
                    _info(redis.Redis(port=p, socket_timeout=2), "replication")[
                        "master_link_status"
                    ]
                    == "up"
                    for p in self.servers
                    if p != self.first_primary
                )
            except (redis.RedisError, KeyError):
                ready = linked = False
            if ready and linked:
                return
            time.sleep(0.2)
        raise TimeoutError(f"the Sentinel group was not ready within {timeout}s")

    def kill_primary(self) -> int:
        """kill -9 the current primary; -> its port."""
        port = self.primary_port()
        self.servers[port].kill()
        return port

    def wait_failover(self, old_port: int, timeout: float = 20.0) -> int:
        """Until the sentinels name another primary and it answers as one; -> its port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                port = self.primary_port()
                if port != old_port:
                    client = redis_conn.connect(f"redis://127.0.0.1:{port}/0", timeout_s=1)
                    if _info(client, "replication")["role"] == "master":
                        return port
            except (redis.RedisError, OSError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"no failover within {timeout}s")

    def stop(self) -> None:
        for process in [*self.sentinel_processes, *self.servers.values()]:
            process.kill()


def _info(client: redis.Redis, section: str) -> dict:
    info: dict = client.info(section)  # type: ignore[assignment]
    return info
