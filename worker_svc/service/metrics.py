"""Prometheus metrics of a worker (its own HTTP port, `llmserve worker --metrics-port`).

The scheduler's metrics describe requests; these describe the device side of each step, so
a slow step can be told apart from a slow network or a slow scheduler.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from common.grpc.server_metrics import GrpcMetricsInterceptor
from common.plan import StepPlan

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class WorkerMetrics:
    def __init__(self, model_name: str, rank: int = 0) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "rank"]
        values = (model_name, str(rank))
        r = self.registry
        self.execute = Histogram(
            "llmserve_worker:step_execute_seconds",
            "Plan checks, block ops, forward and sampling, per step.",
            labels,
            buckets=_SECONDS,
            registry=r,
        ).labels(*values)
        self.steps = Counter("llmserve_worker:steps", "Steps executed.", labels, registry=r).labels(*values)
        self.tokens = Counter(
            "llmserve_worker:input_tokens", "Tokens fed through the model.", labels, registry=r
        ).labels(*values)
        self.sampled = Counter("llmserve_worker:sampled_tokens", "Tokens sampled.", labels, registry=r).labels(*values)
        swapped = Counter(
            "llmserve_worker:block_ops", "KV blocks moved by plan operations.", [*labels, "op"], registry=r
        )
        self.block_ops = {op: swapped.labels(*values, op) for op in ("swap_out", "swap_in", "copy")}
        self.gpu_blocks = Gauge("llmserve_worker:num_gpu_blocks", "Device KV blocks held.", labels, registry=r).labels(
            *values
        )
        self.cpu_blocks = Gauge("llmserve_worker:num_cpu_blocks", "Host swap blocks held.", labels, registry=r).labels(
            *values
        )
        self.grpc = GrpcMetricsInterceptor(r)

    def observe(self, plan: StepPlan, seconds: float) -> None:
        self.execute.observe(seconds)
        self.steps.inc()
        self.tokens.inc(plan.num_tokens)
        self.sampled.inc(int(plan.sample.sum()))
        for op in ("swap_out", "swap_in", "copy"):
            count = getattr(plan, op).shape[0]
            if count:
                self.block_ops[op].inc(count)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
