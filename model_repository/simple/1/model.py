"""simple: sum and difference of two INT32 [16] tensors."""


class TritonPythonModel:
    def execute(self, inputs):
        a, b = inputs["INPUT0"], inputs["INPUT1"]
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}
