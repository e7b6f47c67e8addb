"""The batcher with a plain numpy model in place of onnxruntime (the contract is `run`)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from common.errors import Internal, InvalidArgument, MeshError, ResourceExhausted, Unavailable
from worker.batcher import Batcher
from worker.config import DELAY_WHEN_IDLE, ModelSpec, TensorSpec
from worker.stats import ModelStats


def make_spec(
    max_batch: int = 8,
    delay_us: int = 20_000,
    merge: bool = True,
    queue: int = 64,
    instances: int = 1,
    parameters: dict[str, str] | None = None,
) -> ModelSpec:
    return ModelSpec(
        name="double",
        version="1",
        inputs={"x": TensorSpec("x", "FP32", (-1,))},
        outputs={"y": TensorSpec("y", "FP32", (-1,))},
        max_batch_size=max_batch,
        dynamic_batching=merge,
        max_queue_delay_us=delay_us,
        preferred_batch_sizes=(),
        max_queue_size=queue,
        instance_count=instances,
        parameters=parameters or {},
    )


class Model:
    """y = 2x; fails on NaN input as the runtime reports a run the input made impossible,
    and on inf with `error` (a group failure, a bug); records batches."""

    def __init__(self, hold: threading.Event | None = None, error: Exception | None = None) -> None:
        self.batches: list[tuple[int, ...]] = []
        self.hold = hold
        self.error = error

    def __call__(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.hold is not None:
            self.hold.wait(5)
        x = feeds["x"]
        self.batches.append(x.shape)
        if np.isnan(x).any():
            raise InvalidArgument("NaN input")
        if self.error is not None and np.isinf(x).any():
            raise self.error
        return [x * 2]


async def _with_batcher(spec: ModelSpec, model: Model, body):  # type: ignore[no-untyped-def]
    stats = ModelStats()
    batcher = Batcher(spec, model, stats, spec.max_queue_size)
    try:
        return await body(batcher, stats)
    finally:
        await batcher.close()


def test_concurrent_requests_merge_and_split_back() -> None:
    model = Model()

    async def body(batcher: Batcher, stats: ModelStats) -> None:
        arrays = [np.full((1, 3), i, np.float32) for i in range(6)]
        results = await asyncio.gather(*(batcher.submit({"x": a}, ["y"]) for a in arrays))
        for a, r in zip(arrays, results, strict=True):
            np.testing.assert_array_equal(r["y"], a * 2)
        assert stats.execution_count == 1
        assert stats.inference_count == 6
        assert model.batches == [(6, 3)]

    asyncio.run(_with_batcher(make_spec(), model, body))


def test_different_shapes_are_not_merged() -> None:
    model = Model()

    async def body(batcher: Batcher, stats: ModelStats) -> None:
        a, b = np.ones((1, 3), np.float32), np.ones((1, 5), np.float32)
        await asyncio.gather(*(batcher.submit({"x": x}, ["y"]) for x in (a, b, a, b)))
        assert sorted(model.batches) == [(2, 3), (2, 5)]

    asyncio.run(_with_batcher(make_spec(), model, body))


def test_max_batch_size_caps_a_batch() -> None:
    model = Model()

    async def body(batcher: Batcher, stats: ModelStats) -> None:
        xs = [np.ones((3, 2), np.float32) for _ in range(4)]  # 12 rows, limit 8
        await asyncio.gather(*(batcher.submit({"x": x}, ["y"]) for x in xs))
        assert all(shape[0] <= 8 for shape in model.batches)
        assert sum(shape[0] for shape in model.batches) == 12

    asyncio.run(_with_batcher(make_spec(max_batch=8), model, body))


def test_no_merging_without_dynamic_batching() -> None:
    model = Model()

    async def body(batcher: Batcher, stats: ModelStats) -> None:
        await asyncio.gather(
            *(batcher.submit({"x": np.ones((1, 2), np.float32)}, ["y"]) for _ in range(5))
        )
        assert stats.execution_count == 5

    asyncio.run(_with_batcher(make_spec(merge=False), model, body))


def test_one_bad_request_fails_alone() -> None:
    model = Model()

    async def body(batcher: Batcher, stats: ModelStats) -> None:
        good = [np.ones((1, 2), np.float32) for _ in range(3)]
        bad = np.array([[np.nan, 1]], np.float32)
        results = await asyncio.gather(
            *(batcher.submit({"x": x}, ["y"]) for x in [*good, bad]), return_exceptions=True
        )
        assert all(isinstance(r, dict) for r in results[:3])
        assert isinstance(results[3], InvalidArgument)
        assert "NaN input" in results[3].message

    asyncio.run(_with_batcher(make_spec(), model, body))


@pytest.mark.parametrize(
    ("error", "expected", "reruns"),
    [
        (Unavailable("TP group failed"), Unavailable, False),  # a dead group: no re-runs
        (ResourceExhausted("out of memory"), ResourceExhausted, True),  # smaller may fit
        (KeyError("a bug"), Internal, True),
    ],
    ids=["group-failed", "out-of-memory", "bug"],
)
def test_batch_failures_keep_their_status(
    error: Exception, expected: type[MeshError], reruns: bool
) -> None:
    model = Model(error=error)

    async def body(batcher: Batcher, stats: ModelStats) -> None:
        xs = [np.ones((1, 2), np.float32) for _ in range(3)] + [np.full((1, 2), np.inf)]
        results = await asyncio.gather(
            *(batcher.submit({"x": x.astype(np.float32)}, ["y"]) for x in xs),
            return_exceptions=True,
        )
        assert model.batches[0] == (4, 2)  # one merged run first
        if reruns:  # then each request alone: only the one that caused it fails
            assert len(model.batches) == 5
            assert all(isinstance(r, dict) for r in results[:3])
            assert isinstance(results[3], expected)
        else:
            assert len(model.batches) == 1
            assert all(isinstance(r, expected) for r in results)

    asyncio.run(_with_batcher(make_spec(), model, body))


def test_full_queue_rejects_at_once() -> None:
    hold = threading.Event()
    model = Model(hold)

    async def body(batcher: Batcher, stats: ModelStats) -> None:
        first = asyncio.ensure_future(batcher.submit({"x": np.ones((1, 2), np.float32)}, ["y"]))
        await asyncio.sleep(0.05)  # the first request is running, held by the model
        queued = [
            asyncio.ensure_future(batcher.submit({"x": np.ones((1, 2), np.float32)}, ["y"]))
            for _ in range(2)
        ]
        await asyncio.sleep(0.05)
        with pytest.raises(ResourceExhausted, match="queue is full"):
            await batcher.submit({"x": np.ones((1, 2), np.float32)}, ["y"])
        assert batcher.depth == 3
        hold.set()
        await asyncio.gather(first, *queued)
        assert batcher.depth == 0

    asyncio.run(_with_batcher(make_spec(delay_us=0, queue=2), model, body))


def test_cancelled_request_is_skipped() -> None:
    model = Model()

    async def body(batcher: Batcher, stats: ModelStats) -> None:
        doomed = asyncio.ensure_future(batcher.submit({"x": np.ones((1, 2), np.float32)}, ["y"]))
        await asyncio.sleep(0)
        doomed.cancel()
        result = await batcher.submit({"x": np.ones((1, 2), np.float32)}, ["y"])
        assert result["y"].shape == (1, 2)
        assert stats.inference_count == 1

    asyncio.run(_with_batcher(make_spec(delay_us=50_000), model, body))


def one() -> dict[str, np.ndarray]:
    return {"x": np.ones((1, 2), np.float32)}


def test_an_idle_model_does_not_wait_out_the_delay() -> None:
    """Nothing else runs: waiting could gain nothing, so the request runs at once (the
    delay here is 5 s; the whole test takes milliseconds unless the batcher waits)."""
    model = Model()

    async def body(batcher: Batcher, stats: ModelStats) -> float:
        t0 = time.monotonic()
        for _ in range(3):
            await batcher.submit(one(), ["y"])
        return time.monotonic() - t0

    elapsed = asyncio.run(_with_batcher(make_spec(delay_us=5_000_000), model, body))
    assert elapsed < 2.5
    assert model.batches == [(1, 2)] * 3


def test_requests_that_arrive_while_a_batch_runs_form_the_next_batch() -> None:
    hold = threading.Event()
    model = Model(hold)

    async def body(batcher: Batcher, stats: ModelStats) -> float:
        t0 = time.monotonic()
        first = asyncio.ensure_future(batcher.submit(one(), ["y"]))
        await asyncio.sleep(0.05)  # running (on the thread), held by the model
        later = [asyncio.ensure_future(batcher.submit(one(), ["y"])) for _ in range(3)]
        await asyncio.sleep(0.05)
        hold.set()
        await asyncio.gather(first, *later)
        return time.monotonic() - t0

    elapsed = asyncio.run(_with_batcher(make_spec(delay_us=5_000_000), model, body))
    assert model.batches == [(1, 2), (3, 2)]
    assert elapsed < 2.5  # the three had waited already: they ran when the first ended


def test_while_another_instance_runs_the_delay_gathers_more() -> None:
    """Two instances, one busy: the other waits (up to the delay) for more requests rather
    than running one at a time, and goes as soon as the busy one ends."""
    hold = threading.Event()
    model = Model(hold)

    async def body(batcher: Batcher, stats: ModelStats) -> None:
        first = asyncio.ensure_future(batcher.submit(one(), ["y"]))
        await asyncio.sleep(0.05)  # instance 1 runs it, held
        second = asyncio.ensure_future(batcher.submit(one(), ["y"]))
        await asyncio.sleep(0.05)  # instance 2 took it and waits: instance 1 is busy
        third = asyncio.ensure_future(batcher.submit(one(), ["y"]))
        await asyncio.sleep(0.05)
        hold.set()
        await asyncio.gather(first, second, third)

    spec = make_spec(delay_us=5_000_000, instances=2)
    asyncio.run(_with_batcher(spec, model, body))
    assert sorted(model.batches) == [(1, 2), (2, 2)]


def test_delay_when_idle_waits_out_the_delay() -> None:
    """meshserve.batch_delay_when_idle: true keeps Triton's rule: even alone, a request
    waits max_queue_delay for company."""
    model = Model()

    async def body(batcher: Batcher, stats: ModelStats) -> float:
        t0 = time.monotonic()
        await batcher.submit(one(), ["y"])
        return time.monotonic() - t0

    spec = make_spec(delay_us=300_000, parameters={DELAY_WHEN_IDLE: "true"})
    assert asyncio.run(_with_batcher(spec, model, body)) >= 0.3


def test_an_idle_fast_model_runs_on_the_callers_task() -> None:
    """Once timed as fast (inline), a request to an idle model runs on the task that
    submitted it: no hand-off to an executor task and back. A slow model (timed on the
    thread) still goes through the executor."""
    ran_on: list[asyncio.Task | None] = []

    def model(names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            ran_on.append(asyncio.current_task())
        except RuntimeError:  # on the executor's thread: no event loop there
            ran_on.append(None)
        return [feeds["x"] * 2]

    async def body(batcher: Batcher, stats: ModelStats) -> tuple[asyncio.Task | None, int]:
        for _ in range(3):  # the first run is on the thread (unknown cost), then inline
            await batcher.submit(one(), ["y"])
        # A run the OS preempted times as slow and sends the next one to the thread (as it
        # should), so on a busy machine one request may miss; a model that never runs
        # inline misses them all.
        attempts = 0
        while attempts < 20:
            attempts += 1
            ran_on.clear()
            result = await batcher.submit(one(), ["y"])
            np.testing.assert_array_equal(result["y"], one()["x"] * 2)
            if ran_on == [asyncio.current_task()]:
                break
        return asyncio.current_task(), attempts

    stats = ModelStats()

    async def run() -> tuple[asyncio.Task | None, int]:
        batcher = Batcher(make_spec(delay_us=5_000_000), model, stats, 64)
        try:
            return await body(batcher, stats)
        finally:
            await batcher.close()

    caller, attempts = asyncio.run(run())
    assert ran_on == [caller]
    assert stats.execution_count == 3 + attempts


def test_requests_waiting_behind_an_idle_fast_models_leader_join_its_batch() -> None:
    """Six handlers ready at once on an idle, fast model: the first runs the batch on its
    own task, after the other five queued theirs behind it: one run of six rows."""
    model = Model()

    async def body(batcher: Batcher, stats: ModelStats) -> None:
        for _ in range(3):  # timed as fast: runs inline from now on
            await batcher.submit(one(), ["y"])
        arrays = [np.full((1, 2), i, np.float32) for i in range(6)]
        results = await asyncio.gather(*(batcher.submit({"x": a}, ["y"]) for a in arrays))
        for a, r in zip(arrays, results, strict=True):
            np.testing.assert_array_equal(r["y"], a * 2)
        assert stats.execution_count == 4

    asyncio.run(_with_batcher(make_spec(delay_us=5_000_000), model, body))
    assert model.batches[-1] == (6, 2)
