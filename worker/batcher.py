"""Dynamic batching: concurrent requests for one model version become one session run.

Requests wait in a bounded queue. An executor takes the oldest request, adds every queued
request with the same non-batch shapes until `max_batch_size` rows, runs the merged batch
once on a thread (onnxruntime releases the GIL), and splits the outputs back.
`instance_count` executors share the queue.

No delay on an idle model: when no batch of the model is running, the executor runs what
is queued at once (waiting could gain nothing: no one else is using the model, and the
requests that arrive while this batch runs form the next one). Only while another batch
runs does it wait, up to `max_queue_delay_us` from the oldest request's arrival, for more
requests, stopping early when that batch ends, the batch is full or reaches a preferred
size. A model whose config sets `meshserve.batch_delay_when_idle: "true"` waits out the
delay even when idle (Triton's rule).

A thread hop costs tens of microseconds, more than a tiny model's whole run. So a batch whose
recent runs took under INLINE_BELOW_NS (moving average) runs on the event loop itself;
anything slower goes to the thread so the loop keeps serving gRPC meanwhile. For an idle
model such a batch runs on the task of the request that found it idle (see `_lead`): no
hand-off to an executor task and back; the requests whose handlers were waiting on the
loop behind it join its batch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import structlog

from common.errors import Internal, InvalidArgument, MeshError, ResourceExhausted, Unavailable
from worker.config import DELAY_WHEN_IDLE, SIMULATED_COMPUTE_US, ModelSpec
from worker.stats import ModelStats

log = structlog.get_logger()

INLINE_BELOW_NS = 100_000
PROBE_BELOW_NS = 1_000_000  # never block the loop to re-time a model slower than this
PROBE_EVERY = 64
HEAVY_OBJECTS = 10_000  # BYTES elements in a batch that always run on the thread

# Failures of a merged batch that may be one request's doing: each request then runs alone.
PER_REQUEST = (InvalidArgument, ResourceExhausted)

RunFn = Callable[[list[str], dict[str, np.ndarray]], list[np.ndarray]]


@dataclass(eq=False)
class _Pending:
    inputs: dict[str, np.ndarray]
    outputs: list[str]
    rows: int
    signature: tuple
    future: asyncio.Future
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)


def _heavy(batch: list[_Pending]) -> bool:
    """Many BYTES elements cost Python work per element (str conversion): never inline."""
    return any(
        a.dtype == object and a.size > HEAVY_OBJECTS for p in batch for a in p.inputs.values()
    )


def signature(inputs: dict[str, np.ndarray], batched: bool) -> tuple:
    """Requests merge only when every input has the same dtype and non-batch shape."""
    skip = 1 if batched else 0
    return tuple((name, a.dtype.str, a.shape[skip:]) for name, a in sorted(inputs.items()))


class Batcher:
    def __init__(self, spec: ModelSpec, run: RunFn, stats: ModelStats, max_queue_size: int) -> None:
        self.spec = spec
        self._run = run
        self.stats = stats
        self.max_queue_size = max_queue_size
        self._batched = spec.max_batch_size > 0
        self._merge = spec.dynamic_batching
        self._delay_ns = spec.max_queue_delay_us * 1000
        self._delay_when_idle = spec.parameters.get(DELAY_WHEN_IDLE) == "true"
        self._preferred = set(spec.preferred_batch_sizes)
        self._queue: collections.deque[_Pending] = collections.deque()
        self._arrived = asyncio.Event()
        self._leading = False  # a caller runs the next batch on its own task (see _lead)
        self._gathering = 0  # taken off the queue into a batch that has not started yet
        self._running = 0
        self._closed = False
        self._infer_ns_avg = float(INLINE_BELOW_NS)  # on the thread until timed
        self._calls = 1  # the first calls run on the thread: an unknown model may be slow
        self._simulated_s = int(spec.parameters.get(SIMULATED_COMPUTE_US, "0")) / 1e6
        self._pool = ThreadPoolExecutor(
            max_workers=spec.instance_count, thread_name_prefix=f"ort-{spec.name}"
        )
        self._tasks = [
            asyncio.get_running_loop().create_task(self._executor())
            for _ in range(spec.instance_count)
        ]

    @property
    def depth(self) -> int:
        """Requests waiting plus requests in a running batch."""
        return len(self._queue) + self._gathering + self._running

    async def submit(
        self, inputs: dict[str, np.ndarray], outputs: list[str]
    ) -> dict[str, np.ndarray]:
        if self._closed:
            raise Unavailable(f"model {self.spec.name!r} is shutting down")
        if len(self._queue) + self._gathering >= self.max_queue_size:
            raise ResourceExhausted(
                f"model {self.spec.name!r} version {self.spec.version}: queue is full "
                f"({self.max_queue_size} requests waiting); retry later or add replicas"
            )
        rows = next(iter(inputs.values())).shape[0] if self._batched else 1
        pending = _Pending(
            inputs,
            outputs,
            rows,
            signature(inputs, self._batched),
            asyncio.get_running_loop().create_future(),
        )
        lead = self._idle() and self._inline([pending])
        self._queue.append(pending)
        if lead:
            await self._lead(pending)
        elif not self._leading:
            self._arrived.set()
        return await pending.future  # type: ignore[no-any-return]

    async def _lead(self, pending: _Pending) -> None:
        """Run the batch `pending` heads on this (the caller's) task, sparing the hand-off
        to an executor task and back. It yields to the loop first, again as long as each
        yield brought more requests (they queue behind it without waking an executor and
        join the batch) and the batch and the delay allow: alone, one yield; in a burst,
        the burst."""
        self._leading = True
        deadline = pending.enqueued_ns + self._delay_ns
        try:
            seen = 0
            while (
                len(self._queue) > seen
                and len(self._queue) < self.spec.max_batch_size
                and (not seen or time.perf_counter_ns() < deadline)
            ):
                seen = len(self._queue)
                await asyncio.sleep(0)  # the only point where this can be cancelled
            if self._queue and self._queue[0] is pending and not (self._gathering or self._running):
                batch = await self._gather()  # no wait inside: nothing is running
                self._gathering -= len(batch)
                await self._execute(batch)
        except asyncio.CancelledError:
            pending.future.cancel()  # skipped by whoever runs the queue
            raise
        finally:
            self._leading = False
            if self._queue:  # another shape, or a request that came after the batch formed
                self._arrived.set()

    def _idle(self) -> bool:
        """Nothing queued (a leader's request is queued until it runs), gathering or
        running, and no rule to wait when idle."""
        waits = self._merge and self._delay_when_idle
        return not (self._queue or self._gathering or self._running or waits)

    def _inline(self, batch: list[_Pending]) -> bool:
        """Whether the batch runs on the event loop (see the module docstring): recent runs
        were short and it is not heavy."""
        return self._infer_ns_avg < INLINE_BELOW_NS and not self._simulated_s and not _heavy(batch)

    async def close(self) -> None:
        """Stop taking requests; wait for queued and running ones to finish."""
        self._closed = True
        while self._queue or self._gathering or self._running:
            await asyncio.sleep(0.01)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=True)

    async def _executor(self) -> None:
        while True:
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            batch = await self._gather()
            self._gathering -= len(batch)  # no await until _execute counts them as running
            if batch:
                await self._execute(batch)

    async def _gather(self) -> list[_Pending]:
        head = self._queue.popleft()
        if head.future.done():  # cancelled by its caller while waiting
            return []
        batch, rows = [head], head.rows
        self._gathering += 1
        if not self._merge:
            return batch
        deadline = head.enqueued_ns + self._delay_ns
        limit = self.spec.max_batch_size
        while rows < limit:
            keep: collections.deque[_Pending] = collections.deque()
            while self._queue:
                p = self._queue.popleft()
                if p.future.done():
                    continue
                if p.signature == head.signature and rows + p.rows <= limit:
                    batch.append(p)
                    rows += p.rows
                    self._gathering += 1
                else:
                    keep.append(p)
            keep.extend(self._queue)
            self._queue = keep
            remaining = deadline - time.perf_counter_ns()
            idle = not self._running and not self._delay_when_idle
            if rows >= limit or rows in self._preferred or remaining <= 0 or idle:
                break
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining / 1e9)
        return batch

    async def _execute(self, batch: list[_Pending]) -> None:
        self._running += len(batch)
        try:
            start = time.perf_counter_ns()
            for p in batch:
                self.stats.queue.add(start - p.enqueued_ns)
            await self._settle(batch, list(dict.fromkeys(n for p in batch for n in p.outputs)))
        finally:
            self._running -= len(batch)
            if self._queue or self._gathering:  # an executor waiting may go now
                self._arrived.set()

    async def _settle(self, batch: list[_Pending], names: list[str]) -> None:
        """Run the batch and resolve its callers. When a merged batch fails on its input
        (INVALID_ARGUMENT, or RESOURCE_EXHAUSTED: a smaller run may fit) or in a way nobody
        mapped (a bug: INTERNAL, logged), each request runs on its own, so the one request
        that caused it fails alone. Any other status (a failed TP group: UNAVAILABLE) fails
        them all at once: running each again could not help."""
        try:
            results, timings = await self._call(batch, names)
        except Exception as e:
            mesh = isinstance(e, MeshError)
            if len(batch) > 1 and (isinstance(e, PER_REQUEST) or not mesh):
                for p in batch:
                    if not p.future.done():
                        await self._settle([p], names)
                return
            error = e if mesh else self._internal(e)
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(error)
            return
        rows = sum(p.rows for p in batch) if self._batched else 1
        self.stats.record_execution(len(batch), rows, *timings)
        for p, result in zip(batch, results, strict=True):
            if not p.future.done():
                p.future.set_result({n: result[n] for n in p.outputs})

    async def _call(
        self, batch: list[_Pending], names: list[str]
    ) -> tuple[list[dict[str, np.ndarray]], tuple[int, int, int]]:
        avg = self._infer_ns_avg
        self._calls += 1
        # A run timed on the thread also counts the wait to take the GIL back from the busy
        # event loop (up to the 5 ms switch interval), which would keep a tiny model on the
        # thread for good: a model that looks only moderately slow there is re-timed inline
        # now and then, and inline timings decide.
        probe = avg < PROBE_BELOW_NS and self._calls % PROBE_EVERY == 1
        heavy = _heavy(batch)
        if (avg < INLINE_BELOW_NS or probe) and not heavy:
            out = self._run_batch(batch, names)
            measured = out[1][1]
            self._infer_ns_avg = measured if probe else 0.8 * avg + 0.2 * measured
        else:
            loop = asyncio.get_running_loop()
            out = await loop.run_in_executor(self._pool, self._run_batch, batch, names)
            if not heavy:  # an outlier says nothing about the usual request's cost
                self._infer_ns_avg = 0.8 * avg + 0.2 * out[1][1]
        if self._simulated_s:
            await asyncio.sleep(self._simulated_s)
        return out

    def _internal(self, e: Exception) -> Internal:
        """Not a MeshError: a bug of ours (the runtime maps what onnxruntime raises)."""
        log.error(
            "batch_failed",
            model=self.spec.name,
            error_type=type(e).__name__,
            exc_info=(type(e), e, e.__traceback__),
        )
        return Internal(f"model {self.spec.name!r}: internal error: {type(e).__name__}: {e}")

    def _run_batch(
        self, batch: list[_Pending], names: list[str]
    ) -> tuple[list[dict[str, np.ndarray]], tuple[int, int, int]]:
        """Runs on an executor thread: merge, run, split; returns results and timings."""
        t0 = time.perf_counter_ns()
        if len(batch) == 1:
            feeds = batch[0].inputs
        else:
            feeds = {
                name: np.concatenate([p.inputs[name] for p in batch], axis=0)
                for name in batch[0].inputs
            }
        t1 = time.perf_counter_ns()
        arrays = self._run(names, feeds)
        t2 = time.perf_counter_ns()
        if len(batch) == 1:
            results = [dict(zip(names, arrays, strict=True))]
        else:
            offsets = np.cumsum([p.rows for p in batch])[:-1]
            pieces = [np.split(a, offsets, axis=0) for a in arrays]
            results = [{n: pieces[j][i] for j, n in enumerate(names)} for i in range(len(batch))]
        t3 = time.perf_counter_ns()
        return results, (t1 - t0, t2 - t1, t3 - t2)
