"""The role of each RPC the scheduler's port serves (common/grpc/auth.py checks callers by it).

Admin RPCs change or reveal what all callers share: the adapters served, the prefix cache and
its contents, profiling. Registry is the worker plane. The health check stays open, for
probes; reflection and Health/Watch are client RPCs (open only where no key is configured);
`--no-reflection` turns reflection off.
"""

from __future__ import annotations

from common.grpc.auth import PROBE, Role
from common.pb.llmserve.v1 import generation_pb2, registry_pb2
from scheduler_svc.api import vllm_servicer

_GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_REGISTRY = registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name

ADMIN_METHODS = frozenset(
    {
        f"/{_GENERATION}/LoadAdapter",
        f"/{_GENERATION}/UnloadAdapter",
        f"/{vllm_servicer.SERVICE_NAME}/FlushCache",
        f"/{vllm_servicer.SERVICE_NAME}/SubscribeKvEvents",
        f"/{vllm_servicer.SERVICE_NAME}/StartProfile",
        f"/{vllm_servicer.SERVICE_NAME}/StopProfile",
    }
)


def role_of(method: str) -> Role:
    if method == PROBE:
        return Role.OPEN
    if method.startswith(f"/{_REGISTRY}/"):
        return Role.WORKER
    if method in ADMIN_METHODS:
        return Role.ADMIN
    return Role.CLIENT
