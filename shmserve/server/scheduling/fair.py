"""FairQueue: one queue of a priority level, shared fairly between clients (issue 14).

Each client (a lease of the server: Pending.client) has its own FIFO queue, and the
clients with requests waiting take turns: the order batches take requests in is the
head of every client's queue, in turn order, then the second of each, and so on
(round robin, one request a turn). A client served goes to the back of the turns;
a client that had nothing waiting joins at the back. So a caller with 64 requests
queued holds one place in the turns, not 64: a polite caller's one request waits
behind at most one request of each other client, not behind all of theirs.

Each client's own requests keep their arrival order. With one client (or requests
that name none, as in the unit tests) the order is plain arrival order, Triton's.

Cost: append and taking a head request are O(1); iterating costs one step per
request plus one per client queue.
"""
from __future__ import annotations

import collections
from typing import Iterator

from .base import Pending


class FairQueue:
    """Per-client FIFO queues, iterated round robin (see the module docstring)."""
    __slots__ = ("clients", "count")

    def __init__(self):
        # client -> its requests in arrival order; dict order is the turn order
        self.clients: dict[int, collections.deque[Pending]] = {}
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def append(self, p: Pending) -> None:
        q = self.clients.get(p.client)
        if q is None:
            q = self.clients[p.client] = collections.deque()
        q.append(p)
        self.count += 1

    def head(self) -> Pending | None:
        """The request the next turn takes."""
        for q in self.clients.values():
            return q[0]
        return None

    def oldest(self) -> Pending | None:
        """The request that has waited longest (some client's head)."""
        return min((q[0] for q in self.clients.values()), key=lambda p: p.arrived_ns, default=None)

    def __iter__(self) -> Iterator[Pending]:
        """The requests in the order batches take them: round robin over the clients."""
        queues = list(self.clients.values())
        if len(queues) == 1:
            yield from queues[0]
            return
        turns = [iter(q) for q in queues]
        while turns:  # one round: the next request of each client that has one left
            left = []
            for t in turns:
                p = next(t, None)
                if p is not None:
                    yield p
                    left.append(t)
            turns = left

    def remove(self, p: Pending, served: bool) -> None:
        """Takes p out. served (it went into a batch): its client's turn is used, and
        the client goes to the back; else (it timed out) its place stays."""
        q = self.clients[p.client]
        if q[0] is p:
            q.popleft()
        else:  # not its client's head: a batch of other shapes, or a timeout
            del q[next(i for i, x in enumerate(q) if x is p)]
        self.count -= 1
        if not q:
            del self.clients[p.client]
        elif served:
            del self.clients[p.client]  # to the back of the turns
            self.clients[p.client] = q

    def clear(self) -> None:
        self.clients.clear()
        self.count = 0
