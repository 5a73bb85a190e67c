"""config.pbtxt fields shmserve does not implement are never accepted in silence: the
ones that would change results are refused by name, the others warned about by name."""
from __future__ import annotations

import logging

import pytest
from helpers import IDENTITY_CODE, python_config, write_model

from shmserve.errors import ConfigError
from shmserve.server.repository import load_model


def model(tmp_path, extra: str = "", dims=(-1,)):
    # ensemble scheduling excludes dynamic_batching (one oneof in the schema)
    dynamic = None if "ensemble_scheduling" in extra else "{ }"
    return write_model(tmp_path, "m", python_config("m", "FP32", dims, extra=extra,
                                                    dynamic_batching=dynamic), IDENTITY_CODE)


def test_decoupled_python_models_load(tmp_path):
    """model_transaction_policy decoupled is implemented for python models
    (tests/test_decoupled.py serves them)."""
    (spec,) = load_model(model(tmp_path, "model_transaction_policy { decoupled: true }"))
    assert spec.decoupled


def test_decoupled_is_refused_for_other_backends_naming_it(tmp_path):
    config = python_config("m", "FP32", (-1,), extra="model_transaction_policy { decoupled: true }")
    model_dir = write_model(tmp_path, "m", config.replace('backend: "python"',
                                                          'backend: "onnxruntime"'))
    (model_dir / "1" / "model.onnx").write_bytes(b"")
    with pytest.raises(ConfigError, match="decoupled is implemented by shmserve for python "
                                          "models only; this one is a onnxruntime model"):
        load_model(model_dir)


def test_shape_tensors_are_refused(tmp_path):
    config = python_config("m", "FP32", (4,)).replace(
        "dims: [ 4 ] }", "dims: [ 4 ] is_shape_tensor: true }", 1)
    write_model(tmp_path, "m", config, IDENTITY_CODE)
    with pytest.raises(ConfigError, match="input 'INPUT0' is_shape_tensor"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("extra, named", [
    ("optimization { priority: PRIORITY_MAX }", "optimization priority"),
    ("optimization { input_pinned_memory { enable: true } }", "optimization input_pinned_memory"),
])
def test_fields_that_only_change_timing_are_warned_about(tmp_path, caplog, extra, named):
    with caplog.at_level(logging.WARNING, logger="shmserve.repository"):
        specs = load_model(model(tmp_path, extra))
    assert specs and specs[0].name == "m"
    assert any(named in r.getMessage() and "not implemented" in r.getMessage()
               for r in caplog.records), caplog.text


def test_dynamic_batching_is_implemented_in_full(tmp_path, caplog):
    """Every dynamic_batching field (issue 11) loads without a warning; the scheduling
    itself is tested in test_priorities.py."""
    path = write_model(tmp_path, "m", python_config(
        "m", "FP32", (-1,), dynamic_batching="{ preserve_ordering: true priority_levels: 2 "
        "default_priority_level: 2 preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 5 "
        "priority_queue_policy { key: 1 value { max_queue_size: 3 } } "
        "default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 100 "
        "allow_timeout_override: true max_queue_size: 9 } }"), IDENTITY_CODE)
    with caplog.at_level(logging.WARNING, logger="shmserve.repository"):
        (spec,) = load_model(path)
    assert not caplog.records, caplog.text
    assert spec.preserve_ordering and spec.priority_levels == 2 and spec.queue_delay_on_timeout


def test_an_implemented_config_loads_without_warnings(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="shmserve.repository"):
        load_model(model(tmp_path))
    assert not caplog.records, caplog.text


def test_onnxruntime_optimizations_are_warned_about_for_other_backends(tmp_path, caplog):
    """graph level and execution accelerators are the onnxruntime backend's: a python
    model that sets them hears that they are ignored, by name."""
    extra = ('optimization { graph { level: 1 } execution_accelerators { '
             'cpu_execution_accelerator [ { name: "openvino" } ] } }')
    with caplog.at_level(logging.WARNING, logger="shmserve.repository"):
        load_model(model(tmp_path, extra))
    for named in ("optimization graph", "optimization execution_accelerators"):
        assert any(named in r.getMessage() and "python backend" in r.getMessage()
                   for r in caplog.records), caplog.text
