"""Token-fair admission: virtual token counters (VTC, "Fairness in Serving Large Language
Models", Sheng et al., OSDI'24).

The waiting sequences are kept one FIFO per tenant (the request parameter `tenant`, set by
the router from the caller's API key; "" for every unauthenticated call). Each tenant has a
counter of the service it got: every prompt token a step prefills adds INPUT_COST, every
token it decodes OUTPUT_COST, divided by the tenant's weight. The next sequence to admit is
the oldest of the backlogged tenant (one with a sequence waiting) whose counter is the
smallest. A tenant that becomes backlogged again has its counter lifted to the smallest of
the backlogged ones (or, with none, to that of the tenant admitted last), so time spent idle
is not banked as credit to burst with later. The paper proves that between two backlogged
tenants the service difference stays within a bound of about 2 x (a step's token budget +
the largest request's cost); tests/worker/llm/test_fairness.py checks that bound.

With one tenant there is one FIFO and the order is arrival order, exactly as before.

Counters share the order of admission, not the slots: a tenant with a deep backlog fills
every slot that frees while another tenant is idle, and a light tenant's next request then
waits for one of those to end (a whole request's time, not a step's). So the scheduler holds
the last `reserved_slots` free slots for a tenant seen within RECENT_SECONDS that runs
nothing (`recent`, `head(among=...)`): a tenant that sends now and then finds a slot, and
one tenant alone, or tenants that are all running, still use every slot. When no slot is
free for such a tenant (it was not seen lately, or reserved_slots is 0), the scheduler
preempts the newest sequence of a tenant running several (`requeue` puts it back first in
its tenant's queue; worker/llm/scheduler.py, `fair_preemption`).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Collection, Iterator
from typing import Generic, Protocol, TypeVar

# The paper's weights: a decoded token costs about twice a prefilled one (it runs in a step
# of its own rows; a prompt token shares a chunk's run).
INPUT_COST = 1.0
OUTPUT_COST = 2.0
MAX_IDLE_TENANTS = 10_000  # counters kept for tenants with nothing waiting
# a tenant that sent a request this recently is one a held-back slot waits for: longer than
# the gap between a chat's turns, short enough that a tenant gone quiet frees the slot
RECENT_SECONDS = 10.0


class Fair(Protocol):
    tenant: str
    weight: float


T = TypeVar("T", bound=Fair)


class FairQueue(Generic[T]):
    """The waiting sequences, by tenant; `head` is the one to admit next."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[T]] = {}  # backlogged tenants only
        self.counters: dict[str, float] = {}
        self._arrival: dict[int, int] = {}  # id(seq) -> arrival number, for iteration
        self._numbers = itertools.count()
        self._last = ""  # the tenant admitted last: the lift's floor when none is backlogged
        self._seen: dict[str, float] = {}  # tenant -> monotonic time of its last arrival

    def __len__(self) -> int:
        return len(self._arrival)

    def __bool__(self) -> bool:
        return bool(self._arrival)

    def __iter__(self) -> Iterator[T]:
        """In arrival order."""
        seqs = [s for q in self.queues.values() for s in q]
        return iter(sorted(seqs, key=lambda s: self._arrival[id(s)]))

    def __contains__(self, seq: object) -> bool:
        return any(seq in q for q in self.queues.values())

    def append(self, seq: T) -> None:
        self._backlog(seq.tenant).append(seq)
        self._arrival[id(seq)] = next(self._numbers)
        self._seen[seq.tenant] = time.monotonic()
        if len(self._seen) > MAX_IDLE_TENANTS:
            horizon = time.monotonic() - RECENT_SECONDS
            self._seen = {t: s for t, s in self._seen.items() if s >= horizon}

    def requeue(self, seq: T) -> None:
        """`seq`, preempted, goes back to the front of its tenant's queue, ahead of the
        tenant's later arrivals (the scheduler's fair preemption)."""
        first = min(self._arrival.values(), default=0)
        self._backlog(seq.tenant).appendleft(seq)
        self._arrival[id(seq)] = first - 1

    def head(self, among: Collection[str] | None = None) -> T | None:
        """The oldest sequence of the backlogged tenant (of `among`, if given) with the
        smallest counter (ties: the one whose head came first); None when none waits."""
        tenants = [t for t in self.queues if among is None or t in among]
        if not tenants:
            return None
        tenant = min(
            tenants,
            key=lambda t: (self.counters.get(t, 0.0), self._arrival[id(self.queues[t][0])]),
        )
        return self.queues[tenant][0]

    def admit(self, seq: T) -> None:
        """`seq`, a head, leaves the queue with a slot."""
        self._take(seq)
        self._last = seq.tenant

    def recent(self, seconds: float = RECENT_SECONDS) -> set[str]:
        """The tenants that sent a request within the last `seconds`."""
        horizon = time.monotonic() - seconds
        return {t for t, s in self._seen.items() if s >= horizon}

    def remove(self, seq: T) -> None:
        """A waiting sequence leaves unadmitted (cancelled). ValueError if it is not here."""
        queue = self.queues.get(seq.tenant)
        if queue is None or seq not in queue:
            raise ValueError("not waiting")
        self._take(seq)

    def charge(self, seq: Fair, input_tokens: int = 0, output_tokens: int = 0) -> None:
        """Service `seq`'s tenant got in a step: prompt tokens prefilled, tokens decoded."""
        cost = input_tokens * INPUT_COST + output_tokens * OUTPUT_COST
        if cost:
            tenant = seq.tenant
            self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / seq.weight

    def _backlog(self, tenant: str) -> deque[T]:
        """The tenant's queue; one becoming backlogged has its counter lifted first."""
        if tenant not in self.queues:
            self._lift(tenant)
            self.queues[tenant] = deque()
        return self.queues[tenant]

    def _take(self, seq: T) -> None:
        queue = self.queues[seq.tenant]
        queue.remove(seq)
        del self._arrival[id(seq)]
        if not queue:
            del self.queues[seq.tenant]

    def _lift(self, tenant: str) -> None:
        """The counter lift: a tenant becoming backlogged starts no lower than the least
        served of those backlogged (or the tenant admitted last, when none is)."""
        floors = [self.counters.get(t, 0.0) for t in self.queues]
        if not floors and self._last in self.counters:
            floors = [self.counters[self._last]]
        if floors:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(floors))
        if len(self.counters) > MAX_IDLE_TENANTS:
            keep = {*self.queues, tenant, self._last}
            self.counters = {t: c for t, c in self.counters.items() if t in keep}
