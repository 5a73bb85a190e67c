"""The model configuration as Triton's python models see it: the JSON text of the
ModelConfig protobuf (args["model_config"]), the config lookups, and ModelConfig, the
object `auto_complete_config` receives and fills with its setters."""
from __future__ import annotations

import json

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from ..model_config import mc

_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def config_dict(cfg: mc.ModelConfig) -> dict:
    """The config as Triton hands it to python models: proto field names, every field
    (defaults too), enums by name, 64-bit integers as numbers (protobuf's JSON writes
    them as strings; Triton turns them back into numbers)."""
    d = json_format.MessageToDict(cfg, preserving_proto_field_name=True,
                                  always_print_fields_with_no_presence=True)
    _int64_as_numbers(cfg.DESCRIPTOR, d)
    return d


def config_json(cfg: mc.ModelConfig) -> str:
    return json.dumps(config_dict(cfg))


def _int64_as_numbers(descriptor, d: dict) -> None:
    for key, value in d.items():
        field = descriptor.fields_by_name.get(key)
        if field is None:
            continue
        sub = field.message_type
        if sub is not None and sub.GetOptions().map_entry:
            value_field = sub.fields_by_name["value"]
            for k, v in value.items():
                if value_field.message_type is not None:
                    _int64_as_numbers(value_field.message_type, v)
                elif value_field.type in _INT64:
                    value[k] = int(v)
        elif sub is not None:
            for item in value if isinstance(value, list) else (value,):
                _int64_as_numbers(sub, item)
        elif field.type in _INT64:
            d[key] = [int(v) for v in value] if isinstance(value, list) else int(value)


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    """The config's input called `name` (model_config: json.loads(args["model_config"]))."""
    return next((t for t in model_config.get("input", ()) if t.get("name") == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    """The config's output called `name` (model_config: json.loads(args["model_config"]))."""
    return next((t for t in model_config.get("output", ()) if t.get("name") == name), None)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class ModelConfig:
    """What `TritonPythonModel.auto_complete_config(auto_complete_model_config)`
    receives: the model's config so far (as_dict()), completed with the setters and
    returned. Only max_batch_size, input, output, dynamic_batching and
    model_transaction_policy are taken back from it, as in Triton."""

    _TENSOR_KEYS = {"name", "data_type", "dims", "optional"}

    def __init__(self, model_config: str | dict):
        self._model_config = json.loads(model_config) if isinstance(model_config, str) \
            else model_config
        for key, default in (("input", []), ("output", []), ("max_batch_size", 0)):
            self._model_config.setdefault(key, default)

    @property
    def _name(self) -> str:
        return self._model_config.get("name", "")

    def as_dict(self) -> dict:
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._model_config.get("max_batch_size", 0))
        if current > max_batch_size:
            raise ValueError(f"model '{self._name}': auto_complete_config sets max_batch_size "
                             f"{max_batch_size}, below the {current} of its config.pbtxt")
        self._model_config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(f"model '{self._name}': auto_complete_config sets "
                                 f"dynamic_batching but the config uses {other}")
        self._model_config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, transaction_policy_dict: dict) -> None:
        unknown = set(transaction_policy_dict) - {"decoupled"}
        if unknown:
            raise ValueError(f"model '{self._name}': model_transaction_policy has no "
                             f"{', '.join(sorted(unknown))} (only 'decoupled')")
        current = self._model_config.get("model_transaction_policy")
        if current is not None and current.get("decoupled", False) != \
                transaction_policy_dict.get("decoupled", False):
            raise ValueError(f"model '{self._name}': auto_complete_config sets "
                             f"model_transaction_policy {transaction_policy_dict} but the config "
                             f"says {current}")
        self._model_config["model_transaction_policy"] = dict(transaction_policy_dict)

    def add_input(self, input: dict) -> None:  # noqa: A002 - Triton's parameter name
        self._add("input", input)

    def add_output(self, output: dict) -> None:
        self._add("output", output)

    def _add(self, kind: str, tensor: dict) -> None:
        if not isinstance(tensor, dict) or "name" not in tensor:
            raise ValueError(f"model '{self._name}': auto_complete_config add_{kind}() takes a "
                             f"dict with 'name', 'data_type' and 'dims', got {tensor!r}")
        name = tensor["name"]
        extra = set(tensor) - self._TENSOR_KEYS
        if extra:
            raise ValueError(f"model '{self._name}': auto_complete_config {kind} '{name}' has "
                             f"{', '.join(sorted(extra))}; only name, data_type, dims and "
                             "optional can be set")
        for key in ("data_type", "dims"):
            if key not in tensor:
                raise ValueError(f"model '{self._name}': auto_complete_config {kind} '{name}' "
                                 f"has no '{key}'")
        dtype, dims = tensor["data_type"], [int(d) for d in tensor["dims"]]
        if dtype not in mc.DataType.keys() or dtype == "TYPE_INVALID":
            raise ValueError(f"model '{self._name}': auto_complete_config {kind} '{name}' has "
                             f"data_type {dtype!r} (a Triton data type such as 'TYPE_FP32')")
        for current in self._model_config[kind]:
            if current.get("name") != name:
                continue
            have = current.get("data_type", "TYPE_INVALID")
            if have not in ("", "TYPE_INVALID") and have != dtype:
                raise ValueError(f"model '{self._name}': {kind} '{name}' has data_type {have} in "
                                 f"the config but {dtype} in auto_complete_config")
            if current.get("dims") and [int(d) for d in current["dims"]] != dims:
                raise ValueError(f"model '{self._name}': {kind} '{name}' has dims "
                                 f"{current['dims']} in the config but {dims} in "
                                 "auto_complete_config")
            current["data_type"], current["dims"] = dtype, dims
            if "optional" in tensor:
                current["optional"] = bool(tensor["optional"])
            return
        self._model_config[kind].append({**tensor, "dims": dims})


# the fields auto_complete_config may change (Triton takes back these only)
AUTO_COMPLETE_FIELDS = ("max_batch_size", "input", "output", "dynamic_batching",
                        "model_transaction_policy")


def apply_auto_complete(cfg: mc.ModelConfig, completed: dict, where: str) -> None:
    """Copies the fields auto_complete_config may set from `completed` (a ModelConfig's
    dict) into cfg. Raises ValueError naming the field that does not parse."""
    for key in AUTO_COMPLETE_FIELDS:
        if key not in completed:
            continue
        part = mc.ModelConfig()
        try:
            json_format.ParseDict({key: completed[key]}, part)
        except json_format.ParseError as e:
            raise ValueError(f"{where}: auto_complete_config left {key} that does not parse: "
                             f"{e}") from None
        cfg.ClearField(key)
        cfg.MergeFrom(part)
