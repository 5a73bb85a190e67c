"""What a caller gets back: outputs by name, as views of its shared arena."""
from __future__ import annotations

import collections.abc

import numpy as np


class InferResult(collections.abc.Mapping):
    """Outputs by name. Arrays are views of the caller's arena: they stay valid as long
    as any of them (or this object) is referenced, or until release()."""

    def __init__(self, arrays: dict, timestamps: tuple, model: str, version: int, blocks: list):
        self._arrays = arrays
        self.timestamps_ns = timestamps  # see protocol.Timestamp
        self.model_name = model
        self.model_version = version
        self._blocks = blocks  # the ArenaBlocks the arrays are views of

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def as_numpy(self, name: str) -> np.ndarray | None:
        """tritonclient-style accessor."""
        return self._arrays.get(name)

    def release(self) -> None:
        """Returns the output memory to the arena now. Arrays taken from this result
        must not be used afterwards."""
        for block in self._blocks:
            block.release()
        self._blocks = []
        self._arrays = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self._arrays.items())
        return f"InferResult({self.model_name}, {{{inner}}})"


class StreamResponse(InferResult):
    """One response of a stream (Client.infer_stream): its outputs (private copies),
    `index` (0, 1, ...), `final` (the model sent it with the final flag) and `error`
    (the error response the model sent, a ShmServeError, or None: reading an output of
    an error response raises it)."""

    def __init__(self, arrays: dict, timestamps: tuple, model: str, version: int,
                 index: int, final: bool, error: Exception | None = None):
        super().__init__(arrays, timestamps, model, version, [])
        self.index, self.final, self.error = index, final, error

    def __getitem__(self, name: str) -> np.ndarray:
        if self.error is not None:
            raise self.error
        return self._arrays[name]

    def __repr__(self) -> str:
        if self.error is not None:
            return f"StreamResponse({self.model_name} #{self.index}, error={self.error!r})"
        inner = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self._arrays.items())
        return (f"StreamResponse({self.model_name} #{self.index}"
                f"{' final' if self.final else ''}, {{{inner}}})")
