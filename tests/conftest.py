"""Shared fixtures: a model repository built from code and real worker processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy import toy_models

ROOT = Path(__file__).resolve().parents[1]

# Test-only models: the MLP under configs that make batching and backpressure observable.
TEST_CONFIGS = {
    # Holds requests long enough that concurrent calls always meet in one batch.
    "mlp_batched": (
        "max_batch_size: 16\ndynamic_batching { max_queue_delay_microseconds: 200000 }\n"
    ),
    # Two waiting requests at most; a long delay keeps them waiting.
    "mlp_tiny_queue": (
        "max_batch_size: 8\n"
        "dynamic_batching {\n  max_queue_delay_microseconds: 500000\n"
        "  default_queue_policy { max_queue_size: 2 }\n}\n"
    ),
    # No merging at all: each request is its own execution.
    "mlp_unbatched": "max_batch_size: 16\n",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = toy_models.build(tmp_path_factory.mktemp("models"))
    for name, config in TEST_CONFIGS.items():
        toy_models.write(root / name, toy_models.mlp(), config)
    return root


@dataclass
class WorkerProcess:
    process: subprocess.Popen
    address: str
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)


def wait_serving(address: str, process: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"process exited with {process.returncode}:\n{log.read_text()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} not serving after {timeout}s:\n{log.read_text()}")


def start_worker(repository: Path, log_dir: Path, *extra: str) -> WorkerProcess:
    port = free_port()
    address = f"127.0.0.1:{port}"
    log = log_dir / f"worker-{port}.log"
    env = {
        **os.environ,
        "MESHSERVE_WORKER_PROVIDERS": "cpu",
        "MESHSERVE_WORKER_INTRA_OP_THREADS": "1",
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "worker",
            "--model-repository",
            str(repository),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_serving(address, process, log)
    except Exception:
        process.kill()
        raise
    return WorkerProcess(process, address, log)


@pytest.fixture
def worker_factory(tmp_path: Path, model_repository: Path) -> Iterator:
    started: list[WorkerProcess] = []

    def factory(*extra: str, repository: Path | None = None) -> WorkerProcess:
        w = start_worker(repository or model_repository, tmp_path, *extra)
        started.append(w)
        return w

    yield factory
    for w in started:
        if w.process.poll() is None:
            w.process.kill()
            w.process.wait(10)


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory, model_repository: Path
) -> Iterator[WorkerProcess]:
    w = start_worker(model_repository, tmp_path_factory.mktemp("worker"))
    yield w
    w.process.kill()
    w.process.wait(10)


# -- the ledger's durable store: SQLite, and the PostgreSQL this machine and CI run ----------

PG_URL = os.environ.get("MESHSERVE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _postgres_store() -> Iterator:
    import uuid

    import psycopg

    from ledger.store import Store

    schema = f"ledger_test_{uuid.uuid4().hex[:8]}"
    try:
        admin = psycopg.connect(PG_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as e:
        pytest.skip(f"no PostgreSQL at {PG_URL} (set MESHSERVE_TEST_POSTGRES_URL): {e}")
    admin.execute(f"CREATE SCHEMA {schema}")
    store = Store(f"{PG_URL}?options=-csearch_path%3D{schema}")
    try:
        yield store
    finally:
        store.close()
        admin.execute(f"DROP SCHEMA {schema} CASCADE")
        admin.close()


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator:
    from ledger.store import Store

    if request.param == "sqlite":
        store = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
        yield store
        store.close()
    else:
        yield from _postgres_store()
