"""The ensemble backend: runs a batch of ensemble requests through its steps.

The worker is a client of its own server (one lease, opened at the first batch, as a
python model's BLS requests are). Each step is one request of that lease carrying
the whole batch, sent as soon as the tensors it needs exist, so independent steps
run at once, each scheduled by its own model's policy. A step's outputs are views
of the lease's arena; given to a later step they are sent in place (the client
adopts arrays that lie in its arena), so intermediate tensors are never copied. The
ensemble's inputs are copied once into the arena (they live in the callers' arenas).
A step that fails fails the batch with the step's status and a message naming it.
"""
from __future__ import annotations

import concurrent.futures
import threading

from .. import protocol as P
from ..errors import ShmServeError, UnavailableError, from_status
from ..server import ensemble

STEP_TIMEOUT_S = 60.0  # a step that takes longer fails the batch, naming the step
# A step's status the ensemble's callers get as it is; the others (its timeout, its
# lease ending) say the ensemble could not be served: UNAVAILABLE.
PASSED_ON = (P.Status.INVALID_ARG, P.Status.NOT_FOUND, P.Status.UNAVAILABLE,
             P.Status.INTERNAL, P.Status.BUSY)


def check_config(cfg, where: str) -> None:
    ensemble.check_graph(cfg, where)


class Backend:
    def __init__(self, spec, instance):
        self.spec, self.instance = spec, instance
        self.steps = ensemble.check_graph(spec.config(), f"ensemble '{spec.name}'")
        self.output_names = [t.name for t in spec.outputs]
        self.client = None
        self.lock = threading.Lock()

    def _client(self):
        with self.lock:
            if self.client is None:
                from ..client import Client

                self.client = Client(self.instance.server, socket_path_=self.instance.socket)
            return self.client

    def execute(self, inputs: dict) -> dict:
        client = self._client()
        tensors = dict(inputs)
        waiting = list(self.steps)
        running: dict[concurrent.futures.Future, ensemble.Step] = {}
        try:
            while waiting or running:
                ready = [s for s in waiting if all(t in tensors for _, t in s.inputs)]
                if len(ready) == 1 and not running:  # a chain: one C call, no future
                    waiting.remove(ready[0])
                    self._run(client, ready[0], tensors)
                    continue
                for step in ready:
                    waiting.remove(step)
                    running[self._send(client, step, tensors)] = step
                if not running:  # check_graph makes this impossible; never hang on it
                    raise UnavailableError(f"ensemble '{self.spec.name}': steps "
                                           f"{[s.index for s in waiting]} cannot start")
                done, _ = concurrent.futures.wait(running, timeout=STEP_TIMEOUT_S,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                if not done:
                    late = ", ".join(s.describe() for s in running.values())
                    raise UnavailableError(f"ensemble '{self.spec.name}': {late} gave no "
                                             f"answer within {STEP_TIMEOUT_S:g} s")
                for future in done:
                    step = running.pop(future)
                    try:
                        result = future.result()
                    except ShmServeError as e:
                        raise self._failed(step, e) from None
                    for name, tensor in step.outputs:
                        tensors[tensor] = result[name]
        finally:
            for future in running:  # answers nobody will read: let them land, unread
                future.cancel()
        return {name: tensors[name] for name in self.output_names}

    @staticmethod
    def _request(step, tensors) -> tuple:
        return (step.model, {name: tensors[t] for name, t in step.inputs},
                [name for name, _ in step.outputs], None if step.version < 0 else step.version)

    def _run(self, client, step, tensors) -> None:
        try:
            result = client.infer(*self._request(step, tensors), timeout=STEP_TIMEOUT_S)
        except ShmServeError as e:
            raise self._failed(step, e) from None
        for name, tensor in step.outputs:
            tensors[tensor] = result[name]

    def _send(self, client, step, tensors) -> concurrent.futures.Future:
        try:
            return client.submit(*self._request(step, tensors))
        except ShmServeError as e:
            raise self._failed(step, e) from None

    def _failed(self, step, e: ShmServeError) -> ShmServeError:
        """The step's error, its message naming the ensemble and the step."""
        code = e.code if e.code in PASSED_ON else P.Status.UNAVAILABLE
        return from_status(code, f"ensemble '{self.spec.name}' {step.describe()}: {e.msg}")

    def close(self):
        if self.client is not None:
            self.client.close()
            self.client = None
