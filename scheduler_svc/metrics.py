"""Prometheus metrics of the scheduler, named after vLLM's with our prefix.

Each Engine has its own registry, so several services can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_BYTES_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SchedulerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("llmserve:num_requests_running", "Requests in the running queue.")
        self.waiting = gauge("llmserve:num_requests_waiting", "Requests in the waiting queue.")
        self.swapped = gauge("llmserve:num_requests_swapped", "Requests swapped out to host memory.")
        self.kv_usage = gauge("llmserve:kv_cache_usage_perc", "Fraction of device KV blocks in use (0-1).")
        self.cpu_usage = gauge("llmserve:cpu_cache_usage_perc", "Fraction of host swap blocks in use (0-1).")
        self.preemptions = counter("llmserve:num_preemptions", "Requests preempted (swap or recompute).")
        self.prefix_queries = counter("llmserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("llmserve:prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_tokens = counter("llmserve:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("llmserve:generation_tokens", "Tokens generated.")
        self.ttft = histogram(
            "llmserve:time_to_first_token_seconds", "Arrival to first token, per request.", _LATENCY_BUCKETS
        )
        self.itl = histogram("llmserve:inter_token_latency_seconds", "Time between consecutive tokens of a request.", _SECONDS_BUCKETS)
        self.e2e = histogram("llmserve:e2e_request_latency_seconds", "Arrival to last message, per request.", _LATENCY_BUCKETS)
        self.queue_time = histogram(
            "llmserve:request_queue_time_seconds", "Arrival to first scheduled step, per request.", _LATENCY_BUCKETS
        )
        self.plan_bytes = histogram("llmserve:step_plan_bytes", "Encoded size of each step plan.", _BYTES_BUCKETS)
        self.roundtrip = histogram(
            "llmserve:step_roundtrip_seconds", "Plan sent to result received, per step.", _SECONDS_BUCKETS
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
