"""The OpenAI HTTP API: smg, the Shepherd Model Gateway, run as a supervised child process.

smg (a Rust binary in the `smg` wheel) answers `/v1/completions`, `/v1/chat/completions`
and `/v1/models` over HTTP and speaks `vllm.grpc.engine.VllmEngine` to the schedulers behind
it: it tokenizes, renders the chat template and detokenizes itself, routes each request
(cache-aware by default, from the prefix-cache events the schedulers stream) and polls their
load. `llmserve up` starts one in front of its own scheduler; `llmserve gateway` runs one over
several schedulers, listed or found as Kubernetes pods.

    llmserve ──(Supervised)──► smg launch --backend vllm --worker-urls grpc://SCHEDULER ...
                                  │ HTTP  :8000  /v1/*, /health, /liveness, /readiness
                                  │ HTTP  :9092  /metrics (smg_*)

smg sends no credentials to the schedulers, so it dials their gateway listener
(scheduler_svc/api/server.py), where every call counts as the gateway's. Over HTTP it asks for
keys itself (`api_keys`): requests without one are 401. smg takes one shared `--api-key`, good
for every route including its own admin ones (/flush_cache, /workers, ...), and any number of
`--tenant-api-key TENANT:KEY`, good for the serving routes (/v1/...) only: so the first key
(`llmserve up` puts an admin key first) is the shared one and the others are tenant keys named
by `key_name`. Over HTTP every key then acts as the gateway, whose requests the scheduler cannot
tell apart. smg reads keys from its command line only, which any local user can read in
/proc; smg is a Python program, so we run its entry point with the keys added to its argv in
its own process, from the environment (`KEYS_ENV`), readable by this user alone.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from common.grpc.auth import key_name
from llmserve.supervisor import Supervised, bound_to_this_process

log = structlog.get_logger("llmserve")

# smg's routing policies that need nothing but the schedulers (no PD disaggregation, no manual keys).
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "least_load", "consistent_hashing", "prefix_hash")
DEFAULT_HTTP_PORT = 8000
# Next to the scheduler's (9090) and the worker's (9091) in compose.yaml and Kubernetes;
# smg's own default, 29000, would collide between two gateways on one machine just the same.
DEFAULT_METRICS_PORT = 9092
# Our level names -> smg's.
_SMG_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}
# Our own gateway is dialed directly: an operator's http_proxy would otherwise get the probe.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# The HTTP keys' smg flags, as a JSON list, for the launcher below; it takes them out of the environment.
KEYS_ENV = "LLMSERVE_SMG_KEY_ARGS"
_LAUNCH = (
    f"import json, os, sys; from smg.cli import main; main([*sys.argv[1:], *json.loads(os.environ.pop({KEYS_ENV!r}))])"
)


class GatewayUnavailable(ValueError):
    """The smg executable is not installed (exit 2, like any configuration mistake)."""


@dataclass(frozen=True)
class KubernetesDiscovery:
    """Schedulers found as the pods that carry these labels, dialed on `port`."""

    selector: tuple[str, ...]  # KEY=VALUE labels, all of which a pod must carry
    port: int = 50051
    namespace: str | None = None  # None: every namespace (needs a ClusterRole)

    def __post_init__(self) -> None:
        if not self.selector:
            raise ValueError("Kubernetes discovery needs at least one KEY=VALUE label")
        for label in self.selector:
            key, sep, _ = label.partition("=")
            if not sep or not key:
                raise ValueError(f"selector label {label!r} is not KEY=VALUE")
        _check_port(self.port, "--k8s-port")


@dataclass(frozen=True)
class GatewayConfig:
    """One smg: where it listens, and the schedulers (host:port) or the pods it routes to."""

    schedulers: tuple[str, ...] = ()
    discovery: KubernetesDiscovery | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_HTTP_PORT
    metrics_port: int = DEFAULT_METRICS_PORT
    policy: str = "cache_aware"
    model_path: str | None = None  # tokenizer source; None: fetched from a scheduler (GetTokenizer)
    # (alias, name): requests may name the model the schedulers serve as `name` by `alias` too.
    model_aliases: tuple[tuple[str, str], ...] = ()
    shutdown_grace: float = 30.0  # seconds in-flight HTTP requests get on SIGTERM
    log_level: str = "info"
    log_json: bool = False
    # HTTP requests must show one (`Authorization: Bearer KEY`); empty: none asked for. The
    # first is smg's shared key (every route), the others serve /v1 only (see the module's doc).
    api_keys: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if bool(self.schedulers) == (self.discovery is not None):
            raise ValueError("the gateway needs schedulers (--scheduler HOST:PORT) or Kubernetes discovery, not both")
        for address in self.schedulers:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"--scheduler {address!r} is not HOST:PORT")
            _check_port(int(port), "--scheduler")
        _check_port(self.port, "--http-port")
        _check_port(self.metrics_port, "--http-metrics-port")
        if self.port == self.metrics_port:
            raise ValueError(f"--http-port and --http-metrics-port are both {self.port}: give them different ports")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if self.shutdown_grace < 0:
            raise ValueError(f"the gateway's drain timeout must be >= 0, got {self.shutdown_grace}")
        _check_aliases(self.model_aliases)
        if self.log_level not in _SMG_LOG_LEVELS:
            raise ValueError(f"log level {self.log_level!r}: choose one of {', '.join(_SMG_LOG_LEVELS)}")

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.metrics_port}/metrics"


def _check_port(port: int, flag: str) -> None:
    if not 1 <= port <= 65535:
        raise ValueError(f"{flag} {port} is not a TCP port (1-65535)")


def _check_aliases(aliases: tuple[tuple[str, str], ...]) -> None:
    seen: set[str] = set()
    for alias, name in aliases:
        # smg splits ALIAS=NAME at the first "=".
        if not alias.strip() or not name.strip() or "=" in alias:
            raise ValueError(f"model alias {alias!r} for {name!r}: both must be non-empty and the alias free of '='")
        if alias == name:
            raise ValueError(f"model alias {alias!r} names the model itself")
        if alias in seen:
            raise ValueError(f"model alias {alias!r} given twice")
        seen.add(alias)


def parse_alias(text: str) -> tuple[str, str]:
    """ALIAS=NAME, as --model-alias takes it."""
    alias, sep, name = text.partition("=")
    if not sep:
        raise ValueError(f"--model-alias {text!r} is not ALIAS=NAME")
    return alias, name


def _url_host(host: str) -> str:
    """A host as it goes into a URL: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def dial_address(host: str, port: int) -> str:
    """host:port that reaches a server listening on `host` from this machine (a wildcard
    listens on loopback too)."""
    bare = host.strip("[]")
    if bare in ("", "0.0.0.0"):
        bare = "127.0.0.1"
    elif bare == "::":
        bare = "::1"
    return f"{_url_host(bare)}:{port}"


def smg_executable(beside: Path | None = None, path: str | None = None) -> str:
    """The smg executable: next to this interpreter (the virtual environment's bin/, where pip
    put it), else on PATH."""
    here = (beside if beside is not None else Path(sys.executable).parent) / "smg"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("smg", path=path)
    if found is None:
        raise GatewayUnavailable(
            f"the gateway needs the smg executable, found neither in {here.parent} nor on PATH: "
            "`pip install smg==1.13.0` (a dependency of llmserve), or run without HTTP (`llmserve up --no-http`)"
        )
    return found


def smg_command(config: GatewayConfig, executable: str) -> list[str]:
    """The `smg launch` command line for `config`. The metrics listener is always named: smg
    would otherwise open 0.0.0.0:29000, on every interface and the same port for every gateway."""
    cmd = [
        executable,
        "launch",
        "--backend",
        "vllm",
        "--host",
        config.host,
        "--port",
        str(config.port),
        "--prometheus-host",
        config.host,
        "--prometheus-port",
        str(config.metrics_port),
        "--policy",
        config.policy,
        "--shutdown-grace-period-secs",
        str(math.ceil(config.shutdown_grace)),
        "--log-level",
        _SMG_LOG_LEVELS[config.log_level],
    ]
    if config.log_json:
        cmd.append("--log-json")
    if config.model_path:
        cmd += ["--model-path", config.model_path]
    for alias, name in config.model_aliases:
        cmd += ["--model-alias", f"{alias}={name}"]
    if config.discovery is None:
        cmd += ["--worker-urls", *(f"grpc://{address}" for address in config.schedulers)]
    else:
        d = config.discovery
        cmd += ["--service-discovery", "--selector", *d.selector, "--service-discovery-port", str(d.port)]
        if d.namespace:
            cmd += ["--service-discovery-namespace", d.namespace]
    return cmd


def smg_key_args(config: GatewayConfig) -> list[str]:
    """smg's flags for the HTTP keys: the first shared, the others per tenant (named by key_name)."""
    if not config.api_keys:
        return []
    first, *others = config.api_keys
    return ["--api-key", first, *(a for key in others for a in ("--tenant-api-key", f"{key_name(key)}:{key}"))]


def smg_process(config: GatewayConfig, executable: str) -> tuple[list[str], dict[str, str] | None]:
    """How to start smg for `config`: its command line and environment (None: ours). The keys
    travel in the environment when smg's Python entry point is importable here, in argv else."""
    cmd = smg_command(config, executable)
    keys = smg_key_args(config)
    if not keys:
        return cmd, None
    if importlib.util.find_spec("smg") is None:
        log.warning("gateway_keys_in_argv", detail="smg is not importable here: its API keys go on its command line")
        return cmd + keys, None
    return [sys.executable, "-c", _LAUNCH, *cmd[1:]], {**os.environ, KEYS_ENV: json.dumps(keys)}


class Gateway:
    """smg as a child process: started, restarted if it dies, stopped (draining) before the
    schedulers it routes to. It gets SIGTERM if we die, and a session of its own so that a
    terminal's Ctrl-C reaches only us: we stop it first."""

    def __init__(self, config: GatewayConfig, executable: str | None = None) -> None:
        self.config = config
        self.command, env = smg_process(config, executable or smg_executable())
        self.process = Supervised(bound_to_this_process(self.command), env=env, name="gateway", own_session=True)
        # The smg process whose `http_ready` line was logged. Each process gets its own: after
        # `gateway_exited` an operator (or a script tailing the log) needs to know when HTTP
        # answers again just as much as at the first start.
        self._announced_pid: int | None = None

    @property
    def announced(self) -> bool:
        """False while the running smg has not yet been seen answering (and logged)."""
        proc = self.process.proc
        return proc is None or proc.poll() is not None or proc.pid == self._announced_pid

    def answers(self, timeout: float = 0.5) -> bool:
        """Whether smg's /readiness is 200. Blocks up to `timeout`: from an event loop, call it
        in a thread."""
        url = f"http://{dial_address(self.config.host, self.config.port)}/readiness"
        try:
            with _DIRECT.open(url, timeout=timeout) as response:
                return bool(response.status == 200)
        except OSError:  # refused while smg starts; HTTPError (a 503) is one too
            return False

    def announce_when_ready(self) -> None:
        """Log `http_ready` once the running smg answers; a no-op once it has. Blocks up to
        half a second (a thread, from an event loop)."""
        proc = self.process.proc
        if self.announced or proc is None or not self.answers():
            return
        self._announced_pid = proc.pid
        log.info("http_ready", openai=f"{self.config.url}/v1", metrics=self.config.metrics_url, pid=proc.pid)

    def start(self) -> None:
        cfg = self.config
        log.info(
            "gateway_starting",
            openai=f"{cfg.url}/v1",
            metrics=cfg.metrics_url,
            schedulers=list(cfg.schedulers) or None,
            discovery=" ".join(cfg.discovery.selector) if cfg.discovery else None,
            policy=cfg.policy,
            http_keys=len(cfg.api_keys),
        )
        self.process.start()

    def restart_if_dead(self) -> None:
        self.process.restart_if_dead()

    def stop(self) -> None:
        """Blocks until smg has drained (its grace period) or is killed: call it in a thread
        while the scheduler it drains through keeps serving."""
        self.process.stop(timeout=self.config.shutdown_grace + 10.0)
