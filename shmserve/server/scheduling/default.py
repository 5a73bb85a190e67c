"""The default policy, for a model without dynamic_batching (Triton's default
scheduler): one request per execution, in arrival order."""
from __future__ import annotations

from ..repository import ModelSpec
from .base import Pending
from .fifo import FifoQueue


class DefaultScheduler(FifoQueue):
    @classmethod
    def applies_to(cls, spec: ModelSpec) -> bool:
        return True  # the fallback: POLICIES lists it last

    def sends_lone_request_at_once(self) -> bool:
        return self.plain_queue()

    def next_batch(self, now_ns: int) -> tuple[list[Pending] | None, int | None]:
        head = self.head()
        if head is None:
            return None, None
        self.take([head])
        return [head], None
