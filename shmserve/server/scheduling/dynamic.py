"""Dynamic batching, Triton's rules: a batch is the oldest request and the later ones
of the same non-batch shapes, up to max_batch_size rows; it goes when full, when a
preferred_batch_size can be cut from it, or once the model's oldest request has waited
max_queue_delay_microseconds. default_queue_policy comes from FifoQueue.

Fair share (fifo.py, fair.py): "oldest" and "later" are in the order batches take
requests, where clients take turns; the delay counts from the oldest request of the
model, whichever client sent it, so a turn order never makes a request wait longer
for its batch to go.

Instance balancing (shmserve.instance_balancing, repository.py): when the batcher asks
for batches for several idle instances at once (next_batches), Triton hands the first
one all it can take and leaves the others idle (greedy: a closed loop of 32 callers
gives one instance batches of 32 while the other waits). Balanced, the default, first
forms exactly what greedy would send now, then spreads it over the idle instances:
per shape key, the same requests in arrival order, cut into near-equal batches. It
never holds back what greedy sends, nor sends what greedy would hold (the queue left
behind and its deadline are greedy's), and a batch greedy cut to a
preferred_batch_size is kept as it is."""
from __future__ import annotations

from ...protocol import MAX_BATCH_REQUESTS
from ..repository import BALANCED, ModelSpec
from .base import Pending
from .fifo import FifoQueue


def rows_of(batch: list[Pending]) -> int:
    return sum(p.rows for p in batch)


class DynamicBatchScheduler(FifoQueue):
    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.max_rows = max(spec.max_batch_size, 1)
        self.delay_ns = spec.max_queue_delay_us * 1000
        self.preferred = spec.preferred_batch_sizes  # sorted by the repository
        self.balanced = spec.instance_balancing == BALANCED

    @classmethod
    def applies_to(cls, spec: ModelSpec) -> bool:
        return spec.dynamic_batching

    def sends_lone_request_at_once(self) -> bool:
        # Without a delay a lone request is its own batch at once (next_batch: expired).
        return self.plain_queue() and not self.delay_ns

    def next_batch(self, now_ns: int) -> tuple[list[Pending] | None, int | None]:
        """Returns (batch, None) when a batch should go now, or (None, deadline_ns)
        when it is worth waiting for more requests until deadline_ns."""
        head = self.head()
        if head is None:
            return None, None
        picked, rows, preferred_prefix = [], 0, 0
        more = False
        for p in self.ordered():  # priority order, then clients in turn, each in arrival order
            if p.key != head.key:  # different shapes never share a batch
                continue
            if rows + p.rows > self.max_rows or len(picked) == MAX_BATCH_REQUESTS:
                more = True
                break
            picked.append(p)
            rows += p.rows
            if rows in self.preferred:
                preferred_prefix = len(picked)
        full = more or rows >= self.max_rows
        oldest = self.oldest().arrived_ns if self.delay_ns else head.arrived_ns
        expired = now_ns - oldest >= self.delay_ns
        if preferred_prefix and (full or expired or rows >= self.preferred[-1]):
            picked = picked[:preferred_prefix]
        elif not (full or expired):
            return None, oldest + self.delay_ns
        self.take(picked)
        return picked, None

    def join(self, batch: list[Pending], now_ns: int) -> list[Pending]:
        """The later requests of the batch's shape key that fit (next_batch's rule);
        none for a model with preferred sizes, whose cut batches are kept as cut."""
        if self.preferred:
            return []
        key, rows, picked = batch[0].key, rows_of(batch), []
        for p in self.ordered():
            if p.key != key:
                continue
            if rows + p.rows > self.max_rows or len(batch) + len(picked) == MAX_BATCH_REQUESTS:
                break
            picked.append(p)
            rows += p.rows
        if picked:
            self.take(picked)
        return picked

    def next_batches(self, now_ns: int, idle: int) -> tuple[list[list[Pending]], int | None]:
        plan, deadline = super().next_batches(now_ns, idle)  # greedy: what goes now
        if self.balanced and idle > 1 and plan:
            plan = self.balance(plan, idle)
        return plan, deadline

    def balance(self, plan: list[list[Pending]], idle: int) -> list[list[Pending]]:
        """The requests of greedy's plan in up to `idle` batches of near-equal rows."""
        out, groups = [], {}  # kept batches; shape key -> its other batches, in plan order
        for batch in plan:
            if rows_of(batch) in self.preferred:
                out.append(batch)
            else:
                groups.setdefault(batch[0].key, []).append(batch)
        counts = {key: len(batches) for key, batches in groups.items()}
        for _ in range(idle - len(plan)):  # each spare instance to the largest share
            open_keys = [k for k, bs in groups.items() if counts[k] < sum(map(len, bs))]
            if not open_keys:
                break
            key = max(open_keys, key=lambda k: sum(map(rows_of, groups[k])) / counts[k])
            counts[key] += 1
        for key, batches in groups.items():
            out += self.split([p for b in batches for p in b], counts[key]) or batches
        out.sort(key=lambda b: b[0].arrived_ns)  # the oldest request's batch first
        return out

    def split(self, pool: list[Pending], n: int) -> list[list[Pending]] | None:
        """pool (one shape key, arrival order) cut into n batches of near-equal rows
        within the batch limits, or None if it does not fit (greedy's batches stand then)."""
        out, i, rows_left = [], 0, rows_of(pool)
        for j in range(n):
            target = -(-rows_left // (n - j))  # ceil: the larger shares go first
            batch, rows = [], 0
            while (i < len(pool) and rows < target and len(batch) < MAX_BATCH_REQUESTS
                   and rows + pool[i].rows <= self.max_rows):
                batch.append(pool[i])
                rows += pool[i].rows
                i += 1
            if not batch:
                return None
            out.append(batch)
            rows_left -= rows
        return out if i == len(pool) else None
