"""The worker's presence in Redis: registration with a heartbeat TTL, and its queue depth.

Redis trouble never stops serving: a failed write is logged once per outage and tried again
on the next tick. The registration is written again at once when Redis comes back from an
error, and whenever the depth write (every `depth_interval_s`) finds the registration gone:
a Redis that restarted empty has it back within a depth interval, not a heartbeat.
With the depth, each model's share of the mesh-wide scaling keys is written
(worker/scaling.py), on change and once a heartbeat.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from common import mesh_state
from common.mesh_state import DepthSample, WorkerInfo, now_ms
from common.outage import Outage
from worker.scaling import ModelLoad, ScaleKeys

log = structlog.get_logger()


class Registration:
    def __init__(
        self,
        redis_url: str,
        info: WorkerInfo,
        depth: Callable[[], int],
        kv: Callable[[], tuple[int, ...]] = lambda: (0, 0),
        loads: Callable[[], dict[str, ModelLoad]] = dict,
        heartbeat_s: float = 1.0,
        ttl_s: float = 5.0,
        depth_interval_s: float = 0.1,
        password: str | None = None,
    ) -> None:
        self.redis = aioredis.from_url(
            redis_url,
            password=password,
            socket_timeout=0.5,
            socket_connect_timeout=0.5,
            decode_responses=True,
        )
        self.info = info
        self.depth = depth
        self.kv = kv  # (used, total) KV cache tokens, published with the depth
        self.loads = loads  # per model: this worker's share of the scaling keys
        self.scale = ScaleKeys(self.redis, info.id, int(ttl_s * 1000))
        self.heartbeat_s = heartbeat_s
        self.ttl_ms = int(ttl_s * 1000)
        self.depth_interval_s = depth_interval_s
        self.redis_state = Outage("redis_unreachable", "redis_reconnected", worker=info.id)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        last_beat = 0.0
        last_depth: DepthSample | None = None
        last_loads: dict[str, ModelLoad] | None = None
        last_loads_at = 0.0
        poll = min(0.01, self.depth_interval_s)
        while True:
            now = time.monotonic()
            depth = self.depth()
            kv_used, kv_total = self.kv()
            loads = self.loads()
            due = last_depth is None or now_ms() - last_depth.at_ms >= self.depth_interval_s * 1000
            try:
                if now - last_beat >= self.heartbeat_s:
                    await self._heartbeat()
                    last_beat = now
                changed = last_depth is None or (depth, kv_used) != (
                    last_depth.depth,
                    last_depth.kv_used,
                )
                if due or changed:
                    sample = DepthSample(depth, now_ms(), kv_used, kv_total)
                    key = mesh_state.depth_key(self.info.id)
                    async with self.redis.pipeline(transaction=False) as pipe:
                        pipe.set(key, sample.encode(), px=self.ttl_ms)
                        pipe.exists(mesh_state.worker_key(self.info.id))
                        _, registered = await pipe.execute()
                    last_depth = sample
                    if not registered:  # Redis lost it (restarted empty): now, not next beat
                        await self._heartbeat()
                        last_beat = now
                # On change, and once a heartbeat to stay within the TTL: the script reads
                # every replica's share, so idle refreshes are kept few.
                if loads != last_loads or now - last_loads_at >= self.heartbeat_s:
                    await self.scale.publish(loads)
                    last_loads, last_loads_at = loads, now
                self.redis_state.succeeded()
            except (RedisError, OSError) as e:
                self.redis_state.failed(e)
                last_beat = 0.0  # register again as soon as Redis answers
                await asyncio.sleep(min(self.heartbeat_s / 2, 0.1))
                continue
            await asyncio.sleep(poll)

    async def _heartbeat(self) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(mesh_state.worker_key(self.info.id), self.info.to_json(), px=self.ttl_ms)
            pipe.zadd(mesh_state.WORKERS, {self.info.id: now_ms()})
            await pipe.execute()

    async def deregister(self) -> None:
        """Leave the registry at once (drain), so routers stop sending before we stop."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self.scale.withdraw(list(self.info.models))
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(mesh_state.worker_key(self.info.id), mesh_state.depth_key(self.info.id))
                pipe.zrem(mesh_state.WORKERS, self.info.id)
                await pipe.execute()
            log.info("worker_deregistered", worker=self.info.id)
        except (RedisError, OSError) as e:
            log.warning("deregister_failed", worker=self.info.id, error=str(e))
        await self.redis.aclose()
