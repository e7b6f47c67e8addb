"""Shared fixtures: a model repository built from code and real worker processes."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from devmesh import processes, toy_models
from devmesh.processes import free_port

# Test-only models: the MLP under configs that make batching and backpressure observable.
TEST_CONFIGS = {
    # Holds requests long enough that concurrent calls always meet in one batch (Triton's
    # rule: even the first, on an idle model, waits out the delay).
    "mlp_batched": (
        "max_batch_size: 16\ndynamic_batching { max_queue_delay_microseconds: 200000 }\n"
        'parameters { key: "meshserve.batch_delay_when_idle" value { string_value: "true" } }\n'
    ),
    # Two waiting requests at most; a long delay keeps them waiting.
    "mlp_tiny_queue": (
        "max_batch_size: 8\n"
        "dynamic_batching {\n  max_queue_delay_microseconds: 500000\n"
        "  default_queue_policy { max_queue_size: 2 }\n}\n"
        # Triton's rule (wait out the delay even when idle) holds requests in the queue
        'parameters { key: "meshserve.batch_delay_when_idle" value { string_value: "true" } }\n'
    ),
    # No merging at all: each request is its own execution.
    "mlp_unbatched": "max_batch_size: 16\n",
}


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


def start_worker(repository: Path, log_dir: Path, *extra: str) -> WorkerProcess:
    port = free_port()
    address = f"127.0.0.1:{port}"
    worker = processes.worker_process(
        repository, port, log_dir, None, "--providers", "cpu", "--intra-op-threads", "1", *extra
    ).start()
    try:
        processes.wait_serving(address, worker)
    except Exception:
        worker.kill()
        raise
    assert worker.popen is not None
    return WorkerProcess(worker.popen, address, worker.log)


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
