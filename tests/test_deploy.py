"""deploy/: every manifest is valid against its schema, and the manifests agree with
shmserve's own flags.

- Kubernetes kinds (Deployment, Service): kubernetes-validate, strict (no unknown field).
- KServe kinds (ServingRuntime, InferenceService): the schema of the kserve SDK's
  generated models (openapi_types, attribute_map and the fields their setters require),
  read from the package's sources without importing it (the SDK's server dependencies
  pin versions this project does not use); the Kubernetes types they embed (Container,
  Volume, ObjectMeta...) against kubernetes-validate's strict definitions.
- The server container's arguments are parsed by shmserve's CLI parser; its ports,
  probes, metrics annotations and Service agree with the ports the flags give.
- The co-located caller of the plain Deployment runs against a live server, through the
  same runtime directory variable.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
from kubernetes_validate import utils as kv_utils  # noqa: E402

pytestmark = pytest.mark.timeout(120)

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S_VERSION = "1.30"  # the oldest Kubernetes the manifests are meant for
KSERVE_KINDS = {("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
                ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService"}


def manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    docs.append((f"{path.relative_to(DEPLOY)}:{doc['kind']}/"
                                 f"{doc['metadata']['name']}", doc))
    return docs


MANIFESTS = manifests()


def of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in MANIFESTS if doc["kind"] == kind]


def test_every_kind_is_checked():
    kinds = {(doc["apiVersion"], doc["kind"]) for _, doc in MANIFESTS}
    assert kinds == {("apps/v1", "Deployment"), ("v1", "Service"), *KSERVE_KINDS}


# -- schemas -----------------------------------------------------------------------
@pytest.mark.parametrize("doc", [d for _, d in MANIFESTS if d["apiVersion"] in ("v1", "apps/v1")],
                         ids=[n for n, d in MANIFESTS if d["apiVersion"] in ("v1", "apps/v1")])
def test_kubernetes_manifests_are_valid(doc):
    kv.validate(doc, K8S_VERSION, strict=True)


@cache
def k8s_definitions():
    """kubernetes-validate's strict definitions for K8S_VERSION, and a validator of
    one of them by the Kubernetes Python client's class name (V1Container...)."""
    import jsonschema
    from referencing import Registry, Resource

    version = [v for v in kv_utils.all_versions()
               if kv_utils.major_minor(v) <= K8S_VERSION][-1]
    defs = kv_utils.schema_contents(
        f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
    registry = Resource.from_contents(defs) @ Registry()
    by_class = {}
    for key in defs["$defs"]:  # io.k8s.api.core.v1.Container -> V1Container
        parts = key.split(".")
        name = parts[-2].capitalize() + parts[-1]
        if name not in by_class or ".api.core." in key or ".meta." in key:
            by_class[name] = key

    def validator(class_name: str):
        ref = f"{defs['$id']}#/$defs/{by_class[class_name]}"
        return jsonschema.Draft202012Validator({"$ref": ref}, registry=registry)

    return by_class, validator


@cache
def kserve_model(class_name: str) -> tuple[dict, set] | None:
    """{json key: type} and the required json keys of one kserve SDK model, or None when
    the SDK has no such model (a Kubernetes type)."""
    spec = importlib.util.find_spec("kserve")
    if spec is None:
        pytest.skip("the kserve SDK is not installed (scripts/setup.sh installs it --no-deps)")
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", class_name).lower()  # V1beta1ModelSpec
    path = Path(spec.submodule_search_locations[0]) / "models" / f"{snake}.py"
    if not path.exists():
        return None
    source = path.read_text()
    tree = ast.parse(source)
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
                    if stmt.targets[0].id in ("openapi_types", "attribute_map"):
                        found[stmt.targets[0].id] = ast.literal_eval(stmt.value)
    types, keys = found["openapi_types"], found["attribute_map"]
    required = set(re.findall(r"Invalid value for `(\w+)`, must not be `None`", source))
    return {keys[a]: t for a, t in types.items()}, {keys[a] for a in required}


def kserve_problems(value, type_name: str, where: str) -> list[str]:
    """What in `value` does not fit the kserve SDK's type `type_name`."""
    if type_name == "object":
        return []
    m = re.fullmatch(r"list\[(.+)\]", type_name)
    if m:
        if not isinstance(value, list):
            return [f"{where}: a list expected"]
        return [p for i, v in enumerate(value) for p in kserve_problems(v, m[1], f"{where}[{i}]")]
    m = re.fullmatch(r"dict\(str, (.+)\)", type_name)
    if m:
        if not isinstance(value, dict):
            return [f"{where}: a map expected"]
        return [p for k, v in value.items() for p in kserve_problems(v, m[1], f"{where}.{k}")]
    scalars = {"str": str, "int": int, "bool": bool, "float": (int, float)}
    if type_name in scalars:
        ok = isinstance(value, scalars[type_name]) and (
            type_name == "bool" or not isinstance(value, bool))
        return [] if ok else [f"{where}: {type_name} expected, got {value!r}"]
    model = kserve_model(type_name)
    if model is None:  # a Kubernetes type
        by_class, validator = k8s_definitions()
        assert type_name in by_class, f"{where}: no Kubernetes definition for {type_name}"
        return [f"{where}.{'.'.join(map(str, e.path))}: {e.message}"
                for e in validator(type_name).iter_errors(value)]
    fields, required = model
    if not isinstance(value, dict):
        return [f"{where}: an object ({type_name}) expected"]
    problems = [f"{where}: unknown field '{k}' of {type_name}" for k in value if k not in fields]
    problems += [f"{where}: {type_name} requires '{k}'" for k in required if k not in value]
    for k, v in value.items():
        if k in fields:
            problems += kserve_problems(v, fields[k], f"{where}.{k}")
    return problems


@pytest.mark.parametrize("doc", [d for _, d in MANIFESTS if (d["apiVersion"], d["kind"]) in KSERVE_KINDS],
                         ids=[n for n, d in MANIFESTS if (d["apiVersion"], d["kind"]) in KSERVE_KINDS])
def test_kserve_manifests_are_valid(doc):
    assert kserve_problems(doc, KSERVE_KINDS[(doc["apiVersion"], doc["kind"])], doc["kind"]) == []


def test_the_kserve_check_finds_mistakes():
    """The check above refuses what KServe would: an unknown field, a missing required
    one, a wrong type, a bad embedded Kubernetes field."""
    runtime = of_kind("ServingRuntime")[0]
    bad = json.loads(json.dumps(runtime))
    bad["spec"]["protocolVersion"] = ["v2"]  # it is protocolVersions
    del bad["spec"]["containers"]
    bad["spec"]["supportedModelFormats"][0]["autoSelect"] = "yes"
    bad["spec"]["volumes"][0]["emptyDir"]["medium"] = 5
    problems = "\n".join(kserve_problems(bad, "V1alpha1ServingRuntime", "ServingRuntime"))
    assert "unknown field 'protocolVersion'" in problems
    assert "requires 'containers'" in problems
    assert "autoSelect: bool expected" in problems
    assert "volumes[0].emptyDir.medium" in problems


# -- agreement with shmserve's flags --------------------------------------------------
def serve_options(container: dict) -> dict:
    """The container's `shmserve serve` arguments as shmserve's CLI parses them, and the
    ports and addresses they give (cli.http_options / metrics_options)."""
    from shmserve import cli

    argv = container["args"]
    assert container["command"] == ["shmserve"] and argv[0] == "serve", container["name"]
    parsed = {}

    def capture(args):
        parsed["args"] = args
        return 0

    original = cli.cmd_serve
    cli.cmd_serve = capture  # main() looks it up when it builds the parser
    try:
        assert cli.main(argv) == 0
    finally:
        cli.cmd_serve = original
    args = parsed["args"]
    return {"args": args, **cli.http_options(args), **cli.metrics_options(args),
            "grpc_port": getattr(args, "grpc_port", None)}


def _cli_knows(flag: str) -> bool:
    """Whether `shmserve serve` takes `flag` (its --help lists it)."""
    import contextlib
    import io

    from shmserve import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    return flag in out.getvalue()


def server_containers() -> list[tuple[dict, dict]]:
    """(server container, pod-level spec) of every manifest that runs shmserve serve."""
    out = []
    for doc in of_kind("ServingRuntime"):
        out += [(c, doc["spec"]) for c in doc["spec"]["containers"]]
    for doc in of_kind("Deployment"):
        pod = doc["spec"]["template"]["spec"]
        out += [(c, pod) for c in pod["containers"] if c.get("args", [None])[0] == "serve"]
    return out


def _port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


@pytest.mark.parametrize("container,pod", server_containers(),
                         ids=[c["name"] for c, _ in server_containers()])
def test_server_flags_ports_and_probes_agree(container, pod):
    if not _cli_knows("--grpc-port"):  # the gRPC front's flags come with it
        container = {**container, "args": [a for a in container["args"]
                                           if not a.startswith("--grpc-")]}
    o = serve_options(container)
    assert o["http_address"] == "0.0.0.0" and o["metrics_address"] == "0.0.0.0", \
        "probes and remote callers reach the pod's address, not loopback"
    ports = {p["containerPort"] for p in container["ports"]}
    assert o["http_port"] == 8000 and o["metrics_port"] == 8002 and {8000, 8001, 8002} <= ports
    if o["grpc_port"] is not None:
        assert o["grpc_port"] == 8001
    for probe, path in [("livenessProbe", "/v2/health/live"),
                        ("readinessProbe", "/v2/health/ready")]:
        get = container[probe]["httpGet"]
        assert get["path"] == path and _port_number(container, get["port"]) == o["http_port"]
    # Prometheus is told the metrics port the flags give.
    annotations = pod.get("annotations") or {}
    for doc in of_kind("Deployment"):
        if doc["spec"]["template"]["spec"] is pod:
            annotations = doc["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(o["metrics_port"])
    assert annotations["prometheus.io/path"] == "/metrics"
    # /dev/shm (system shared memory regions) and the control socket on memory-backed volumes.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    runtime = next(e["value"] for e in container["env"] if e["name"] == "SHMSERVE_RUNTIME_DIR")
    for path in ("/dev/shm", str(Path(runtime).parent)):
        assert volumes[mounts[path]]["emptyDir"]["medium"] == "Memory", path
    # The runtime directory is made by the server (0700) inside the volume, never the
    # volume's own root (an emptyDir is created world-writable, which shmserve refuses).
    assert Path(runtime).parent != Path(runtime) and runtime not in mounts


def test_kserve_runtime_and_service():
    runtime = of_kind("ServingRuntime")[0]["spec"]
    assert runtime["protocolVersions"] == ["v2", "grpc-v2"]
    assert runtime["containers"][0]["name"] == "kserve-container"
    assert "--model-repository=/mnt/models" in runtime["containers"][0]["args"]
    assert runtime["annotations"]["prometheus.kserve.io/port"] == "8002"
    isvc = of_kind("InferenceService")[0]
    assert isvc["spec"]["predictor"]["model"]["runtime"] == \
        of_kind("ServingRuntime")[0]["metadata"]["name"]
    assert isvc["spec"]["predictor"]["model"]["modelFormat"]["name"] in \
        [f["name"] for f in runtime["supportedModelFormats"]]
    # The plain Service forwards the v2 ports and metrics to the named container ports.
    (service,) = of_kind("Service")
    (deployment,) = of_kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    named = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    assert {p["port"]: named[p["targetPort"]] for p in service["spec"]["ports"]} == \
        {8000: 8000, 8001: 8001, 8002: 8002}
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_colocated_caller_shares_what_the_shm_path_needs():
    (deployment,) = of_kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True  # a caller checks the server's pid
    assert pod["securityContext"]["runAsUser"] == 1000  # one uid: the socket's clients
    server, caller = pod["containers"]
    for c in (server, caller):
        assert c.get("securityContext", {}).get("runAsUser", 1000) == 1000
    mounts = [{(m["name"], m["mountPath"]) for m in c["volumeMounts"]} for c in (server, caller)]
    assert mounts[0] == mounts[1]
    env = [{e["name"]: e["value"] for e in c["env"]} for c in (server, caller)]
    assert env[0]["SHMSERVE_RUNTIME_DIR"] == env[1]["SHMSERVE_RUNTIME_DIR"]


def test_colocated_caller_program_runs_against_a_server(server_factory, tmp_path):
    """The caller container's program, run as it is written in the manifest, with
    SHMSERVE_RUNTIME_DIR naming the test server's runtime directory."""
    (deployment,) = of_kind("Deployment")
    caller = deployment["spec"]["template"]["spec"]["containers"][1]
    assert caller["command"] == ["python", "-c"]
    server = server_factory(models=("identity",), name="default")
    proc = subprocess.Popen([sys.executable, "-c", caller["args"][0]], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "SHMSERVE_RUNTIME_DIR": str(server.runtime_dir)})
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("identity over shared memory") or not line:
                break
        assert line.startswith("identity over shared memory: [[0.0, 1.0, 2.0, 3.0]]"), line
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()

