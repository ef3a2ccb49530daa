"""The gateway protocol's prefix-cache calls (`vllm.grpc.engine.VllmEngine`): the flush
reply and the stream of cache events a cache-aware router follows. Apart from the Generate
edge (vllm_wire.py) because they speak of the engine's KV blocks, not of requests.
"""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2

from scheduler_svc.engine.kv_event_log import CacheCleared, KvBatch
from scheduler_svc.kv.kv_events import BlockRemoved, BlockStored


def flush_response(forgotten: int, busy_groups: int, in_flight: int) -> common_pb2.FlushCacheResponse:
    if busy_groups:
        return common_pb2.FlushCacheResponse(
            success=False,
            message=f"{in_flight} requests in flight hold KV blocks: nothing was flushed in {busy_groups} worker "
            f"group(s) (set timeout_s to wait for them); {forgotten} cached blocks were flushed elsewhere",
        )
    return common_pb2.FlushCacheResponse(success=True, message=f"flushed {forgotten} cached prefix blocks")


def kv_batch(batch: KvBatch, token_ids: bool = False) -> common_pb2.KvEventBatch:
    """A batch of cache events; consecutive stores of one chain share a KvBlocksStored.

    The blocks' token ids are pieces of other callers' prompts: only with `token_ids`
    (vllm_servicer decides who sees them); without, a block is its hash and size."""
    events: list[common_pb2.KvCacheEvent] = []
    chain: list[BlockStored] = []

    def close_chain() -> None:
        if chain:
            stored = common_pb2.KvBlocksStored(
                blocks=[
                    common_pb2.KvBlock(
                        block_hash=s.block_hash,
                        token_ids=[int(t) for t in s.token_ids] if token_ids else [],
                        block_size=len(s.token_ids),
                    )
                    for s in chain
                ],
                tier=common_pb2.KV_CACHE_TIER_DEVICE,
            )
            if chain[0].parent_hash is not None:
                stored.parent_block_hash = chain[0].parent_hash
            events.append(common_pb2.KvCacheEvent(stored=stored))
            chain.clear()

    for event in batch.events:
        if isinstance(event, BlockStored):
            if chain and event.parent_hash != chain[-1].block_hash:
                close_chain()
            chain.append(event)
            continue
        close_chain()
        if isinstance(event, BlockRemoved):
            events.append(
                common_pb2.KvCacheEvent(
                    removed=common_pb2.KvBlocksRemoved(
                        block_hashes=[event.block_hash], tier=common_pb2.KV_CACHE_TIER_DEVICE
                    )
                )
            )
        elif isinstance(event, CacheCleared):
            events.append(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()))
    close_chain()
    return common_pb2.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp, events=events)
