"""The pytorch backend: TorchScript (model.pt) and torch.export (model.pt2) models,
made here in the test, give what running them in torch directly gives, batched and
unbatched, with tensors mapped by Triton's naming conventions and its parameters
applied. Skipped, with the reason, where torch is not installed (CI installs it:
the `test` extra pins torch==2.13.0)."""
from __future__ import annotations

import logging
from typing import Dict, List, Optional

import numpy as np
import pytest
from helpers import IDENTITY_CODE, ServerProcess, python_config, write_model

from shmserve.backends import load_backend
from shmserve.errors import ConfigError
from shmserve.server.repository import load_model

torch = pytest.importorskip(
    "torch", reason="torch is not installed (pip install 'shmserve[torch]', torch==2.13.0)")

# TorchScript is what Triton's pytorch backend serves; torch 2.13 calls it deprecated.
pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")]


class AddMul(torch.nn.Module):
    def forward(self, x, y):
        return x + y, x * y


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.fc = torch.nn.Linear(3, 4)

    def forward(self, a):
        return torch.relu(self.fc(a))


class DictInOut(torch.nn.Module):
    def forward(self, d: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {"total": d["a"] + d["b"], "diff": d["a"] - d["b"]}


class MaybeY(torch.nn.Module):
    def forward(self, x, y: Optional[torch.Tensor] = None):
        if y is None:
            return x * 10
        return x + y


class Upper(torch.nn.Module):
    def forward(self, words: List[str]) -> List[str]:
        return [w.upper() for w in words]


class Exported(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x, scale):
        return {"logits": self.fc(x) * scale, "norm": (x * x).sum(dim=1, keepdim=True)}


def tensor(name, dims, dtype="TYPE_FP32", extra=""):
    return f'{{ name: "{name}" data_type: {dtype} dims: [ {", ".join(map(str, dims))} ] {extra} }}'


def torch_model(repo, name, module, inputs, outputs, max_batch_size=8, extra="",
                exported_args=None, dynamic=None):
    """<repo>/<name>: config.pbtxt (platform pytorch_libtorch) and 1/model.pt, or
    1/model.pt2 from torch.export when exported_args are given."""
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True)
    if exported_args is not None:
        program = torch.export.export(module, exported_args, dynamic_shapes=dynamic)
        torch.export.save(program, str(model_dir / "1" / "model.pt2"))
        extra += '\ndefault_model_filename: "model.pt2"'
    else:
        torch.jit.script(module).save(str(model_dir / "1" / "model.pt"))
    (model_dir / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "pytorch_libtorch"\nmax_batch_size: {max_batch_size}\n'
        f'input [ {", ".join(inputs)} ]\noutput [ {", ".join(outputs)} ]\n{extra}\n')
    return model_dir


def backend(model_dir):
    [spec] = load_model(model_dir)
    return load_backend(spec)


def run(module, *args):
    with torch.no_grad():
        return module(*[torch.from_numpy(a) for a in args])


# ---------------------------------------------------------------- in-process: the mapping


def test_inputs_by_forward_argument_names_outputs_by_index(tmp_path):
    """Config inputs named after forward()'s arguments, in any order; outputs
    OUTPUT__<i> by index."""
    b = backend(torch_model(tmp_path, "m", AddMul(), [tensor("y", [3]), tensor("x", [3])],
                            [tensor("OUTPUT__1", [3]), tensor("OUTPUT__0", [3])]))
    x, y = np.random.rand(2, 3).astype(np.float32), np.random.rand(2, 3).astype(np.float32)
    out = b.execute({"x": x, "y": y})
    np.testing.assert_array_equal(out["OUTPUT__0"], x + y)
    np.testing.assert_array_equal(out["OUTPUT__1"], x * y)


def test_inputs_by_named_index(tmp_path):
    b = backend(torch_model(tmp_path, "m", AddMul(), [tensor("B__1", [3]), tensor("A__0", [3])],
                            [tensor("SUM__0", [3]), tensor("PRODUCT__1", [3])]))
    x, y = np.ones((1, 3), np.float32), np.full((1, 3), 2.0, np.float32)
    out = b.execute({"A__0": x, "B__1": y})
    np.testing.assert_array_equal(out["SUM__0"], x + y)
    np.testing.assert_array_equal(out["PRODUCT__1"], x * y)


def test_inputs_in_config_order_otherwise(tmp_path, caplog):
    """Names that follow neither convention: config order, with Triton's warning."""
    with caplog.at_level(logging.WARNING, logger="shmserve.worker"):
        b = backend(torch_model(tmp_path, "m", AddMul(), [tensor("first", [3]),
                                                          tensor("second", [3])],
                                [tensor("s", [3]), tensor("p", [3])]))
    assert "passed in config order" in caplog.text, caplog.text
    x, y = np.full((1, 3), 3.0, np.float32), np.full((1, 3), 5.0, np.float32)
    out = b.execute({"second": y, "first": x})
    np.testing.assert_array_equal(out["s"], x + y)
    np.testing.assert_array_equal(out["p"], x * y)


def test_dict_input_and_dict_output(tmp_path):
    b = backend(torch_model(tmp_path, "m", DictInOut(), [tensor("a", [2]), tensor("b", [2])],
                            [tensor("diff", [2]), tensor("total", [2])]))
    a, c = np.array([[5.0, 1.0]], np.float32), np.array([[2.0, 2.0]], np.float32)
    out = b.execute({"a": a, "b": c})
    np.testing.assert_array_equal(out["total"], a + c)
    np.testing.assert_array_equal(out["diff"], a - c)


def test_an_optional_input_left_out_is_none(tmp_path):
    b = backend(torch_model(tmp_path, "m", MaybeY(),
                            [tensor("x", [2]), tensor("y", [2], extra="optional: true")],
                            [tensor("OUTPUT__0", [2])]))
    x = np.array([[1.0, 2.0]], np.float32)
    np.testing.assert_array_equal(b.execute({"x": x})["OUTPUT__0"], x * 10)
    np.testing.assert_array_equal(b.execute({"x": x, "y": x})["OUTPUT__0"], x + x)


def test_bytes_are_lists_of_strings(tmp_path):
    b = backend(torch_model(tmp_path, "m", Upper(),
                            [tensor("words", [1], "TYPE_STRING", "reshape: { shape: [ ] }")],
                            [tensor("OUTPUT__0", [1], "TYPE_STRING", "reshape: { shape: [ ] }")]))
    words = np.array([b"cat", b"dog"], dtype=object)  # the batch, reshaped to [batch]
    assert b.execute({"words": words})["OUTPUT__0"].tolist() == [b"CAT", b"DOG"]


def test_bytes_of_more_than_one_dimension_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="as List\\[str\\], of one dimension"):
        load_model(torch_model(tmp_path, "m", Upper(), [tensor("words", [2], "TYPE_STRING")],
                               [tensor("OUTPUT__0", [2], "TYPE_STRING")]))


def test_exported_program_by_argument_names(tmp_path):
    """model.pt2 (torch.export) with a dynamic batch dimension; dict outputs by name."""
    module = Exported()
    batch = torch.export.Dim("batch", min=1, max=8)
    b = backend(torch_model(
        tmp_path, "m", module, [tensor("scale", [1]), tensor("x", [4])],
        [tensor("norm", [1]), tensor("logits", [2])],
        exported_args=(torch.ones(2, 4), torch.ones(2, 1)),
        dynamic={"x": {0: batch}, "scale": {0: batch}}))
    x, scale = np.random.rand(5, 4).astype(np.float32), np.random.rand(5, 1).astype(np.float32)
    out = b.execute({"x": x, "scale": scale})
    want = run(module, x, scale)
    np.testing.assert_allclose(out["logits"], want["logits"].numpy(), rtol=1e-6)
    np.testing.assert_allclose(out["norm"], want["norm"].numpy(), rtol=1e-6)


def test_parameters_are_applied(tmp_path):
    params = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in (
        ("INTRA_OP_THREAD_COUNT", "2"), ("INFERENCE_MODE", "false"),
        ("DISABLE_OPTIMIZED_EXECUTION", "true")))
    b = backend(torch_model(tmp_path, "m", Linear(), [tensor("INPUT__0", [3])],
                            [tensor("OUTPUT__0", [4])], extra=params))
    assert torch.get_num_threads() == 2
    assert b.inference_mode is False
    assert torch._C._get_graph_executor_optimize() is False
    torch._C._set_graph_executor_optimize(True)  # this process's default, for later tests


@pytest.mark.parametrize("params, message", [
    ('parameters { key: "INFERENCE_MODE" value: { string_value: "yes please" } }',
     'parameters "INFERENCE_MODE" must be "true" or "false"'),
    ('parameters { key: "INTRA_OP_THREAD_COUNT" value: { string_value: "many" } }',
     'parameters "INTRA_OP_THREAD_COUNT" must be an integer'),
])
def test_bad_parameter_values_are_refused_by_name(tmp_path, params, message):
    with pytest.raises(ConfigError, match=message):
        load_model(torch_model(tmp_path, "m", Linear(), [tensor("INPUT__0", [3])],
                               [tensor("OUTPUT__0", [4])], extra=params))


def test_parameters_without_effect_here_are_warned_about(tmp_path, caplog):
    params = 'parameters { key: "ENABLE_WEIGHT_SHARING" value: { string_value: "true" } }'
    with caplog.at_level(logging.WARNING, logger="shmserve.repository"):
        load_model(torch_model(tmp_path, "m", Linear(), [tensor("INPUT__0", [3])],
                               [tensor("OUTPUT__0", [4])], extra=params))
    assert "ENABLE_WEIGHT_SHARING" in caplog.text and "ignored" in caplog.text


def test_input_count_that_differs_from_forward_is_named(tmp_path):
    with pytest.raises(ConfigError, match="the config has 1 input\\(s\\) \\(x\\), the model's forward\\(\\) "
                                          "takes 2 \\(x, y\\)"):
        backend(torch_model(tmp_path, "m", AddMul(), [tensor("x", [3])], [tensor("o", [3])]))


def test_a_file_torch_cannot_read_is_named(tmp_path):
    model_dir = torch_model(tmp_path, "m", Linear(), [tensor("INPUT__0", [3])],
                            [tensor("OUTPUT__0", [4])])
    (model_dir / "1" / "model.pt").write_bytes(b"not a TorchScript archive")
    with pytest.raises(ConfigError, match="model.pt: torch.jit.load \\(TorchScript\\) failed"):
        backend(model_dir)


# ---------------------------------------------------------------- served


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server with a batching TorchScript model, a non-batching one, an exported
    program and a python identity; the modules, to run the same inputs directly."""
    repo = tmp_path_factory.mktemp("torch_repo")
    modules = {"addmul": AddMul(), "linear": Linear(), "exported": Exported()}
    torch_model(repo, "addmul", modules["addmul"], [tensor("x", [-1]), tensor("y", [-1])],
                [tensor("OUTPUT__0", [-1]), tensor("OUTPUT__1", [-1])],
                extra="dynamic_batching { max_queue_delay_microseconds: 50000 }")
    torch_model(repo, "linear", modules["linear"], [tensor("INPUT__0", [2, 3])],
                [tensor("OUTPUT__0", [2, 4])], max_batch_size=0)
    batch = torch.export.Dim("batch", min=1, max=8)
    torch_model(repo, "exported", modules["exported"], [tensor("x", [4]), tensor("scale", [1])],
                [tensor("logits", [2]), tensor("norm", [1])],
                extra="dynamic_batching { max_queue_delay_microseconds: 50000 }",
                exported_args=(torch.ones(2, 4), torch.ones(2, 1)),
                dynamic={"x": {0: batch}, "scale": {0: batch}})
    write_model(repo, "identity", python_config("identity", dims=(4,)), IDENTITY_CODE)
    server = ServerProcess(repo, log_path=tmp_path_factory.mktemp("logs") / "server.log")
    try:
        server.start(timeout=180)
        yield server, modules
    finally:
        problems = server.teardown()
        assert not problems, "\n".join(problems) + "\n" + server.log()


def test_served_torchscript_equals_torch_batched(served):
    """Concurrent requests of several rows, batched by the server, each answered as
    torch answers its own inputs."""
    server, modules = served
    with server.client() as c:
        assert {m["name"]: m["state"] for m in c.models()}["addmul"] == "READY", server.log()
        rng = np.random.default_rng(1)
        pending = []
        for rows in (1, 2, 3, 1):
            x = rng.random((rows, 5), np.float32)
            y = rng.random((rows, 5), np.float32)
            pending.append((x, y, c.submit("addmul", {"x": x, "y": y})))
        for x, y, f in pending:
            out = f.result(timeout=60)
            s, p = run(modules["addmul"], x, y)
            np.testing.assert_array_equal(out["OUTPUT__0"], s.numpy())
            np.testing.assert_array_equal(out["OUTPUT__1"], p.numpy())
        stats = c.statistics("addmul")
    assert stats, stats


def test_served_torchscript_equals_torch_unbatched(served):
    server, modules = served
    a = np.random.default_rng(2).random((2, 3), np.float32)
    with server.client() as c:
        out = c.infer("linear", {"INPUT__0": a}, timeout=60)
    np.testing.assert_allclose(out["OUTPUT__0"], run(modules["linear"], a).numpy(), rtol=1e-6)


def test_served_exported_program_equals_torch(served):
    server, modules = served
    rng = np.random.default_rng(3)
    with server.client() as c:
        pending = []
        for rows in (1, 4, 2):
            x, scale = rng.random((rows, 4), np.float32), rng.random((rows, 1), np.float32)
            pending.append((x, scale, c.submit("exported", {"x": x, "scale": scale})))
        for x, scale, f in pending:
            out, want = f.result(timeout=60), run(modules["exported"], x, scale)
            np.testing.assert_allclose(out["logits"], want["logits"].numpy(), rtol=1e-6)
            np.testing.assert_allclose(out["norm"], want["norm"].numpy(), rtol=1e-6)
