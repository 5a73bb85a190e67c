"""ONNX Runtime backend (CPU execution provider).

Config parameters (string values, as in Triton's onnxruntime backend):
  intra_op_thread_count  threads per instance (default 1: one worker process per
                         instance already gives parallelism, and the machine is shared)
  inter_op_thread_count  (default 1)
"""
from __future__ import annotations

from ..errors import ConfigError


class Backend:
    def __init__(self, spec):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(spec.parameters.get("intra_op_thread_count", "1"))
        opts.inter_op_num_threads = int(spec.parameters.get("inter_op_thread_count", "1"))
        self.session = ort.InferenceSession(spec.path, sess_options=opts,
                                            providers=["CPUExecutionProvider"])
        model_inputs = {i.name for i in self.session.get_inputs()}
        model_outputs = {o.name for o in self.session.get_outputs()}
        for t in spec.inputs:
            if t.name not in model_inputs:
                raise ConfigError(f"{spec.path}: config input '{t.name}' is not an input of the "
                                  f"ONNX graph (graph inputs: {sorted(model_inputs)})")
        for t in spec.outputs:
            if t.name not in model_outputs:
                raise ConfigError(f"{spec.path}: config output '{t.name}' is not an output of the "
                                  f"ONNX graph (graph outputs: {sorted(model_outputs)})")
        self.output_names = [t.name for t in spec.outputs]

    def execute(self, inputs):
        results = self.session.run(self.output_names, inputs)
        return dict(zip(self.output_names, results))

    def close(self):
        self.session = None
