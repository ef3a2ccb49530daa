"""The gateway protocol's state calls (`vllm.grpc.engine.VllmEngine`): health, model and
server info, loads, the tokenizer archive. Apart from the Generate edge (vllm_wire.py)
because the gateway polls these about the engine as a whole, not about one request.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from scheduler_svc.engine.load import GroupActivity, ModelInfo
from scheduler_svc.text.tokenizer_bundle import TokenizerBundle

SERVER_TYPE = "llmserve"
TOKENIZER_CHUNK_BYTES = 64 * 1024  # well under gRPC's default 4 MiB message limit


def health(ready: bool, draining: bool) -> pb.HealthCheckResponse:
    if draining:
        return pb.HealthCheckResponse(healthy=False, message="draining: the server is shutting down")
    if not ready:
        return pb.HealthCheckResponse(healthy=False, message="no ready worker: warming up, or the worker is down")
    return pb.HealthCheckResponse(healthy=True, message="serving")


def model_info(
    info: ModelInfo, model_path: str, model_type: str, architectures: Sequence[str], bos: int | None, pad: int | None
) -> pb.GetModelInfoResponse:
    limits = info.limits
    return pb.GetModelInfoResponse(
        model_path=model_path,
        is_generation=True,
        max_context_length=info.max_model_len,
        vocab_size=info.vocab_size,
        supports_vision=False,
        served_model_name=info.model_name,
        tokenizer_path=model_path,
        model_type=model_type,
        architectures=list(architectures),
        eos_token_ids=list(info.eos_token_ids),
        pad_token_id=pad or 0,
        bos_token_id=bos or 0,
        # A prompt must leave room for at least one generated token.
        max_req_input_len=limits.max_prompt_tokens or info.max_model_len - 1,
        # Requests get no defaults from generation_config.json: nothing to report.
        default_sampling_params_json="",
    )


def server_info(
    active_requests: int,
    draining: bool,
    last_receive_timestamp: float,
    uptime_seconds: float,
    block_size: int,
    max_num_seqs: int,
    model_dtype: str,
) -> pb.GetServerInfoResponse:
    return pb.GetServerInfoResponse(
        active_requests=active_requests,
        is_paused=draining,
        last_receive_timestamp=last_receive_timestamp,
        uptime_seconds=uptime_seconds,
        server_type=SERVER_TYPE,
        # The scheduler balances its worker groups itself: to a gateway it is one engine.
        data_parallel_size=1,
        block_size=block_size,
        model_dtype=model_dtype,
        max_num_seqs=max_num_seqs,
    )


def loads(activity: Sequence[GroupActivity], dp_rank: int | None, timestamp: str, version: str) -> pb.GetLoadsResponse:
    """One SchedulerLoad per worker group (`dp_rank` = its position among the serving groups)."""
    ranked = [(rank, a) for rank, a in enumerate(activity) if dp_rank is None or rank == dp_rank]
    return pb.GetLoadsResponse(
        timestamp=timestamp,
        version=version,
        dp_rank_count=len(activity),
        loads=[_scheduler_load(rank, a) for rank, a in ranked],
    )


def _scheduler_load(rank: int, a: GroupActivity) -> pb.SchedulerLoad:
    g = a.load
    used = g.num_gpu_blocks - g.free_gpu_blocks  # cached prefix blocks count as free
    return pb.SchedulerLoad(
        dp_rank=rank,
        num_running_reqs=g.running,
        num_waiting_reqs=g.waiting + g.swapped,
        num_total_reqs=g.running + g.waiting + g.swapped,
        num_used_tokens=used * a.block_size,
        max_total_num_tokens=g.num_gpu_blocks * a.block_size,
        token_usage=used / g.num_gpu_blocks if g.num_gpu_blocks else 0.0,
        gen_throughput=a.output_tokens_per_s,
        cache_hit_rate=a.prefix_hit_tokens / a.prefix_queried_tokens if a.prefix_queried_tokens else 0.0,
        utilization=g.running / a.max_running if a.max_running else 0.0,
        max_running_requests=a.max_running,
        num_waiting_uncached_tokens=a.waiting_uncached_tokens,
    )


def tokenizer_chunks(
    bundle: TokenizerBundle, size: int = TOKENIZER_CHUNK_BYTES
) -> Iterator[common_pb2.GetTokenizerChunk]:
    """The zip in pieces; the last one carries the SHA-256 of the whole archive."""
    data = bundle.data
    for start in range(0, len(data), size):
        last = start + size >= len(data)
        yield common_pb2.GetTokenizerChunk(data=data[start : start + size], sha256=bundle.sha256 if last else "")
