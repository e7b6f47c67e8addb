"""The KV cache's room: its slots and its token budget, as plain bookkeeping.

A sequence holds one slot for its lifetime and reserves `prompt + max_tokens` tokens of the
budget when admitted, so a running sequence never runs out of cache and nothing needs
preempting. This is all admission asks of the cache (worker/llm/scheduler.py), so the
scheduler is tested with this very object and no memory behind it; worker/llm/cache.py's
KVCache holds one and adds the memory.
"""

from __future__ import annotations


class KVBudget:
    def __init__(self, slots: int, budget_tokens: int) -> None:
        self.slots = slots
        self.budget_tokens = budget_tokens
        self.reserved_tokens = 0
        self._free = list(range(slots - 1, -1, -1))  # pop() gives the lowest slot

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        return self.budget_tokens - self.reserved_tokens

    def fits(self, tokens: int) -> bool:
        return bool(self._free) and tokens <= self.free_tokens

    def allocate(self, tokens: int) -> int:
        """A slot for a sequence that may grow to `tokens`; the caller checked `fits`."""
        if not self.fits(tokens):
            raise ValueError(
                f"no room for {tokens} tokens: {self.free_slots} free slots, "
                f"{self.free_tokens} free tokens"
            )
        self._free.sort(reverse=True)
        self.reserved_tokens += tokens
        return self._free.pop()

    def release(self, slot: int, tokens: int) -> None:
        """Give the slot and its reservation back."""
        if not 0 <= slot < self.slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self.reserved_tokens -= tokens
        self._free.append(slot)

    def lowest_free(self) -> int:
        """The lowest free slot, -1 when none."""
        return min(self._free, default=-1)

    def move(self, src: int, dst: int) -> None:
        """The sequence in `src` now lives in the free slot `dst` (the caller moves its rows)."""
        if dst not in self._free or src in self._free:
            raise ValueError(f"cannot move slot {src} to {dst}: {dst} is not free")
        self._free.remove(dst)
        self._free.append(src)
