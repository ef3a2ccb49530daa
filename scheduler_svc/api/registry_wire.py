"""The Registry protocol's protobuf edge (`llmserve.v1.Registry`, what worker ranks join
through): kept apart from the Generation API's edge, which clients call, not workers. Field
bounds are the registry's (scheduler_svc/workers/worker_registry.py); this only maps fields."""

from __future__ import annotations

from common.pb.llmserve.v1 import registry_pb2 as reg_pb
from scheduler_svc.workers.worker_registry import Registration


def registration(msg: reg_pb.RegisterRequest) -> Registration:
    return Registration(
        address=msg.address,
        group=msg.group or msg.address,
        rank=msg.rank,
        world_size=msg.world_size or 1,
        model_name=msg.model_name,
        block_size=msg.block_size,
    )


def register_reply(accepted: bool, message: str) -> reg_pb.RegisterReply:
    return reg_pb.RegisterReply(accepted=accepted, message=message)
