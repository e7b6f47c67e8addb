"""The worker's presence in Redis: registration with a heartbeat TTL, and its queue depth.

Pushed, not polled (mesh_state.REGISTRY_EVENTS): the worker publishes "join" when it
registers (first, or again after Redis lost it), "leave" when it deregisters, and every
depth sample it writes, so routers learn of changes as they happen.

Busy (requests waiting or running) the depth is sampled every BUSY_POLL_S and written when
it changed, and at least every `depth_interval_s`, so a router can tell a busy worker that
stopped (no fresh sample) from one that works. Idle, the worker sleeps until a request
arrives (`activity`, called by the servicer) or the next heartbeat: an idle worker wakes
once a heartbeat, not a hundred times a second.

Redis trouble never stops serving: a failed write is logged once per outage and tried again
on the next tick. The registration is written again at once when Redis comes back from an
error, and whenever a depth write finds the registration gone: a Redis that restarted
empty has it back within a depth interval while busy, a heartbeat while idle. With the
depth, each model's share of the mesh-wide scaling keys is written (worker/scaling.py), on
change and once a heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog
from redis.exceptions import RedisError

from common import mesh_state, redis_conn
from common.mesh_state import DepthSample, RegistryEvent, WorkerInfo, now_ms
from common.outage import Outage
from worker.scaling import ModelLoad, ScaleKeys

log = structlog.get_logger()

BUSY_POLL_S = 0.01  # how often a busy worker looks at its depth for a change


class Registration:
    def __init__(
        self,
        redis_url: str,
        info: WorkerInfo,
        depth: Callable[[], int],
        kv: Callable[[], tuple[int, ...]] = lambda: (0, 0),
        service: Callable[[], tuple[int, int]] = lambda: (0, 0),
        loads: Callable[[], dict[str, ModelLoad]] = dict,
        heartbeat_s: float = 1.0,
        ttl_s: float = 5.0,
        depth_interval_s: float = 0.1,
        password: str | None = None,
    ) -> None:
        self.redis = redis_conn.connect_async(
            redis_url, password=password, timeout_s=0.5, connect_timeout_s=0.5
        )
        self.info = info
        self.depth = depth
        self.kv = kv  # (used, total) KV cache tokens, published with the depth
        self.service = service  # (slots, requests finished per 1,000 s): likewise
        self.loads = loads  # per model: this worker's share of the scaling keys
        self.scale = ScaleKeys(self.redis, info.id, int(ttl_s * 1000))
        self.heartbeat_s = heartbeat_s
        self.ttl_ms = int(ttl_s * 1000)
        self.depth_interval_s = depth_interval_s
        self.redis_state = Outage("redis_unreachable", "redis_reconnected", worker=info.id)
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        # The loop writes under it and the leave cancels the loop holding it: a write
        # cancelled on its way may still land after the leave, and a cancellation that
        # arrives inside redis-py's pipeline can be lost (the loop went on heartbeating,
        # and the worker stayed registered after it left).
        self._writing = asyncio.Lock()

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def activity(self) -> None:
        """A request started: an idle worker publishes its new depth now."""
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        last_beat = 0.0
        last_depth: DepthSample | None = None
        registered = False  # as far as we know, our registration is in Redis
        last_loads: dict[str, ModelLoad] | None = None
        last_loads_at = 0.0
        while True:
            now, sampled_ms = time.monotonic(), now_ms()
            self._wake.clear()
            depth = self.depth()
            kv_used, kv_total = self.kv()
            loads = self.loads()
            due = (
                last_depth is None or sampled_ms - last_depth.at_ms >= self.depth_interval_s * 1000
            )
            beat = now - last_beat >= self.heartbeat_s
            try:
                async with self._writing:
                    if beat or not registered:
                        await self._heartbeat(announce=not registered)
                        last_beat, registered = now, True
                    changed = last_depth is None or (depth, kv_used) != (
                        last_depth.depth,
                        last_depth.kv_used,
                    )
                    if changed or (due and (depth or beat)):
                        slots, rate = self.service()
                        last_depth = DepthSample(depth, sampled_ms, kv_used, kv_total, slots, rate)
                        registered = await self._publish_depth(last_depth)
                    # On change, and once a heartbeat to stay within the TTL: the script reads
                    # every replica's share, so idle refreshes are kept few.
                    if loads != last_loads or now - last_loads_at >= self.heartbeat_s:
                        await self.scale.publish(loads)
                        last_loads, last_loads_at = loads, now
                self.redis_state.succeeded()
                if not registered:  # Redis lost it (restarted empty): now, not next beat
                    continue
            except (RedisError, OSError) as e:
                self.redis_state.failed(e)
                registered = False  # register again (and announce it) once Redis answers
                await asyncio.sleep(min(self.heartbeat_s / 2, 0.1))
                continue
            if depth:
                await asyncio.sleep(min(BUSY_POLL_S, self.depth_interval_s))
            else:  # idle: until a request arrives or the next heartbeat is due
                wait = max(0.0, last_beat + self.heartbeat_s - time.monotonic())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)

    async def _publish_depth(self, sample: DepthSample) -> bool:
        """Write and publish one depth sample; False when the registration is gone."""
        key = mesh_state.depth_key(self.info.id)
        event = RegistryEvent("depth", self.info.id, sample.encode())
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(key, sample.encode(), px=self.ttl_ms)
            pipe.publish(mesh_state.REGISTRY_EVENTS, event.encode())
            pipe.exists(mesh_state.worker_key(self.info.id))
            _, _, registered = await pipe.execute()
        return bool(registered)

    async def _heartbeat(self, announce: bool = False) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(mesh_state.worker_key(self.info.id), self.info.to_json(), px=self.ttl_ms)
            pipe.zadd(mesh_state.WORKERS, {self.info.id: now_ms()})
            if announce:
                event = RegistryEvent("join", self.info.id)
                pipe.publish(mesh_state.REGISTRY_EVENTS, event.encode())
            await pipe.execute()

    async def deregister(self, within_s: float) -> None:
        """Leave the registry at once (drain, a failed group), so routers stop sending
        before we stop. The registration goes first (it is what routers read), then the
        scaling shares; a failed write is tried again until `within_s` is spent, after
        which what is left expires with its TTL. Waiting for a write on its way to finish
        counts against `within_s` too: a Redis that hangs cannot hold the drain."""
        deadline = time.monotonic() + within_s
        await self._stop_loop(within_s)
        steps = [self._leave, lambda: self.scale.withdraw(list(self.info.models))]
        while steps:
            try:
                await steps[0]()
                steps.pop(0)
            except (RedisError, OSError) as e:
                if time.monotonic() + 0.1 > deadline:
                    log.warning("deregister_failed", worker=self.info.id, error=str(e))
                    break
                await asyncio.sleep(0.1)
        else:
            log.info("worker_deregistered", worker=self.info.id)
        await self.redis.aclose()

    async def _stop_loop(self, within_s: float) -> None:
        """Cancel the heartbeat loop between writes (holding the lock it writes under),
        or, when a write hangs past `within_s`, where it is."""
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self._writing.acquire(), within_s)
        except TimeoutError:
            self._task.cancel()  # mid-write: the write may still land; its TTL ends it
            await asyncio.wait([self._task], timeout=0.1)
            return
        try:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        finally:
            self._writing.release()

    async def _leave(self) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(mesh_state.worker_key(self.info.id), mesh_state.depth_key(self.info.id))
            pipe.zrem(mesh_state.WORKERS, self.info.id)
            leave = RegistryEvent("leave", self.info.id)
            pipe.publish(mesh_state.REGISTRY_EVENTS, leave.encode())
            await pipe.execute()
