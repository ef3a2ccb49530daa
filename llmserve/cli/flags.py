"""The flag groups the `llmserve` commands share, and the argparse value types they use.

`up` takes the scheduler's and the worker's flags, `scheduler` and `worker` each take theirs,
and the offline `LLM` (llmserve/engine_args.py) reads its keyword arguments off the same
groups: one definition of each option, its type, choices and default, for all of them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from common.config import ATTENTION_BACKENDS, DIST_BACKENDS, DTYPES, PREEMPTION_MODES
from llmserve.cli.speculative_flags import add_draft_model_flag, add_speculative_flags
from llmserve.gateway import DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT


def at_least(low: float, kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: argparse then names the flag when a value is out of range."""

    def parse(text: str) -> Any:
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    parse.__name__ = kind.__name__  # what argparse prints for a value that does not parse
    return parse


def at_most_one(text: str) -> float:
    """An argparse type for a share: a float in [0, 1]."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {text}")
    return value


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the prepared SmolLM2)")


def add_served_name_flag(p: argparse.ArgumentParser, several: bool) -> None:
    """The model's names to clients; `several` where a gateway runs alongside to accept them all."""
    if several:
        p.add_argument(
            "--served-model-name",
            nargs="+",
            default=None,
            metavar="NAME",
            help="the names requests may give the model, the first reported in responses and metrics (default: the "
            "model directory's name, and --model's path as given, which is vLLM's default name)",
        )
    else:
        p.add_argument(
            "--served-model-name",
            default=None,
            metavar="NAME",
            help="the model's name in responses and metrics (default: the model directory's name)",
        )


def add_server_flags(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=port, help=f"gRPC port (default {port})")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics port; 0 = off (default)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests get to finish while new ones are refused (default 30)",
    )


def add_security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS (needs --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA bundle: require client certificates signed by it (mutual TLS; needs --tls-cert)",
    )
    p.add_argument("--no-reflection", action="store_true", help="do not serve gRPC reflection (health stays on)")


def add_worker_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--worker-tls-ca",
        default=None,
        help="PEM CA bundle the worker's certificate must chain to; any --worker-tls-* flag turns TLS to the worker on",
    )
    p.add_argument(
        "--worker-tls-cert", default=None, help="PEM client certificate for a worker that demands one (mutual TLS)"
    )
    p.add_argument("--worker-tls-key", default=None, help="PEM private key of --worker-tls-cert")
    p.add_argument(
        "--worker-tls-server-name",
        default=None,
        help="name the worker's certificate is checked against, when it differs from the --worker host",
    )


def add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    add_speculative_flags(p)
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step (default 2048)")
    p.add_argument(
        "--max-queue-len",
        type=int,
        default=1024,
        help="waiting requests before new ones get RESOURCE_EXHAUSTED (default 1024)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of earlier prompts")
    p.add_argument(
        "--preemption-mode",
        choices=PREEMPTION_MODES,
        default="auto",
        help="how preempted requests give back KV blocks; auto = the cheaper of swap and recompute",
    )
    p.add_argument(
        "--swap-bandwidth-gbps",
        type=float,
        default=16.0,
        help="host<->device copy bandwidth the swap cost assumes, GB/s (default 16)",
    )
    p.add_argument(
        "--recompute-tokens-per-s",
        type=float,
        default=8000.0,
        help="prefill speed the recompute cost assumes, tokens/s (default 8000)",
    )
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="longest prompt accepted; 0 = up to the context")
    p.add_argument("--max-stop-strings", type=int, default=16, help="most stop strings per request (default 16)")
    p.add_argument("--max-logprobs", type=int, default=20, help="most logprobs alternatives per token (default 20)")
    p.add_argument(
        "--max-n", type=int, default=16, help="most outputs, best_of candidates or beams per request (default 16)"
    )
    p.add_argument(
        "--no-plan-ahead",
        dest="plan_ahead",
        action="store_false",
        help="plan each step only after the previous step's result (default: plan it while that step runs)",
    )
    p.add_argument(
        "--pp-microbatches",
        type=int,
        default=0,
        metavar="N",
        help="plans a pipelined worker group keeps in flight over disjoint sequences, so that every stage has "
        "work (default 0 = one per stage and one more, which hides the scheduler's turn-around, or 1 for CPU "
        "ranks, which share the host's cores; 1 = one at a time)",
    )
    p.add_argument(
        "--json-max-whitespace",
        type=int,
        default=4,
        help="longest run of whitespace a JSON structured output may hold between tokens (default 4)",
    )
    add_lora_flags(p)
    p.add_argument(
        "--lora-root",
        default=None,
        metavar="DIR",
        help="adapter directories must lie under DIR (after resolving links); needed by --allow-runtime-lora",
    )
    p.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="let admin callers load adapters from --lora-root at run time (LoadAdapter)",
    )
    add_limit_flags(p)
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="LoRA adapters (PEFT directories) served from the start, by name; implies --enable-lora",
    )


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """What the scheduler and its workers must agree on (`worker` has its own copy of these)."""
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: workers hold --max-loras adapter slots, requests name an adapter in adapter_id",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=64,
        help="largest LoRA rank accepted, and the size of each slot (default 64)",
    )


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto = bfloat16 where fast, else float32")
    p.add_argument("--device", default="auto", help="auto (cuda:0 if present, else cpu), cpu, cuda:N")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    add_draft_model_flag(p)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="longest context served, prompt and output (default 0: as far as the model's positions go, "
        "max_position_embeddings stretched by a linear or yarn rope scaling)",
    )
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV pool size in blocks (overrides profiling)")
    p.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        help="memory the KV pool may take (CPU default: 2, or 30%% of the available memory if less)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="on CUDA, the share of the device's memory weights, the heaviest step and the KV pool may take (default 0.9)",
    )
    p.add_argument(
        "--swap-space-gb",
        type=float,
        default=None,
        help="host memory (pinned on CUDA) that holds preempted sequences' KV blocks (default: 4 with CUDA, "
        "1 on CPU, or 10%% of the available memory if less; 0 = no swapping)",
    )
    p.add_argument(
        "--num-cpu-blocks", type=int, default=None, help="swap pool size in blocks (overrides --swap-space-gb)"
    )
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="worker kernels: auto = triton on CUDA, cpu (our C++ kernels, built on first use) on CPU; torch = the reference",
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel group size: one rank process per device (default 1)"
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages: the layers split over N stages of --tp ranks each, N x tp rank processes (default 1)",
    )
    p.add_argument(
        "--pp-layer-split",
        default="",
        metavar="N,N,...|auto",
        help="layers per pipeline stage, in stage order; auto: set from each stage's measured speed and free "
        "memory at start, so a slower or smaller device gets fewer layers (default: as even as they go)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every step eagerly (default: decode steps replay CUDA graphs captured at start)",
    )
    p.add_argument(
        "--profile-steps",
        action="store_true",
        help="time each step by part (linears, attention, sampling, ...) into the scheduler's "
        "llmserve:step_part_seconds metric; costs a little speed (on CUDA a device sync per part)",
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=60.0,
        help="seconds a collective may wait for the other ranks before the group gives up (default 60)",
    )
    p.add_argument(
        "--dist-backend",
        choices=DIST_BACKENDS,
        default="auto",
        help="collectives of a --tp group: auto = NCCL on CUDA, gloo on CPU; gloo on CUDA lets ranks share "
        "one GPU (slower, no CUDA graphs)",
    )
    p.add_argument(
        "--max-loras",
        type=at_least(1, int),
        default=4,
        help="with --enable-lora: distinct adapters one step may use, i.e. device slots per worker (default 4)",
    )
    p.add_argument(
        "--max-cpu-loras",
        type=at_least(1, int),
        default=None,
        help="with --enable-lora: adapters a worker keeps in host memory to refill slots from (default --max-loras)",
    )


def add_http_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help=f"port of the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models; default {DEFAULT_HTTP_PORT})",
    )
    p.add_argument(
        "--http-metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help=f"Prometheus port of the HTTP gateway (smg_* metrics; default {DEFAULT_METRICS_PORT})",
    )


def add_client_auth_flags(p: argparse.ArgumentParser) -> None:
    """Client keys of the scheduler's APIs (`up` and `scheduler`)."""
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a key every client RPC must present as `authorization: Bearer KEY` (and every HTTP request, through "
        "the gateway); repeat for several. Also read from --api-key-file and LLMSERVE_API_KEY (comma-separated)",
    )
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="file of API keys, one per line")
    p.add_argument(
        "--admin-api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a key for the admin RPCs too (LoadAdapter, UnloadAdapter, FlushCache, SubscribeKvEvents, profiling, "
        "priority below 0); without one, every --api-key is an admin key. Also --admin-api-key-file and "
        "LLMSERVE_ADMIN_API_KEY",
    )
    p.add_argument("--admin-api-key-file", default=None, metavar="PATH", help="file of admin API keys, one per line")


def add_worker_token_flags(p: argparse.ArgumentParser) -> None:
    """The secret of the worker plane, never on the command line (argv is public on a host)."""
    p.add_argument(
        "--worker-token-file",
        default=None,
        metavar="PATH",
        help="file holding the worker token that workers and the scheduler present to each other "
        "(or LLMSERVE_WORKER_TOKEN); `llmserve up` makes one for its own workers",
    )


def add_registry_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-registration", action="store_true", help="refuse every Register call: serve only the --worker addresses"
    )
    p.add_argument(
        "--worker-allow",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="an address registering workers may give (host:port, host, or unix:///path); repeat for several "
        "(default: any, as long as the worker token matches)",
    )
    p.add_argument(
        "--registration-timeout",
        type=float,
        default=120.0,
        help="seconds a registered rank may wait for the rest of its group before it is dropped (default 120)",
    )


def add_gateway_port_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gateway-port",
        type=int,
        default=0,
        help="a second port serving only the gateway protocol to smg, which sends no API key: its callers count as "
        "the gateway (admin). Bind it where only the gateway reaches it (default 0 = none)",
    )
    p.add_argument("--gateway-host", default="127.0.0.1", help="address of --gateway-port (default 127.0.0.1)")
    p.add_argument(
        "--registry-port",
        type=int,
        default=0,
        help="serve worker registration (llmserve.v1.Registry) on this port instead of --port, so a network policy "
        "can keep the worker plane apart (default 0 = on --port)",
    )
    p.add_argument("--registry-host", default="127.0.0.1", help="address of --registry-port (default 127.0.0.1)")


def add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Bounds on what one request may ask (common/config.py RequestLimits)."""
    p.add_argument("--max-prompt-bytes", type=at_least(1, int), default=1 << 20, help="prompt text, bytes (1 MiB)")
    p.add_argument("--max-tokenize-bytes", type=at_least(1, int), default=1 << 20, help="Tokenize text, bytes (1 MiB)")
    p.add_argument("--max-detokenize-tokens", type=at_least(1, int), default=1 << 18, help="Detokenize tokens (262144)")
    p.add_argument("--max-stop-string-length", type=at_least(1, int), default=256, help="characters (256)")
    p.add_argument("--max-stop-token-ids", type=at_least(0, int), default=64, help="per request (64)")
    p.add_argument("--max-logit-bias", type=at_least(0, int), default=1024, help="logit_bias entries (1024)")
    p.add_argument(
        "--max-grammar-bytes", type=at_least(1, int), default=64 << 10, help="schema, regex or grammar text (64 KiB)"
    )
    p.add_argument("--max-grammar-depth", type=at_least(1, int), default=32, help="JSON schema nesting (32)")
    p.add_argument(
        "--grammar-compile-timeout", type=at_least(0.001, float), default=10.0, help="seconds per compile (10)"
    )
    p.add_argument("--grammar-cache-mb", type=at_least(1, int), default=256, help="compiled grammars kept, MiB (256)")
    p.add_argument("--max-concurrent-rpcs", type=at_least(1, int), default=2048, help="RPCs in progress at once (2048)")
    p.add_argument(
        "--max-streams-per-connection", type=at_least(1, int), default=512, help="HTTP/2 streams per connection (512)"
    )
