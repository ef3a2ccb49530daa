"""Configuration as frozen dataclasses, validated once at construction.

Built at the entry points (CLI, tests) and passed explicitly. Capacity discovered at run time
(KV blocks, max_model_len) is returned by whoever discovers it, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.request_limits import RequestLimits
from common.speculative_config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")
DIST_BACKENDS = ("auto", "nccl", "gloo")
PREEMPTION_MODES = ("auto", "swap", "recompute")
MAX_LORA_RANK = 512  # the largest adapter rank a slot may be sized for
MAX_MICROBATCHES = 8  # the most plans a pipelined group keeps in flight (and a worker queues)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class CacheConfig:
    """Shape and size of the paged KV cache."""

    block_size: int = 16
    # Overrides the profiled number of KV blocks (GPU) or the size derived from kv_cache_gb (CPU).
    num_gpu_blocks: int | None = None
    # Memory the KV pool may take. None: on CPU, 2 GiB or 30% of the available memory if
    # less; on CUDA, what is left of gpu_memory_utilization of the device after the weights
    # and the heaviest step's peak (worker_svc/step/host_memory.py, runner.py).
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    # Host memory for the swap pool of preempted sequences (pinned on CUDA). None: 4 GiB with
    # CUDA, 1 GiB on CPU, or 10% of the available memory if less.
    swap_space_gb: float | None = None
    # Overrides the swap pool size derived from swap_space_gb (tests use a few blocks).
    num_cpu_blocks: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.block_size in (8, 16, 32, 64, 128),
            f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}",
        )
        _require(self.num_gpu_blocks is None or self.num_gpu_blocks > 0, "num_gpu_blocks must be positive")
        _require(self.kv_cache_gb is None or self.kv_cache_gb > 0, "kv_cache_gb must be positive")
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must lie in (0, 1]")
        _require(self.swap_space_gb is None or self.swap_space_gb >= 0, "swap_space_gb must not be negative")
        _require(self.num_cpu_blocks is None or self.num_cpu_blocks >= 0, "num_cpu_blocks must not be negative")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits of the scheduler."""

    max_num_seqs: int = 256
    # Token budget of one step: prefill chunks and decodes together.
    max_num_batched_tokens: int = 2048
    # Fraction of the KV pool kept free when admitting new prompts, so running sequences can grow
    # a little before anything has to be preempted.
    watermark: float = 0.01
    # Requests waiting for admission before new ones are refused with RESOURCE_EXHAUSTED.
    max_queue_len: int = 1024
    enable_prefix_caching: bool = True
    # How a preempted group gives back its blocks: "auto" weighs the two costs below.
    preemption_mode: str = "auto"
    # Host <-> device copy bandwidth for swapping, GB/s (pinned PCIe 4.0 x16 reaches ~25).
    swap_bandwidth_gbps: float = 16.0
    # Prefill speed for recomputing a preempted sequence, tokens/s.
    recompute_tokens_per_s: float = 8000.0
    # Per-request limits (INVALID_ARGUMENT beyond them). 0 prompt tokens = up to the context.
    max_prompt_tokens: int = 0
    max_stop_strings: int = 16
    max_logprobs: int = 20
    max_n: int = 16
    # Tokens per KV block every worker group must use; 0 = whatever the first group reports
    # (later groups must then match it: prefix hashes and routing assume one block size).
    block_size: int = 0
    # Plan the next step while the current one runs, when its result cannot change that plan.
    plan_ahead: bool = True
    # Plans a pipelined group keeps in flight over disjoint sequences: 0 = stages + 1 (CPU: 1).
    pipeline_microbatches: int = 0
    # Structured outputs: the longest run of whitespace a JSON output may hold between tokens
    # (JSON allows any; a model that starts emitting it may not stop).
    json_max_whitespace: int = 4
    # LoRA adapters: requests may name one (adapter_id). Every worker group must then have
    # adapter slots of at least max_lora_rank. lora_modules are (name, directory) pairs
    # loaded at start; more come and go at run time (LoadAdapter, UnloadAdapter).
    enable_lora: bool = False
    max_lora_rank: int = 64
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Adapter directories must lie under lora_root (after resolving links; None: anywhere for
    # lora_modules, and no runtime loading at all). LoadAdapter works only with
    # allow_runtime_lora, an operator's choice, since it reads files the caller names.
    lora_root: str | None = None
    allow_runtime_lora: bool = False
    limits: RequestLimits = RequestLimits()
    speculative: SpeculativeConfig | None = None  # None: no drafts

    def __post_init__(self) -> None:
        _require(
            self.lora_root is None or Path(self.lora_root).is_dir(), f"lora_root {self.lora_root!r} is not a directory"
        )
        _require(0 <= self.pipeline_microbatches <= MAX_MICROBATCHES, f"pipeline_microbatches: 0 to {MAX_MICROBATCHES}")
        _require(
            not self.allow_runtime_lora or self.lora_root is not None,
            "runtime LoRA loading needs a root to load from (--lora-root DIR)",
        )
        _require(self.max_num_seqs > 0 and self.max_queue_len > 0, "max_num_seqs and max_queue_len must be positive")
        _require(self.block_size >= 0, "block_size must not be negative")
        _require(
            self.preemption_mode in PREEMPTION_MODES,
            f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}",
        )
        _require(self.swap_bandwidth_gbps > 0, "swap_bandwidth_gbps must be positive")
        _require(self.recompute_tokens_per_s > 0, "recompute_tokens_per_s must be positive")
        for name in ("max_prompt_tokens", "max_stop_strings", "max_logprobs", "max_n"):
            _require(getattr(self, name) >= 0, f"{name} must not be negative")
        _require(self.max_n >= 1, "max_n must be at least 1")
        _require(self.json_max_whitespace >= 1, "json_max_whitespace must be at least 1")
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive")
        _require(0 <= self.watermark < 1, "watermark must lie in [0, 1)")
        _require(1 <= self.max_lora_rank <= MAX_LORA_RANK, f"max_lora_rank must lie in [1, {MAX_LORA_RANK}]")
        _require(self.enable_lora or not self.lora_modules, "lora_modules need enable_lora")
        names = [name for name, _ in self.lora_modules]
        _require(len(set(names)) == len(names), "lora_modules names an adapter twice")


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA on a worker: device slots of adapter weights and the host copies behind them."""

    # Adapters one step may use (device slots, each as large as max_lora_rank).
    max_loras: int = 4
    max_lora_rank: int = 64
    # Adapters kept in host memory, so a slot is refilled without reading the files again;
    # None = max_loras.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, "max_loras must be at least 1")
        _require(1 <= self.max_lora_rank <= MAX_LORA_RANK, f"max_lora_rank must lie in [1, {MAX_LORA_RANK}]")
        _require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras must be at least max_loras",
        )

    @property
    def host_copies(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker process loads and where it runs."""

    model: str
    dtype: str = "auto"
    # "auto" (cuda:0 when CUDA is present, else cpu), "cpu" or "cuda[:N]".
    device: str = "auto"
    cache: CacheConfig = CacheConfig()
    # Largest step the worker profiles memory for; set to the scheduler's token budget.
    max_num_batched_tokens: int = 2048
    # "auto": triton on CUDA, our C++ kernels ("cpu") on CPU; "torch" is the reference.
    attention_backend: str = "auto"
    # Time each step by part (StepResult.part_seconds); hooks cost a little, on CUDA a sync each.
    profile_steps: bool = False
    # On CUDA, decode steps replay CUDA graphs captured per batch-size bucket up to
    # max_num_seqs (worker_svc/step/cuda_graphs.py), unless enforce_eager.
    enforce_eager: bool = False
    max_num_seqs: int = 256
    max_model_len: int = 0  # 0: as far as the model's positions go (common.model_spec.context_limit)
    # Tensor parallelism: this process is `rank` of `world_size`, meeting the others at
    # `dist_init_method` (e.g. tcp://127.0.0.1:29500); collectives give up after dist_timeout
    # seconds, so a dead or stalled rank ends the group instead of hanging it.
    rank: int = 0
    world_size: int = 1
    dist_init_method: str = ""
    dist_timeout: float = 60.0
    # "auto": NCCL between GPUs, gloo on CPU. "gloo" on CUDA lets ranks share a GPU (NCCL
    # refuses two ranks on one device), at the cost of host copies in every collective and
    # no CUDA graphs (a collective through the host cannot be captured).
    dist_backend: str = "auto"
    # Pipeline: the world_size ranks form this many stages (stage-major), of `pp_layer_split`
    # layers each (empty: as even as they go; worker_svc/device/pipeline.py).
    pipeline_stages: int = 1
    pp_layer_split: tuple[int, ...] = ()
    pp_layer_split_auto: bool = False  # measure each stage first (worker_svc/device/stage_probe.py)
    # None: no adapter slots (LoRA off).
    lora: LoraConfig | None = None
    # Speculative decoding: a draft model's directory ("" = none), run beside the model.
    speculative_model: str = ""

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}",
        )
        _require(
            self.device in ("auto", "cpu") or self.device.startswith("cuda"),
            f"device must be auto, cpu or cuda[:N], got {self.device!r}",
        )
        _require(0 <= self.rank < self.world_size, f"rank must lie in [0, {self.world_size}), got {self.rank}")
        _require(self.world_size == 1 or bool(self.dist_init_method), "a group of ranks needs dist_init_method")
        _require(self.dist_timeout > 0, "dist_timeout must be positive")
        _require(self.world_size % max(self.pipeline_stages, 1) == 0, "pipeline_stages must divide world_size")
        _require(
            self.dist_backend in DIST_BACKENDS,
            f"dist_backend must be one of {', '.join(DIST_BACKENDS)}, got {self.dist_backend!r}",
        )
        _require(self.max_num_seqs >= 1 and self.max_model_len >= 0, "max_num_seqs >= 1, max_model_len >= 0")


def _require_file(path: str, what: str) -> None:
    # Checked here so a wrong path fails at startup with its name, not inside a TLS handshake.
    _require(Path(path).is_file(), f"{what} {path!r} is not a file")


@dataclass(frozen=True)
class TlsConfig:
    """Server side of TLS: the service's certificate chain and key (PEM files).

    With client_ca the service demands a client certificate that chains to it (mutual TLS).
    """

    cert: str
    key: str
    client_ca: str | None = None

    def __post_init__(self) -> None:
        _require(bool(self.cert) and bool(self.key), "TLS needs both a certificate and a key")
        _require_file(self.cert, "TLS certificate")
        _require_file(self.key, "TLS key")
        if self.client_ca is not None:
            _require_file(self.client_ca, "TLS client CA")


@dataclass(frozen=True)
class TlsClientConfig:
    """Client side of TLS, for the scheduler's channel to a worker (PEM files).

    ca None trusts the system roots; cert and key present a client certificate (mutual TLS).
    server_name overrides the name the worker's certificate is checked against, for
    certificates whose SAN differs from the host in the worker address.
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        _require(
            (self.cert is None) == (self.key is None),
            "a TLS client certificate needs its key, and a key its certificate",
        )
        for path, what in ((self.ca, "TLS CA"), (self.cert, "TLS client certificate"), (self.key, "TLS client key")):
            if path is not None:
                _require_file(path, what)
        _require(self.server_name is None or bool(self.server_name), "TLS server name must not be empty")


def _check_secret(secret: str, what: str) -> None:
    # Metadata values are ASCII; a key with spaces or a short one is a mistake, not a choice.
    _require(len(secret) >= 8, f"{what} must be at least 8 characters")
    _require(
        secret.isascii() and secret.isprintable() and " " not in secret, f"{what} must be printable ASCII, no spaces"
    )


@dataclass(frozen=True)
class AuthConfig:
    """Who may call a service (docs/design.md section 5).

    api_keys admit clients (`authorization: Bearer KEY`); admin_keys admit clients to the admin
    RPCs as well (adapters, cache flush, KV events, profiling). With api_keys but no admin_keys,
    every api key is an admin key (vLLM's one-key model). worker_token is what workers and the
    scheduler show each other: Register on the scheduler, Describe and Execute on a worker.
    """

    # Kept out of repr: configs are logged and printed in tracebacks.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    worker_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for key in self.api_keys:
            _check_secret(key, "an API key")
        for key in self.admin_keys:
            _check_secret(key, "an admin API key")
        if self.worker_token is not None:
            _check_secret(self.worker_token, "the worker token")

    @property
    def clients_authenticated(self) -> bool:
        return bool(self.api_keys or self.admin_keys)


@dataclass(frozen=True)
class ServerConfig:
    """Where a service listens."""

    host: str = "127.0.0.1"
    port: int = 50051
    # Prometheus metrics over HTTP; 0 turns them off.
    metrics_port: int = 0
    # On SIGTERM: seconds in-flight requests get to finish (health NOT_SERVING, new requests
    # refused with UNAVAILABLE meanwhile) before the server stops.
    drain_timeout: float = 30.0
    # None: plaintext.
    tls: TlsConfig | None = None
    # Server reflection lets grpcurl list and call the API without the .proto files; some
    # deployments do not want the API surface discoverable. Health stays on either way.
    reflection: bool = True
    # Client keys and the worker token (AuthConfig below); empty: nothing asked for.
    auth: AuthConfig = AuthConfig()
    # A second listener that serves only the gateway protocol (vllm.grpc.engine.VllmEngine) to
    # smg, which dials without credentials: callers there count as the gateway, so bind it
    # where only the gateway reaches it (loopback, or a port a NetworkPolicy keeps to the
    # gateway's pods). 0: none.
    gateway_port: int = 0
    gateway_host: str = "127.0.0.1"
    # The worker plane on a port of its own (llmserve.v1.Registry and health only; the main
    # port then no longer serves Registry), so that a network policy can keep workers and
    # clients apart. 0: Registry on the main port.
    registry_port: int = 0
    registry_host: str = "127.0.0.1"
    # The most RPCs in progress at once (more get RESOURCE_EXHAUSTED) and HTTP/2 streams per
    # connection; a request's stream counts as one RPC while it lasts.
    max_concurrent_rpcs: int = 2048
    max_streams_per_connection: int = 512

    def __post_init__(self) -> None:
        _require(0 <= self.gateway_port < 65536, f"gateway_port must lie in [0, 65535], got {self.gateway_port}")
        _require(0 <= self.registry_port < 65536, f"registry_port must lie in [0, 65535], got {self.registry_port}")
        _require(self.max_concurrent_rpcs >= 1, "max_concurrent_rpcs must be at least 1")
        _require(self.max_streams_per_connection >= 1, "max_streams_per_connection must be at least 1")
        _require(0 <= self.port < 65536, f"port must lie in [0, 65535], got {self.port}")
        _require(0 <= self.metrics_port < 65536, f"metrics_port must lie in [0, 65535], got {self.metrics_port}")
        _require(self.drain_timeout >= 0, "drain_timeout must not be negative")


@dataclass(frozen=True)
class RegistryConfig:
    """Which workers may join a scheduler by registering (the worker plane, docs/design.md section 5)."""

    enabled: bool = True
    # Addresses the scheduler may dial when a rank registers: "host:port", "host" (any port) or
    # "unix:///path". Empty: any address (the worker token still decides who may register).
    allow: tuple[str, ...] = ()
    # Seconds the ranks of a group may wait for the rest of it; then they are dropped, so an
    # incomplete group cannot hold a name (or a Register stream) for ever.
    join_timeout: float = 120.0
    # Ranks registered but not yet in a complete group, over all groups.
    max_pending: int = 64

    def __post_init__(self) -> None:
        _require(self.join_timeout > 0, "join_timeout must be positive")
        _require(self.max_pending >= 1, "max_pending must be at least 1")
        for entry in self.allow:
            _require(bool(entry.strip()), "a worker allow-list entry is empty")
