"""How fast the engine gets through requests: what the worker publishes for the routers'
queue-wait prediction (router/forwarding/shedding.py), with its depth
(common/mesh_state.DepthSample).

Each finished request's service time (admission to its end) feeds an exponential moving
average; the rate a waiting request's turn comes at is then the sequences running at once
over that mean (Little's law): every slot frees once per mean service time. Measured here
rather than taken from the planner's model: the worker sees every request it serves, from
every router, at the lengths its clients actually ask for.
"""

from __future__ import annotations

ALPHA = 0.1  # weight of the newest request: ~10 requests of memory


class ServiceTime:
    def __init__(self, alpha: float = ALPHA) -> None:
        self.alpha = alpha
        self.mean_s = 0.0  # 0: nothing finished yet

    def observe(self, seconds: float) -> None:
        seconds = max(seconds, 1e-3)
        first = self.mean_s == 0.0
        self.mean_s = seconds if first else self.mean_s + self.alpha * (seconds - self.mean_s)

    def rate(self, concurrency: int) -> float:
        """Requests finished per second with `concurrency` running; 0.0 while unknown."""
        return concurrency / self.mean_s if self.mean_s > 0 else 0.0
