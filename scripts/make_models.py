#!/usr/bin/env python3
"""Writes the generated model files of a model repository (nothing is downloaded).

    python scripts/make_models.py [REPOSITORY]     (default: model_repository/)

mlp/1/model.onnx: INPUT0[B,256] -> MatMul 256x1024 -> Relu -> MatMul 1024x1024 -> Relu
-> MatMul 1024x16 -> OUTPUT0[B,16]; He-scaled normal weights from numpy's
default_rng(0), so every run writes the same bytes (the same shape and weights as
the Triton peer kit's MLP, so their outputs can be compared).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np


def mlp_weights(d_in: int = 256, d_hidden: int = 1024, d_out: int = 16) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = [(d_in, d_hidden), (d_hidden, d_hidden), (d_hidden, d_out)]
    gains = [2.0 / d_in, 2.0 / d_hidden, 1.0 / d_hidden]
    return [(rng.standard_normal(s) * np.sqrt(g)).astype(np.float32) for s, g in zip(shapes, gains)]


def write_mlp(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = mlp_weights()
    names = ["W1", "W2", "W3"]
    nodes = [
        helper.make_node("MatMul", ["INPUT0", "W1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["a1"]),
        helper.make_node("MatMul", ["a1", "W2"], ["h2"]),
        helper.make_node("Relu", ["h2"], ["a2"]),
        helper.make_node("MatMul", ["a2", "W3"], ["OUTPUT0"]),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", w[0].shape[0]])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", w[2].shape[1]])],
        initializer=[numpy_helper.from_array(a, n) for a, n in zip(w, names)])
    model = helper.make_model(graph, producer_name="shmserve",
                              opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    repo = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent / "model_repository")
    target = repo / "mlp" / "1" / "model.onnx"
    write_mlp(target)
    print(f"wrote {target} ({target.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
