"""The router's auth path timed in this process against a mesh's Redis, part by part: what
benchmarks/tenants.py reports as `components` next to what a whole call costs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable

from common import mesh_state, redis_conn
from common.tenancy import TenantPolicy, key_hash
from devmesh.processes import LocalMesh
from devmesh.redis_acl import user_url
from router.tenancy import limits
from router.tenancy.auth import Auth
from router.tenancy.limits import Limiter


async def components(
    mesh: LocalMesh,
    metadata: tuple[tuple[str, str], ...],
    tenant_name: str,
    policy: TenantPolicy,
    n: int,
) -> dict:
    """The auth path's parts in this process, against the mesh's Redis as the router user
    (`metadata`: a key of `tenant_name`, whose policy is `policy`); medians in microseconds
    over `n` sequential calls: a cached key (what a call pays), a key looked up in Redis
    (what the first call of a key pays, once per cache period), one rate-limit decision from
    the lease (what a call pays), one lease renewal (the LEASE script: what the background
    pays per renewal, and a call that finds its lease empty), and a bare Redis round trip
    (PING)."""
    assert mesh.users is not None
    redis = redis_conn.connect_async(
        user_url(mesh.redis_url, "router"), password=mesh.users.password("router")
    )
    limiter = Limiter(redis)
    auth = Auth(redis, limiter, cache_s=3600)
    tenant = await auth.authenticate(metadata)
    key = metadata[0][1].split(" ", 1)[1]
    lease = redis.register_script(limits.LEASE)
    lease_keys = [
        mesh_state.limit_key(tenant_name, "rps"),
        mesh_state.limit_key(tenant_name, "tpm"),
        mesh_state.spend_key(tenant_name, limits.month()),
    ]
    # give one token back, take one: the bucket is left as it was
    lease_args: list[str | int] = [
        repr(policy.requests_per_second),
        policy.bucket_size,
        0,
        2**60,
        1,
        1,
    ]

    async def median_us(step: Callable[[], Awaitable[object]]) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await step()
            times.append(time.perf_counter() - t0)
        return round(statistics.median(times) * 1e6, 1)

    out = {
        "authenticate_cached_us": await median_us(lambda: auth.authenticate(metadata)),
        "key_lookup_redis_us": await median_us(lambda: auth._lookup(key, key_hash(key))),
        "admit_from_lease_us": await median_us(lambda: auth.admit(tenant, "mlp")),
        "lease_renewal_us": await median_us(lambda: lease(keys=lease_keys, args=lease_args)),
        "redis_ping_us": await median_us(redis.ping),
    }
    await limiter.close()
    await redis.aclose()
    return out
