"""Triton's python model API (issue 10): a repository written exactly as Triton's
python_backend docs write one serves unchanged.

One server (module scope) holds every model of this file: add_sub as the docs write
it, unbatched and with dynamic batching; models that show requests arriving as a list
of views of the callers' shared memory, per-request errors, initialize's args,
requested outputs, parameters, the Logger, auto_complete_config, BLS (sync, async,
errors) and the parts of the API shmserve does not implement. The pb_utils objects
are also checked in-process (Tensor, DLPack, ModelConfig, the config JSON)."""
from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

import shmserve
from helpers import module_server, wait_in_flight, wait_until, write_model
from shmserve import pb_utils
from shmserve.errors import ConfigError
from shmserve.pb_utils.config import config_dict
from shmserve.protocol import SlotState
from shmserve.server.repository import load_model

pytestmark = pytest.mark.timeout(180)

# ---------------------------------------------------------------- the repository
# Triton's python_backend examples/add_sub, as its README has users copy it.
ADD_SUB_CONFIG = '''name: "add_sub"
backend: "python"

input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
input [
  {
    name: "INPUT1"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
output [
  {
    name: "OUTPUT1"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]

instance_group [{ kind: KIND_CPU }]
'''

ADD_SUB_CODE = '''import json

# triton_python_backend_utils is available in every Triton Python model. You
# need to use this module to create inference requests and responses.
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])

    def execute(self, requests):
        output0_dtype = self.output0_dtype
        output1_dtype = self.output1_dtype
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            out_0, out_1 = (
                in_0.as_numpy() + in_1.as_numpy(),
                in_0.as_numpy() - in_1.as_numpy(),
            )
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(output1_dtype))
            inference_response = pb_utils.InferenceResponse(
                output_tensors=[out_tensor_0, out_tensor_1]
            )
            responses.append(inference_response)
        return responses

    def finalize(self):
        print("Cleaning up...")
'''

# The same model with dynamic batching: a batch of 4 once 4 requests wait.
ADD_SUB_BATCHED_CONFIG = ADD_SUB_CONFIG.replace('name: "add_sub"', 'name: "add_sub_batched"') \
    .replace('backend: "python"', 'backend: "python"\nmax_batch_size: 8\n'
             'dynamic_batching { preferred_batch_size: [ 4 ] '
             'max_queue_delay_microseconds: 10000000 }')

# auto_complete_config as Triton's docs write it; the directory has no config.pbtxt.
AUTO_CODE = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        inputs = [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
                  {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]}]
        outputs = [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]},
                   {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [4]}]
        config = auto_complete_model_config.as_dict()
        input_names = [i["name"] for i in config["input"]]
        output_names = [o["name"] for o in config["output"]]
        for input in inputs:
            if input["name"] not in input_names:
                auto_complete_model_config.add_input(input)
        for output in outputs:
            if output["name"] not in output_names:
                auto_complete_model_config.add_output(output)
        auto_complete_model_config.set_max_batch_size(8)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
'''

# initialize's args, request parameters and requested outputs, answered as BYTES; logs.
INTROSPECT_CONFIG = '''name: "introspect"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "ARGS" data_type: TYPE_STRING dims: [ 1 ] },
         { name: "PARAMS" data_type: TYPE_STRING dims: [ 1 ] },
         { name: "REQUESTED" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
parameters { key: "greeting" value { string_value: "hello" } }
'''

INTROSPECT_CODE = '''import json

import numpy as np
import triton_python_backend_utils as pb_utils


def as_bytes(value):
    return np.array([[value.encode()]], dtype=np.object_)


class TritonPythonModel:
    def initialize(self, args):
        self.args = dict(args)
        pb_utils.Logger.log_info(f"introspect initialized as {args['model_instance_name']}")

    def execute(self, requests):
        pb_utils.Logger.log_warn("introspect warns")
        pb_utils.Logger.log_error("introspect errs")
        pb_utils.Logger.log_verbose("introspect verbose")
        pb_utils.Logger.log("introspect logs at level", pb_utils.Logger.INFO)
        responses = []
        for request in requests:
            outputs = {"ARGS": json.dumps(self.args), "PARAMS": request.parameters(),
                       "REQUESTED": json.dumps(list(request.requested_output_names()))}
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor(name, as_bytes(value)) for name, value in outputs.items()
                 if name in request.requested_output_names()]))
        return responses
'''

# Requests of one batch, each answered alone: an error response, a wrong output, success.
PICKY_CONFIG = '''name: "picky"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
dynamic_batching { preferred_batch_size: [ 3 ] max_queue_delay_microseconds: 10000000 }
'''

PICKY_CODE = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if (x == 9999).any():
                raise ValueError("poison in the batch")
            if (x == 3333).any():
                return responses  # fewer responses than requests
            if (x < 0).any():
                error = pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
            elif (x == 5555).any():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("5555 refused")))
            elif (x == 7777).any():
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x.astype(np.float64))]))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * 2)]))
        return responses
'''

# Sleeps INPUT0[0, 0] seconds of the first request, *then* reads every request's input:
# a caller that changes its arena input while the batch runs sees the change (views).
VIEWS_CONFIG = '''name: "views"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 10000000 }
'''

VIEWS_CODE = '''import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        tensors = [pb_utils.get_input_tensor_by_name(r, "INPUT0") for r in requests]
        time.sleep(float(tensors[0].as_numpy()[0, 0]))
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", t.as_numpy().copy())])
                for t in tensors]
'''

# BLS as Triton's examples/bls write it: sync, and async with two requests in flight.
BLS_CONFIG = ADD_SUB_CONFIG.replace('name: "add_sub"', 'name: "{name}"')

BLS_SYNC_CODE = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            infer_request = pb_utils.InferenceRequest(
                model_name="add_sub",
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[in_0, in_1])
            infer_response = infer_request.exec()
            if infer_response.has_error():
                raise pb_utils.TritonModelException(infer_response.error().message())
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.get_output_tensor_by_name(infer_response, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(infer_response, "OUTPUT1")]))
        return responses
'''

BLS_ASYNC_CODE = '''import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            inputs = [pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                      pb_utils.get_input_tensor_by_name(request, "INPUT1")]
            awaits = [pb_utils.InferenceRequest(model_name="add_sub", inputs=inputs,
                                                requested_output_names=[name]).async_exec()
                      for name in ("OUTPUT0", "OUTPUT1")]
            sums, differences = await asyncio.gather(*awaits)
            for response in (sums, differences):
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
            # each answer holds only the output it asked for
            assert pb_utils.get_output_tensor_by_name(sums, "OUTPUT1") is None
            responses.append(pb_utils.InferenceResponse([
                pb_utils.get_output_tensor_by_name(sums, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(differences, "OUTPUT1")]))
        return responses
'''

# BLS requests that fail: each error is answered back as text, never raised.
BLS_ERRORS_CONFIG = '''name: "bls_errors"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "UNKNOWN" data_type: TYPE_STRING dims: [ 1 ] },
         { name: "SELF" data_type: TYPE_STRING dims: [ 1 ] },
         { name: "TIMEOUT" data_type: TYPE_STRING dims: [ 1 ] } ]
'''

BLS_ERRORS_CODE = '''import numpy as np
import triton_python_backend_utils as pb_utils


def outcome(response):
    if not response.has_error():
        return np.array(["ok"], dtype=np.object_)
    error = response.error()
    return np.array([f"{error.code()}|{error.message()}"], dtype=np.object_)


class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "INPUT0")
        unknown = pb_utils.InferenceRequest(model_name="no_such_model", inputs=[x],
                                            requested_output_names=["OUTPUT0"]).exec()
        myself = pb_utils.InferenceRequest(model_name="bls_errors", inputs=[x],
                                           requested_output_names=["SELF"]).exec()
        slow = pb_utils.InferenceRequest(model_name="slowpoke", inputs=[x],
                                         requested_output_names=["OUTPUT0"],
                                         timeout=50_000).exec()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("UNKNOWN", outcome(unknown)),
                                            pb_utils.Tensor("SELF", outcome(myself)),
                                            pb_utils.Tensor("TIMEOUT", outcome(slow))])]
'''

SLOWPOKE_CODE = '''import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(1.0)
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests]
'''

UNSUPPORTED_EXEC_CODE = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
        return []
'''

UNSUPPORTED_INIT_CODE = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        pb_utils.load_model(model_name="add_sub")

    def execute(self, requests):
        return []
'''

# A numpy-dict model that uses pb_utils only for its Logger: the parameter keeps its API.
NUMPY_LOGGER_CODE = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, inputs):
        pb_utils.Logger.log_info(f"numpy_logger got a batch of {len(inputs['INPUT0'])}")
        return {"OUTPUT0": inputs["INPUT0"] * 3}
'''

NUMPY_LOGGER_CONFIG = '''name: "numpy_logger"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
parameters { key: "shmserve.python_api" value { string_value: "numpy" } }
'''

UNARY_CONFIG = '''name: "{name}"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
'''


SIBLING_CODE = '''
import sibling_helpers  # a file next to model.py, as Triton's python stub allows
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", sibling_helpers.triple(pb_utils.get_input_tensor_by_name(
                r, "INPUT0").as_numpy()))]) for r in requests]
'''


def write_repository(repo) -> None:
    write_model(repo, "add_sub", ADD_SUB_CONFIG, ADD_SUB_CODE)
    write_model(repo, "add_sub_batched", ADD_SUB_BATCHED_CONFIG, ADD_SUB_CODE)
    (repo / "auto" / "1").mkdir(parents=True)
    (repo / "auto" / "1" / "model.py").write_text(AUTO_CODE)  # and no config.pbtxt
    write_model(repo, "introspect", INTROSPECT_CONFIG, INTROSPECT_CODE)
    write_model(repo, "picky", PICKY_CONFIG, PICKY_CODE)
    # no queue delay: a lone request is a batch of one (the worker's C path)
    write_model(repo, "picky_one", PICKY_CONFIG.replace('"picky"', '"picky_one"').replace(
        "preferred_batch_size: [ 3 ] max_queue_delay_microseconds: 10000000", ""), PICKY_CODE)
    write_model(repo, "views", VIEWS_CONFIG, VIEWS_CODE)
    write_model(repo, "bls_sync", BLS_CONFIG.replace("{name}", "bls_sync"), BLS_SYNC_CODE)
    write_model(repo, "bls_async", BLS_CONFIG.replace("{name}", "bls_async"), BLS_ASYNC_CODE)
    write_model(repo, "bls_errors", BLS_ERRORS_CONFIG, BLS_ERRORS_CODE)
    write_model(repo, "slowpoke", UNARY_CONFIG.replace("{name}", "slowpoke"), SLOWPOKE_CODE)
    write_model(repo, "unsupported_exec", UNARY_CONFIG.replace("{name}", "unsupported_exec"),
                UNSUPPORTED_EXEC_CODE)
    write_model(repo, "unsupported_init", UNARY_CONFIG.replace("{name}", "unsupported_init"),
                UNSUPPORTED_INIT_CODE)
    write_model(repo, "numpy_logger", NUMPY_LOGGER_CONFIG, NUMPY_LOGGER_CODE)
    write_model(repo, "sibling", UNARY_CONFIG.replace("{name}", "sibling"), SIBLING_CODE)
    (repo / "sibling" / "1" / "sibling_helpers.py").write_text(
        "def triple(x):\n    return 3 * x\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, write_repository, "pb")


@pytest.fixture
def client(server):
    c = server.client(arena_bytes=4 << 20)
    yield c
    c.close()


def add_sub_inputs(rng, rows=None):
    shape = (4,) if rows is None else (rows, 4)
    return (rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32))


def batch_sizes(client, model: str) -> set[int]:
    [stats] = client.statistics(model)
    return {b["batch_size"] for b in stats["batch_stats"]}


def text(result, name: str) -> str:
    value = result[name].reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------- add_sub, as Triton's docs
def test_add_sub_unbatched_serves_unchanged(client):
    rng = np.random.default_rng(0)
    for _ in range(5):
        a, b = add_sub_inputs(rng)
        out = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})
        np.testing.assert_array_equal(out["OUTPUT0"], a + b)
        np.testing.assert_array_equal(out["OUTPUT1"], a - b)


def test_add_sub_batched_requests_arrive_as_a_list(server):
    """Four callers at once: one execute() gets the four requests as a list, and each
    caller gets exactly its own answer."""
    callers = [server.client(arena_bytes=1 << 20) for _ in range(4)]
    rng = np.random.default_rng(1)
    data = [add_sub_inputs(rng, rows=1) for _ in callers]
    results, errors = [None] * 4, []

    def call(i):
        try:
            a, b = data[i]
            results[i] = callers[i].infer("add_sub_batched", {"INPUT0": a, "INPUT1": b},
                                          copy=True, timeout=30)
        except Exception as e:  # reported below
            errors.append(f"caller {i}: {e!r}")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for (a, b), out in zip(data, results):
        np.testing.assert_array_equal(out["OUTPUT0"], a + b)
        np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    assert 4 in batch_sizes(callers[0], "add_sub_batched"), "the four requests were not one batch"


def test_inputs_are_views_of_the_callers_shared_memory(client, server):
    """The model reads its inputs after sleeping; the callers change their arena arrays
    while the batch runs: the model sees the change, so nothing was copied or gathered."""
    x, y = client.empty((1, 1), np.float32), client.empty((1, 1), np.float32)
    x[0, 0], y[0, 0] = 2.5, 2.0  # x's value: how long the model sleeps
    fx, fy = client.submit("views", {"INPUT0": x}), client.submit("views", {"INPUT0": y})
    wait_in_flight(server, client, SlotState.RUNNING, SlotState.RUNNING)
    x[0, 0], y[0, 0] = 10.0, 20.0
    assert fx.result(30)["OUTPUT0"][0, 0] == 10.0
    assert fy.result(30)["OUTPUT0"][0, 0] == 20.0
    assert 2 in batch_sizes(client, "views")


# ---------------------------------------------------------------- per-request answers
def test_each_request_of_a_batch_gets_its_own_answer_or_error(client):
    good = np.array([[1.0, 2.0]], np.float32)
    futures = [client.submit("picky", {"INPUT0": x}) for x in
               (good, np.array([[-1.0, 0.0]], np.float32), np.array([[7777.0, 0.0]], np.float32))]
    np.testing.assert_array_equal(futures[0].result(30)["OUTPUT0"], good * 2)
    with pytest.raises(shmserve.InvalidArgumentError, match="^negative input$"):
        futures[1].result(30)
    with pytest.raises(shmserve.InternalError, match="model 'picky' output 'OUTPUT0' is float64, "
                                                     "config says float32"):
        futures[2].result(30)
    assert 3 in batch_sizes(client, "picky")

    futures = [client.submit("picky", {"INPUT0": x}) for x in
               (np.array([[5555.0, 0.0]], np.float32), good, good + 1)]
    with pytest.raises(shmserve.InternalError, match="^5555 refused$"):
        futures[0].result(30)
    np.testing.assert_array_equal(futures[2].result(30)["OUTPUT0"], (good + 1) * 2)


def test_a_lone_request_gets_its_answer_or_error(client):
    """A batch of one request asking for every output, without parameters, takes the
    worker's C path: the same answers and errors as in a batch of several."""
    good = np.array([[1.0, 2.0]], np.float32)
    np.testing.assert_array_equal(client.infer("picky_one", {"INPUT0": good})["OUTPUT0"], good * 2)
    with pytest.raises(shmserve.InvalidArgumentError, match="^negative input$"):
        client.infer("picky_one", {"INPUT0": -good})
    with pytest.raises(shmserve.InternalError, match="^5555 refused$"):
        client.infer("picky_one", {"INPUT0": good * 0 + 5555})
    with pytest.raises(shmserve.InternalError, match="model 'picky_one' output 'OUTPUT0' is "
                                                     "float64, config says float32"):
        client.infer("picky_one", {"INPUT0": good * 0 + 7777})
    with pytest.raises(shmserve.InternalError,
                       match="model 'picky_one' raised ValueError: poison in the batch"):
        client.infer("picky_one", {"INPUT0": good * 0 + 9999})
    with pytest.raises(shmserve.InternalError,
                       match=r"model 'picky_one': execute\(\) returned 0 responses for 1 requests"):
        client.infer("picky_one", {"INPUT0": good * 0 + 3333})
    out = client.infer("picky_one", {"INPUT0": good + 1}, parameters={"p": 1})  # the Python path
    np.testing.assert_array_equal(out["OUTPUT0"], (good + 1) * 2)
    assert set(batch_sizes(client, "picky_one")) == {1}


def test_a_model_that_raises_fails_its_whole_batch(client):
    """As in Triton: an exception from execute(), or a list of responses that does not
    match the requests, answers every request of the batch."""
    futures = [client.submit("picky", {"INPUT0": np.array([[v, 0.0]], np.float32)})
               for v in (1.0, 9999.0, 2.0)]
    for f in futures:
        with pytest.raises(shmserve.InternalError,
                           match="model 'picky' raised ValueError: poison in the batch"):
            f.result(30)
    futures = [client.submit("picky", {"INPUT0": np.array([[v, 0.0]], np.float32)})
               for v in (1.0, 3333.0, 2.0)]
    for f in futures:
        with pytest.raises(shmserve.InternalError,
                           match=r"model 'picky': execute\(\) returned 1 responses for 3 requests"):
            f.result(30)


# ---------------------------------------------------------------- initialize, requests, logs
def test_initialize_args_as_triton_gives_them(client, server):
    out = client.infer("introspect", {"INPUT0": np.zeros((1, 1), np.float32)})
    args = json.loads(text(out, "ARGS"))
    assert set(args) >= {"model_config", "model_instance_kind", "model_instance_name",
                         "model_instance_device_id", "model_repository", "model_version",
                         "model_name"}
    assert all(isinstance(v, str) for k, v in args.items() if k != "parameters")
    assert args["model_name"] == "introspect" and args["model_version"] == "1"
    assert args["model_instance_kind"] == "CPU" and args["model_instance_device_id"] == "0"
    assert args["model_instance_name"] in ("introspect_0_0", "introspect_0_1")
    assert args["model_repository"] == str(server.repo / "introspect")
    config = json.loads(args["model_config"])
    assert config["name"] == "introspect" and config["backend"] == "python"
    assert config["max_batch_size"] == 4
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == \
        [("INPUT0", "TYPE_FP32", [1])]
    assert [t["name"] for t in config["output"]] == ["ARGS", "PARAMS", "REQUESTED"]
    assert pb_utils.get_input_config_by_name(config, "INPUT0")["dims"] == [1]
    assert pb_utils.get_output_config_by_name(config, "NOPE") is None
    assert config["parameters"] == {"greeting": {"string_value": "hello"}}
    assert config["instance_group"][0]["count"] == 2
    assert config["instance_group"][0]["kind"] == "KIND_CPU"


def test_requested_output_names_and_parameters(client):
    x = np.zeros((1, 1), np.float32)
    out = client.infer("introspect", {"INPUT0": x}, outputs=["REQUESTED", "PARAMS"])
    assert set(out) == {"REQUESTED", "PARAMS"}  # ARGS was not asked for, nor made
    assert sorted(json.loads(text(out, "REQUESTED"))) == ["PARAMS", "REQUESTED"]
    assert json.loads(text(out, "PARAMS")) == {}  # a JSON object, as Triton's
    out = client.infer("introspect", {"INPUT0": x})
    assert json.loads(text(out, "REQUESTED")) == ["ARGS", "PARAMS", "REQUESTED"]
    sent = {"greeting": "hi", "n": 3, "on": True, "f": 0.25}  # Client.infer(parameters=...)
    out = client.infer("introspect", {"INPUT0": x}, outputs=["PARAMS"], parameters=sent)
    assert json.loads(text(out, "PARAMS")) == sent


def test_logger_lines_go_to_the_server_log(client, server):
    client.infer("introspect", {"INPUT0": np.zeros((1, 1), np.float32)})
    client.infer("numpy_logger", {"INPUT0": np.ones((2, 3), np.float32)})

    def line(severity: str, code: str, call: str, model: str, text: str) -> str:
        """Triton's line format at the line of model.py that logs, naming the instance."""
        at = next(n for n, src in enumerate(code.splitlines(), 1) if call in src)
        return (rf"(?m)^{severity}\d{{4}} [\d:.]+ \d+ worker/model\.py:{at}\] "
                rf"model '{model}' version 1 instance \d: {text}$")

    expected = [line("I", INTROSPECT_CODE, "log_info", "introspect",
                     "introspect initialized as introspect_0_[01]"),
                line("W", INTROSPECT_CODE, "log_warn", "introspect", "introspect warns"),
                line("E", INTROSPECT_CODE, "log_error", "introspect", "introspect errs"),
                line("I", INTROSPECT_CODE, "Logger.log(", "introspect", "introspect logs at level"),
                line("I", NUMPY_LOGGER_CODE, "log_info", "numpy_logger",
                     "numpy_logger got a batch of 2")]

    def logged():
        log = server.log(tail=1 << 20)
        return all(re.search(pattern, log) for pattern in expected) and log

    log = wait_until(logged, 10, "the model's log lines in the server log",
                     state=lambda: server.log(2000))
    assert "introspect verbose" not in log  # VERBOSE shows with --log-verbose only


def test_numpy_dict_api_kept_by_the_parameter(client):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(client.infer("numpy_logger", {"INPUT0": x})["OUTPUT0"], x * 3)


# ---------------------------------------------------------------- auto_complete_config
def test_auto_complete_config_fills_a_model_without_config(client):
    [meta] = [m for m in client.models() if m["name"] == "auto"]
    assert meta["state"] == "READY", meta
    cfg = text_format.Parse(client.model_config("auto"), mc.ModelConfig())
    assert cfg.backend == "python" and cfg.max_batch_size == 8
    assert cfg.HasField("dynamic_batching")
    assert [(t.name, list(t.dims)) for t in cfg.input] == [("INPUT0", [4]), ("INPUT1", [4])]
    assert [t.name for t in cfg.output] == ["OUTPUT0", "OUTPUT1"]
    a, b = add_sub_inputs(np.random.default_rng(2), rows=3)
    out = client.infer("auto", {"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)


def test_auto_complete_config_errors_name_the_file(tmp_path):
    def refused(name, body, pattern):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.py").write_text(
            "import triton_python_backend_utils as pb_utils\n\n"
            "class TritonPythonModel:\n"
            "    @staticmethod\n"
            "    def auto_complete_config(auto_complete_model_config):\n" + body)
        with pytest.raises(ConfigError) as e:
            load_model(tmp_path / name)
        assert re.search(pattern, e.value.msg), e.value.msg

    refused("raises", "        raise RuntimeError('no weights here')\n",
            r"raises/1/model\.py auto_complete_config failed: RuntimeError: no weights here")
    refused("returns_none", "        auto_complete_model_config.set_max_batch_size(2)\n",
            r"returns_none/1/model\.py auto_complete_config failed: TypeError: "
            r"auto_complete_config must return the pb_utils.ModelConfig")
    refused("bad_type", "        auto_complete_model_config.add_input({'name': 'X', "
            "'data_type': 'FP32', 'dims': [1]})\n        return auto_complete_model_config\n",
            r"input 'X' has data_type 'FP32' \(a Triton data type such as 'TYPE_FP32'\)")
    (tmp_path / "bare" / "1").mkdir(parents=True)
    (tmp_path / "bare" / "1" / "model.py").write_text("class TritonPythonModel:\n    pass\n")
    with pytest.raises(ConfigError, match=r"bare: the model declares no input"):
        load_model(tmp_path / "bare")  # no hook, no config: nothing says what it takes


def test_auto_complete_config_meets_an_existing_config(tmp_path):
    """With a config.pbtxt the hook sees it and completes it; it may not contradict it."""
    config = ('backend: "python"\nmax_batch_size: 4\n'
              'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    [spec] = load_model(write_model(tmp_path, "partial", config, AUTO_CODE))
    assert spec.max_batch_size == 8 and spec.dynamic_batching
    assert [(t.name, t.dims) for t in spec.inputs] == [("INPUT0", (4,)), ("INPUT1", (4,))]
    model_dir = write_model(tmp_path, "smaller", config.replace("max_batch_size: 4",
                                                                "max_batch_size: 16"), AUTO_CODE)
    with pytest.raises(ConfigError, match=r"smaller/config\.pbtxt: .*auto_complete_config "
                                          r"failed: ValueError: model 'smaller': "
                                          r"auto_complete_config sets max_batch_size 8, below "
                                          r"the 16 of its config.pbtxt"):
        load_model(model_dir)
    (tmp_path / "nocfg" / "1").mkdir(parents=True)
    (tmp_path / "nocfg" / "1" / "model.py").write_text(AUTO_CODE)
    with pytest.raises(ConfigError, match=r"nocfg/config\.pbtxt: missing .*auto-complete"):
        load_model(tmp_path / "nocfg", auto_complete=False)  # Triton's --disable-auto-complete-config


# ---------------------------------------------------------------- BLS
@pytest.mark.parametrize("model", ["bls_sync", "bls_async"])
def test_bls_calls_add_sub_through_the_server(client, model):
    rng = np.random.default_rng(3)
    for _ in range(3):
        a, b = add_sub_inputs(rng)
        out = client.infer(model, {"INPUT0": a, "INPUT1": b})
        np.testing.assert_array_equal(out["OUTPUT0"], a + b)
        np.testing.assert_array_equal(out["OUTPUT1"], a - b)


def test_bls_errors_are_returned_not_raised(client):
    out = client.infer("bls_errors", {"INPUT0": np.ones(1, np.float32)}, timeout=60)
    code, message = text(out, "UNKNOWN").split("|", 1)
    assert int(code) == pb_utils.TritonError.NOT_FOUND
    assert "no_such_model" in message
    code, message = text(out, "SELF").split("|", 1)
    assert int(code) == pb_utils.TritonError.UNAVAILABLE
    assert message.startswith("BLS request from model 'bls_errors' to itself: its only "
                              "instance is the one waiting")
    code, message = text(out, "TIMEOUT").split("|", 1)
    assert message.startswith("BLS request from model 'bls_errors' to model 'slowpoke' got "
                              "no answer within 0.05 s")


# ---------------------------------------------------------------- what is not implemented
def test_unimplemented_api_raises_naming_it(client):
    with pytest.raises(shmserve.InternalError,
                       match=r"model 'unsupported_exec' raised TritonModelException: "
                             r"request\.get_response_sender\(\): the model is not decoupled"):
        client.infer("unsupported_exec", {"INPUT0": np.ones(1, np.float32)})
    [meta] = [m for m in client.models() if m["name"] == "unsupported_init"]
    assert meta["state"].startswith("UNAVAILABLE"), meta
    assert "pb_utils.load_model() is not implemented by shmserve" in meta["state"], meta


def test_unimplemented_names_raise_in_process():
    for make in (lambda: pb_utils.MetricFamily("requests", "count", pb_utils.MetricFamily.COUNTER),
                 lambda: pb_utils.unload_model("x"), lambda: pb_utils.PreferredMemory(0),
                 lambda: pb_utils.InferenceRequest(model_name="m", inputs=[],
                                                   requested_output_names=[]).exec(decoupled=True),
                 lambda: pb_utils.InferenceResponse([], parameters={"a": 1})):
        with pytest.raises(pb_utils.NotImplementedByShmserve, match="not implemented by shmserve"):
            make()
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        pb_utils.no_such_thing  # noqa: B018


# ---------------------------------------------------------------- pb_utils in-process
def test_tensor_numpy_and_dlpack():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = pb_utils.Tensor("X", x)
    assert t.name() == "X" and t.as_numpy() is x and t.shape() == [2, 3] and t.is_cpu()
    assert t.triton_dtype() == 11  # TYPE_FP32
    back = pb_utils.Tensor.from_dlpack("Y", t.to_dlpack())  # a bare capsule, as Triton takes
    assert back.name() == "Y" and np.shares_memory(back.as_numpy(), x)
    np.testing.assert_array_equal(np.from_dlpack(t), x)  # __dlpack__: Tensor is an array API object
    assert np.shares_memory(pb_utils.Tensor.from_dlpack("Z", x).as_numpy(), x)
    strings = pb_utils.Tensor("S", np.array([b"a", "b"], dtype=np.object_))
    assert strings.triton_dtype() == 13
    with pytest.raises(pb_utils.TritonModelException, match="'S'.to_dlpack"):
        strings.to_dlpack()
    with pytest.raises(pb_utils.TritonModelException, match="use np.object_"):
        pb_utils.Tensor("U", np.array(["text"]))


def test_bytes_helpers_and_types():
    arr = np.array([b"ab", b"", "\u00e9".encode()], dtype=np.object_)
    encoded = pb_utils.serialize_byte_tensor(arr)
    assert encoded[:6] == b"\x02\x00\x00\x00ab"
    assert list(pb_utils.deserialize_bytes_tensor(encoded)) == list(arr)
    assert pb_utils.triton_string_to_numpy("TYPE_FP16") is np.float16
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.numpy_to_triton_type(np.int64) == 9
    assert pb_utils.triton_to_numpy_type(8) is np.int32


def test_responses_and_errors():
    t = pb_utils.Tensor("OUT", np.zeros(1))
    response = pb_utils.InferenceResponse(output_tensors=[t])
    assert not response.has_error() and pb_utils.get_output_tensor_by_name(response, "OUT") is t
    error = pb_utils.TritonError("nope", pb_utils.TritonError.NOT_FOUND)
    failed = pb_utils.InferenceResponse(error=error)
    assert failed.has_error() and failed.error().message() == "nope"
    assert failed.error().code() == pb_utils.TritonError.NOT_FOUND
    assert pb_utils.TritonError("x").code() == pb_utils.TritonError.INTERNAL
    with pytest.raises(pb_utils.TritonModelException, match="error must be a pb_utils.TritonError"):
        pb_utils.InferenceResponse(error="text")
    request = pb_utils.InferenceRequest(model_name="m", inputs=[t], requested_output_names=["A"])
    assert pb_utils.get_input_tensor_by_name(request, "OUT") is t
    assert pb_utils.get_input_tensor_by_name(request, "B") is None
    # outside a served model a BLS request is answered with an error, not raised
    answer = request.exec()
    assert answer.has_error() and "only a model served by shmserve" in answer.error().message()


def test_c_types_keep_the_python_api():
    """Tensor, InferenceRequest and InferenceResponse are C types (csrc/pb_types.c):
    arguments by position or keyword, subclasses, references all given back."""
    import sys

    from shmserve.pb_utils.messages import received, response_arrays
    x = np.zeros((1, 3), np.float32)
    t = pb_utils.Tensor(numpy_array=x, name="X")
    assert t.name() == "X" and t.as_numpy() is x
    assert repr(t) == "pb_utils.Tensor('X', float32[1, 3])"
    assert pb_utils.Tensor("L", [1, 2]).as_numpy().dtype == np.int64  # converted, as np.asarray
    for args, kwargs, message in [(("X",), {}, "missing required argument 'numpy_array'"),
                                  (("X", x, 1), {}, "takes at most 2 arguments"),
                                  (("X", x), {"name": "Y"}, "multiple values for argument 'name'"),
                                  (("X", x), {"dims": [1]}, "unexpected keyword argument 'dims'")]:
        with pytest.raises(TypeError, match=message):
            pb_utils.Tensor(*args, **kwargs)
    with pytest.raises(pb_utils.TritonModelException, match="name must be a str, got int"):
        pb_utils.Tensor(3, x)
    with pytest.raises(TypeError):
        pb_utils.Tensor.shape = None  # an immutable type
    assert pb_utils.InferenceResponse((t,)).output_tensors() == [t]  # a tuple becomes a list
    assert pb_utils.InferenceResponse().output_tensors() == []

    class Named(pb_utils.Tensor):
        pass

    named = Named("N", x)
    assert type(named) is Named and named.name() == "N" and named.shape() == [1, 3]
    # a lone request as the worker passes it ({name: array}); a batch's as pairs
    requests = received([({"IN": x}, ("OUT",), {}), ([("IN", x)], ["OUT"], {"p": 1})])
    assert [type(r) for r in requests] == [pb_utils.InferenceRequest] * 2
    assert pb_utils.get_input_tensor_by_name(requests[1], "IN").as_numpy() is x
    assert requests[1].parameters() == '{"p": 1}'
    assert requests[0].requested_output_names() == ["OUT"]

    class Duck:  # any object with inputs(), as Triton's helper accepts
        def inputs(self):
            return [t]

    assert pb_utils.get_input_tensor_by_name(Duck(), "X") is t
    assert pb_utils.get_input_tensor_by_name(Duck(), "Y") is None
    ok = pb_utils.InferenceResponse([t])
    failed = pb_utils.InferenceResponse(error=pb_utils.TritonError("no"))
    assert response_arrays([ok, failed, named, pb_utils.InferenceResponse([named])], 4) == \
        [{"X": x}, None, None, None]  # only an exact Tensor is unpacked, the rest explained
    assert response_arrays([ok], 2) is None and response_arrays({"X": x}, 1) is None
    before = sys.getrefcount(x)
    for _ in range(1000):
        (r,) = received([({"IN": x}, ("OUT",), {})])
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
        assert response_arrays([response], 1) == [{"OUT": x}]
    del r, response
    assert sys.getrefcount(x) == before


def test_config_json_as_triton_writes_it():
    cfg = text_format.Parse('name: "m" max_batch_size: 8 input [ { name: "I" data_type: TYPE_INT64 '
                            'dims: [ -1, 3 ] } ] dynamic_batching { max_queue_delay_microseconds: '
                            '100 } version_policy { specific { versions: [ 1, 3 ] } }',
                            mc.ModelConfig())
    d = config_dict(cfg)
    assert d["input"][0]["dims"] == [-1, 3] and d["input"][0]["data_type"] == "TYPE_INT64"
    assert d["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert d["version_policy"]["specific"]["versions"] == [1, 3]
    assert d["output"] == [] and d["platform"] == ""  # every field, as Triton prints them


def test_model_config_setters():
    config = pb_utils.ModelConfig(json.dumps({"name": "m", "max_batch_size": 0, "input": [
        {"name": "A", "data_type": "TYPE_FP32", "dims": []}], "output": []}))
    config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [2]})  # completes A
    config.add_output({"name": "B", "data_type": "TYPE_INT32", "dims": [1]})
    config.set_max_batch_size(4)
    config.set_dynamic_batching()
    d = config.as_dict()
    assert d["input"] == [{"name": "A", "data_type": "TYPE_FP32", "dims": [2]}]
    assert d["output"] == [{"name": "B", "data_type": "TYPE_INT32", "dims": [1]}]
    assert d["max_batch_size"] == 4 and d["dynamic_batching"] == {}
    with pytest.raises(ValueError, match="input 'A' has data_type TYPE_FP32 in the config but "
                                         "TYPE_INT8"):
        config.add_input({"name": "A", "data_type": "TYPE_INT8", "dims": [2]})
    with pytest.raises(ValueError, match="output 'B' has dims \\[1\\] in the config but \\[5\\]"):
        config.add_output({"name": "B", "data_type": "TYPE_INT32", "dims": [5]})
    with pytest.raises(ValueError, match="has no 'dims'"):
        config.add_input({"name": "C", "data_type": "TYPE_FP32"})
    with pytest.raises(ValueError, match="only name, data_type, dims and optional"):
        config.add_input({"name": "C", "data_type": "TYPE_FP32", "dims": [1], "reshape": {}})


def test_model_imports_a_file_next_to_it(client):
    x = np.array([2.0], np.float32)
    np.testing.assert_array_equal(client.infer("sibling", {"INPUT0": x})["OUTPUT0"], 3 * x)
