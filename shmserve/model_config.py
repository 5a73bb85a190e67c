"""Triton's model configuration schema (model_config.proto), as tritonclient ships it.

Loaded straight from its file: `from tritonclient.grpc import model_config_pb2` would
run tritonclient.grpc's package __init__, which imports grpc (a third of a second at
every process start, and grpc's fork handlers in processes that never speak gRPC).
The module is registered under its own name, so that tritonclient.grpc imported later
(the gRPC front, tests) finds and shares it: one descriptor, one set of classes.
"""
from __future__ import annotations

import importlib.util
import os
import sys

_NAME = "tritonclient.grpc.model_config_pb2"


def _load():
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    package = importlib.util.find_spec("tritonclient")  # finds it without importing it
    if package is None or not package.submodule_search_locations:
        raise ImportError("shmserve needs tritonclient (pip install 'tritonclient[grpc]') "
                          "for Triton's model config schema")
    path = os.path.join(package.submodule_search_locations[0], "grpc", "model_config_pb2.py")
    spec = importlib.util.spec_from_file_location(_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_NAME]
        raise
    return module


mc = _load()
