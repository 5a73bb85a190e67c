"""Triton's classification extension, for both fronts: an output asked for with
`classification: k` (HTTP output parameter, gRPC InferRequestedOutput parameter,
tritonclient's class_count) is answered as BYTES: the k highest values of each batch
item (of the whole tensor for a model without batching), largest first, each as
"value:index" or, when the output names a label_filename, "value:index:label".
The shape is [batch, k] ([k] without batching), k at most the values a row holds.
"""
from __future__ import annotations

import collections.abc

import numpy as np

from .codec import BadRequest

def _value_text(x, kind: str) -> str:
    # Triton writes the value with std::to_string: six decimals for floats
    return f"{float(x):f}" if kind == "f" else str(int(x))


def classify(arr: np.ndarray, datatype: str, k: int, batched: bool, labels: list[str],
             name: str) -> np.ndarray:
    """The top-k classes of `arr` (an output of the model) as a BYTES array."""
    if datatype in ("BYTES", "BOOL"):
        raise BadRequest(f"output '{name}': class result not available for output due to "
                         f"unsupported type '{datatype}'")
    rows = arr.reshape(arr.shape[0] if batched and arr.ndim else 1, -1)
    kind = "f" if datatype.startswith("FP") or datatype == "BF16" else "i"
    keys = rows.astype(np.float64)  # one order for every numeric type (FP16, BF16 too)
    k = min(k, rows.shape[1])
    out = np.empty((rows.shape[0], k), dtype=object)
    for r, row in enumerate(rows):
        # largest first; equal values by index, as a stable sort keeps them
        for j, i in enumerate(np.argsort(-keys[r], kind="stable")[:k]):
            text = f"{_value_text(row[i], kind)}:{i}"
            if i < len(labels):
                text += f":{labels[i]}"
            out[r, j] = text.encode()
    return out if batched and arr.ndim else out.reshape(k)


class Labels:
    """The labels of every model version a front classified for, by the version's
    handle (a reload gives a new handle, so a reloaded model's labels are fetched
    again)."""

    def __init__(self):
        self.by_handle: dict[int, dict] = {}

    async def of(self, meta: dict, control, client) -> dict:
        """{output: labels} of the plan's model version; control(fn, *args): the
        front's bounded control call."""
        labels = self.by_handle.get(meta["id"])
        if labels is None:
            reply = await control(client.labels, meta["name"], meta["version"])
            if len(self.by_handle) > 1024:  # mostly handles of unloaded versions
                self.by_handle.clear()
            labels = self.by_handle[reply.id] = reply.labels
        return labels


class Classified(collections.abc.Mapping):
    """An inference result whose classified outputs are their classes (BYTES)."""

    def __init__(self, result, classes: dict):
        self.result, self.classes = result, classes
        self.model_name, self.model_version = result.model_name, result.model_version

    def __getitem__(self, name: str):
        return self.classes[name] if name in self.classes else self.result[name]

    def __iter__(self):
        return iter(self.result)

    def __len__(self) -> int:
        return len(self.result)


async def classified(result, counts: dict, meta: dict, datatypes: dict, labels) -> Classified:
    """The result with each output in counts ({name: k}) replaced by its top k classes;
    datatypes ({name: datatype}, the model's) is updated to BYTES for them. labels:
    an awaitable of {output: labels} (Labels.of)."""
    batched = meta["max_batch_size"] > 0
    known = await labels
    classes = {}
    for name, k in counts.items():
        if name in result:
            classes[name] = classify(result[name], datatypes[name], k, batched,
                                     known.get(name, []), name)
            datatypes[name] = "BYTES"
    return Classified(result, classes)
