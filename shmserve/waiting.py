"""How long a waiter spins before it sleeps on a futex.

A futex wake-up costs 10-30 us on small virtual machines (the hypervisor must wake an
idle vCPU), more than a whole round trip. A waiter therefore spins (yielding the CPU,
see shms_doorbell_wait) for about as long as its recent waits lasted, so a steady
stream of requests never pays for a wake-up, and falls back to the base spin when
waits grow long, so an idle process sleeps at once and uses no CPU.
"""
from __future__ import annotations


class AdaptiveSpin:
    __slots__ = ("base_ns", "max_ns", "typical_ns")

    def __init__(self, base_ns: int, max_ns: int):
        self.base_ns = base_ns
        self.max_ns = max(max_ns, base_ns)
        self.typical_ns = base_ns

    def budget_ns(self) -> int:
        if self.base_ns == 0 or self.typical_ns > self.max_ns:
            return self.base_ns
        return min(self.max_ns, max(self.base_ns, self.typical_ns * 3 // 2))

    def record(self, waited_ns: int) -> None:
        """Feeds one observed wait (an exponential average, 1/8 weight)."""
        self.typical_ns += (waited_ns - self.typical_ns) >> 3
