"""identity: OUTPUT0 = INPUT0 (the whole batch at once)."""


class TritonPythonModel:
    def execute(self, inputs):
        return {"OUTPUT0": inputs["INPUT0"]}
