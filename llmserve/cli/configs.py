"""Flags and environment turned into the frozen configs of common/config.py, and the checks
that refuse a bad command line before anything starts.

Every command builds its configurations here, and the offline `LLM` builds and checks its
own with the same functions (llmserve/engine_args.py), so a flag means the same everywhere.
A mistake is a ValueError, which `main` turns into exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common.config import (
    AuthConfig,
    CacheConfig,
    LoraConfig,
    RegistryConfig,
    RequestLimits,
    SchedulerConfig,
    ServerConfig,
    TlsClientConfig,
    TlsConfig,
    WorkerConfig,
)
from common.grpc.ports import check_free
from common.worker_info import MAX_NAME_LENGTH
from llmserve.cli.speculative_flags import draft_model_dir, speculative_config
from llmserve.gateway import GatewayConfig, KubernetesDiscovery, dial_address, parse_alias


def cache_root() -> Path:
    """Where prepared models live: $LLMSERVE_CACHE, else ~/.cache/llmserve."""
    return Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve"))


def model_dir(arg: str | None) -> str:
    """The model directory --model names, else the default model (prepared into the cache once)."""
    if arg:
        return arg
    from llmserve.model_prep import prepare_default_model

    return str(prepare_default_model(cache_root()))


def log_json() -> bool:
    """JSON logs unless stderr is a terminal; LLMSERVE_LOG_JSON=1|0 forces one."""
    forced = os.environ.get("LLMSERVE_LOG_JSON")
    return forced == "1" if forced in ("0", "1") else not sys.stderr.isatty()


def tls_config(a: argparse.Namespace) -> TlsConfig | None:
    if a.tls_cert is None and a.tls_key is None:
        if a.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS runs inside TLS")
        return None
    if a.tls_cert is None or a.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    return TlsConfig(cert=a.tls_cert, key=a.tls_key, client_ca=a.tls_client_ca)


def client_tls_config(a: argparse.Namespace, peer: str) -> TlsClientConfig | None:
    """TLS to the `peer` ("worker" or "scheduler") from its --PEER-tls-* flags; None = plaintext."""
    ca, cert, key, server_name = (getattr(a, f"{peer}_tls_{k}") for k in ("ca", "cert", "key", "server_name"))
    if all(p is None for p in (ca, cert, key, server_name)):
        return None
    if (cert is None) != (key is None):
        raise ValueError(f"--{peer}-tls-cert and --{peer}-tls-key go together: give both or neither")
    return TlsClientConfig(ca=ca, cert=cert, key=key, server_name=server_name)


def server_config(a: argparse.Namespace, worker_token: str | None = None) -> ServerConfig:
    """The scheduler's listener; `worker_token` overrides the flags' (what `up` made for its workers)."""
    return ServerConfig(
        host=a.host,
        port=a.port,
        metrics_port=a.metrics_port,
        tls=tls_config(a),
        reflection=not a.no_reflection,
        drain_timeout=a.drain_timeout,
        auth=auth_config(a, worker_token),
        gateway_port=getattr(a, "gateway_port", 0),
        gateway_host=getattr(a, "gateway_host", "127.0.0.1"),
        registry_port=getattr(a, "registry_port", 0),
        registry_host=getattr(a, "registry_host", "127.0.0.1"),
        max_concurrent_rpcs=getattr(a, "max_concurrent_rpcs", 2048),
        max_streams_per_connection=getattr(a, "max_streams_per_connection", 512),
    )


WORKER_TOKEN_ENV = "LLMSERVE_WORKER_TOKEN"


def _secrets(values: list[str], path: str | None, env: str) -> tuple[str, ...]:
    """Keys from the flag (repeated), a file of one per line, and a comma-separated variable."""
    keys = [v.strip() for v in values]
    if path is not None:
        keys += _read_secrets(path, "the key file").split()
    if env in os.environ:
        from_env = [k.strip() for k in os.environ[env].split(",") if k.strip()]
        if not from_env:
            # A secret mounted empty must not quietly turn authentication off.
            raise ValueError(f"{env} is set but holds no key: give it one, or unset it to serve without keys")
        keys += from_env
    return tuple(dict.fromkeys(k for k in keys if k))


def worker_token(a: argparse.Namespace) -> str | None:
    """The worker plane's token: --worker-token-file, else LLMSERVE_WORKER_TOKEN, else none."""
    path = getattr(a, "worker_token_file", None)
    if path is not None:
        token = _read_secrets(path, "--worker-token-file").strip()
        if not token:
            raise ValueError(f"--worker-token-file {path!r} is empty")
        return token
    return os.environ.get(WORKER_TOKEN_ENV) or None


def _read_secrets(path: str, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise ValueError(f"cannot read {what} {path!r}: {error.strerror}") from None


def auth_config(a: argparse.Namespace, token: str | None = None) -> AuthConfig:
    return AuthConfig(
        api_keys=_secrets(getattr(a, "api_key", []), getattr(a, "api_key_file", None), "LLMSERVE_API_KEY"),
        admin_keys=_secrets(
            getattr(a, "admin_api_key", []), getattr(a, "admin_api_key_file", None), "LLMSERVE_ADMIN_API_KEY"
        ),
        worker_token=token if token is not None else worker_token(a),
    )


def http_keys(auth: AuthConfig) -> tuple[str, ...]:
    """The keys smg asks HTTP callers for, admin keys first: the first is smg's shared key,
    which opens its control plane too (/workers, /flush_cache), the rest open /v1 only
    (llmserve/gateway.py). A client key never comes first while an admin key exists."""
    return tuple(dict.fromkeys((*auth.admin_keys, *auth.api_keys)))


def registry_config(a: argparse.Namespace) -> RegistryConfig:
    return RegistryConfig(
        enabled=not getattr(a, "no_registration", False),
        allow=tuple(getattr(a, "worker_allow", [])),
        join_timeout=getattr(a, "registration_timeout", 120.0),
    )


def request_limits(a: argparse.Namespace) -> RequestLimits:
    return RequestLimits(
        max_prompt_bytes=a.max_prompt_bytes,
        max_tokenize_bytes=a.max_tokenize_bytes,
        max_detokenize_tokens=a.max_detokenize_tokens,
        max_stop_string_length=a.max_stop_string_length,
        max_stop_token_ids=a.max_stop_token_ids,
        max_logit_bias=a.max_logit_bias,
        max_grammar_bytes=a.max_grammar_bytes,
        max_grammar_depth=a.max_grammar_depth,
        grammar_compile_timeout=a.grammar_compile_timeout,
        grammar_cache_bytes=a.grammar_cache_mb << 20,
    )


def scheduler_config(a: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_queue_len=a.max_queue_len,
        enable_prefix_caching=not a.no_prefix_caching,
        preemption_mode=a.preemption_mode,
        swap_bandwidth_gbps=a.swap_bandwidth_gbps,
        recompute_tokens_per_s=a.recompute_tokens_per_s,
        max_prompt_tokens=a.max_prompt_tokens,
        max_stop_strings=a.max_stop_strings,
        max_logprobs=a.max_logprobs,
        max_n=a.max_n,
        plan_ahead=a.plan_ahead,
        speculative=speculative_config(a),
        pipeline_microbatches=a.pp_microbatches,
        json_max_whitespace=a.json_max_whitespace,
        # `up` gives its worker's block size; a lone scheduler has its own flag (0 = adopt).
        block_size=a.block_size,
        enable_lora=lora_enabled(a),
        max_lora_rank=a.max_lora_rank,
        lora_modules=_lora_modules(a.lora_modules),
        lora_root=a.lora_root,
        allow_runtime_lora=a.allow_runtime_lora,
        limits=request_limits(a),
    )


def lora_enabled(a: argparse.Namespace) -> bool:
    """--enable-lora, which --lora-modules implies (only the scheduler's commands have that flag)."""
    return bool(a.enable_lora or getattr(a, "lora_modules", None))


def _lora_modules(items: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {item!r} is not NAME=DIR")
        pairs.append((name, path))
    return tuple(pairs)


def worker_config(a: argparse.Namespace, model: str) -> WorkerConfig:
    return WorkerConfig(
        model=model,
        dtype=a.dtype,
        device=a.device,
        cache=CacheConfig(
            block_size=a.block_size,
            num_gpu_blocks=a.num_gpu_blocks,
            kv_cache_gb=a.kv_cache_gb,
            swap_space_gb=a.swap_space_gb,
            num_cpu_blocks=a.num_cpu_blocks,
            gpu_memory_utilization=a.gpu_memory_utilization,
        ),
        max_num_batched_tokens=a.max_num_batched_tokens,
        attention_backend=a.attention_backend,
        profile_steps=a.profile_steps,
        enforce_eager=a.enforce_eager,
        max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_model_len,
        # Only a rank process started by `worker --tp N` has these.
        rank=getattr(a, "rank", None) or 0,
        world_size=getattr(a, "world_size", None) or 1,
        dist_init_method=getattr(a, "dist_init", ""),
        dist_timeout=a.dist_timeout,
        dist_backend=a.dist_backend,
        # A rank's: the parent that starts the ranks validates its flags as one process.
        pipeline_stages=a.pp if getattr(a, "world_size", None) else 1,
        pp_layer_split=layer_counts(a.pp_layer_split),
        pp_layer_split_auto=a.pp_layer_split == "auto",
        lora=LoraConfig(a.max_loras, a.max_lora_rank, a.max_cpu_loras) if lora_enabled(a) else None,
        speculative_model=draft_model_dir(a) or "",
    )


def layer_counts(text: str) -> tuple[int, ...]:
    """--pp-layer-split's counts ("" for none, and "auto", measured by the stages at start)."""
    try:
        return tuple(int(n) for n in text.split(",")) if text and text != "auto" else ()
    except ValueError:
        raise ValueError(f"--pp-layer-split {text!r}: want layer counts such as 10,20, or auto") from None


def check_pp(model: str, pp: int, split: str) -> None:
    """Refuse a pipeline the model cannot be split into before any rank starts (exit 2)."""
    if pp == 1 and not split:
        return
    import json

    from worker_svc.device.pipeline import layer_split

    config = json.loads((Path(model) / "config.json").read_text())
    layer_split(int(config.get("text_config", config)["num_hidden_layers"]), pp, layer_counts(split))


def check_tp(model: str, tp: int) -> None:
    """Refuse a group size the model cannot split before any rank starts (ValueError: exit 2)."""
    if tp == 1:
        return
    import json

    from worker_svc.device.parallel import check_splittable

    config = json.loads((Path(model) / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    check_splittable(tp, heads, int(config.get("num_key_value_heads") or heads), int(config["intermediate_size"]))


def check_gateway_ports(config: GatewayConfig) -> None:
    """Both of the gateway's ports free, before anything starts (PortUnavailable: exit 2)."""
    check_free(f"{config.host}:{config.port}", "--http-port")
    check_free(f"{config.host}:{config.metrics_port}", "--http-metrics-port")


def served_names(a: argparse.Namespace, model: str) -> tuple[str, ...]:
    """The names requests may give the model, the first the one the scheduler reports:
    --served-model-name's, else the directory's name and the path --model gave (vLLM's default
    name, which `vllm bench serve --model PATH` sends)."""
    names = a.served_model_name or [Path(model).name, model]
    for name in names:
        if not name.strip() or len(name) > MAX_NAME_LENGTH:
            raise ValueError(f"--served-model-name {name!r}: a name is 1 to {MAX_NAME_LENGTH} characters")
    return tuple(dict.fromkeys(names))


def up_gateway_config(a: argparse.Namespace, names: tuple[str, ...]) -> GatewayConfig | None:
    """The gateway `up` runs in front of its scheduler, validated; None with --no-http. Its
    scheduler address is filled in once the port is bound (--port 0 picks one). The scheduler
    reports `names[0]`; the gateway accepts the others for it."""
    if a.no_http:
        return None
    # --tls-cert is no obstacle: smg dials the scheduler's gateway listener on loopback, which is
    # plaintext (smg speaks h2c only); TLS guards the public port.
    taken = {a.port: "--port", **({a.metrics_port: "--metrics-port"} if a.metrics_port else {})}
    for flag, port in (("--http-port", a.http_port), ("--http-metrics-port", a.http_metrics_port)):
        if port in taken:
            raise ValueError(f"{flag} {port} is also {taken[port]}: give each its own port")
    return GatewayConfig(
        schedulers=(dial_address(a.host, a.port or 1),),
        host=a.host,
        port=a.http_port,
        metrics_port=a.http_metrics_port,
        model_aliases=tuple((alias, names[0]) for alias in names[1:]),
        shutdown_grace=a.drain_timeout,
        log_level=a.log_level,
        log_json=log_json(),
    )


def gateway_config(a: argparse.Namespace) -> GatewayConfig:
    """`llmserve gateway`: its schedulers, listed or discovered."""
    discovery = None
    if a.k8s_selector:
        if a.scheduler:
            raise ValueError("--scheduler and --k8s-selector exclude each other: list the schedulers or discover them")
        discovery = KubernetesDiscovery(tuple(a.k8s_selector), a.k8s_port, a.k8s_namespace)
    elif not a.scheduler:
        raise ValueError(
            "llmserve gateway needs --scheduler HOST:PORT (repeat it for several) or --k8s-selector KEY=VALUE"
        )
    keys = http_keys(auth_config(a))
    return GatewayConfig(
        schedulers=tuple(a.scheduler),
        discovery=discovery,
        host=a.host,
        port=a.http_port,
        metrics_port=a.http_metrics_port,
        policy=a.policy,
        model_path=a.model_path,
        model_aliases=tuple(parse_alias(text) for text in a.model_alias),
        shutdown_grace=a.drain_timeout,
        log_level=a.log_level,
        log_json=log_json(),
        api_keys=keys,
    )
