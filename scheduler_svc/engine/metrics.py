"""Prometheus metrics of the scheduler, named after vLLM's with our prefix.

Each Engine has its own registry, so several services can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from scheduler_svc.engine.load import GroupLoad

_BYTES_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SchedulerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
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
        self.recovered = counter(
            "llmserve:requests_recovered", "Requests moved to another worker group after theirs was lost."
        )
        self.prompt_tokens = counter("llmserve:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("llmserve:generation_tokens", "Tokens generated.")
        self.ttft = histogram(
            "llmserve:time_to_first_token_seconds", "Arrival to first token, per request.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "llmserve:inter_token_latency_seconds", "Time between consecutive tokens of a request.", _SECONDS_BUCKETS
        )
        self.e2e = histogram(
            "llmserve:e2e_request_latency_seconds", "Arrival to last message, per request.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "llmserve:request_queue_time_seconds", "Arrival to first scheduled step, per request.", _LATENCY_BUCKETS
        )
        self.plan_bytes = histogram("llmserve:step_plan_bytes", "Encoded size of each step plan.", _BYTES_BUCKETS)
        self.roundtrip = histogram(
            "llmserve:step_roundtrip_seconds", "Plan sent to result received, per step.", _SECONDS_BUCKETS
        )
        self.steps = counter("llmserve:steps", "Steps executed (all worker groups).")
        self.planned_ahead = counter(
            "llmserve:steps_planned_ahead", "Steps planned and sent while the step before them still ran."
        )
        # Where step time goes, by part: the scheduler's own (plan_build, plan_encode, transport,
        # result_decode, update) always; the worker's (worker_svc.step.step_profile) when it profiles.
        self._step_parts = Counter(
            "llmserve:step_part_seconds", "Seconds spent in each part of the steps.", ["model_name", "part"], registry=r
        )
        self._part_children: dict[str, Counter] = {}
        # LoRA: per adapter (labelled with its name), and the slot loads of every worker group.
        by_adapter = ["model_name", "adapter"]
        self._adapter_requests = Counter(
            "llmserve:adapter_requests", "Requests admitted, per LoRA adapter.", by_adapter, registry=r
        )
        self._adapter_tokens = Counter(
            "llmserve:adapter_generation_tokens", "Tokens generated, per LoRA adapter.", by_adapter, registry=r
        )
        self.adapter_loads = counter(
            "llmserve:adapter_slot_loads", "LoRA adapters put into a worker group's device slot."
        )

        # Speculative decoding, per drafting method: drafts sent for verification, drafts kept, and
        # the kept share since start.
        by_method = ["model_name", "method"]
        self._spec = {
            name: kind(f"llmserve:spec_decode_{name}", doc, by_method, registry=r)
            for kind, name, doc in (
                (Counter, "draft_tokens", "Draft tokens sent to the workers for verification."),
                (Counter, "accepted_tokens", "Draft tokens the model accepted."),
                (Gauge, "acceptance_rate", "Accepted draft tokens over drafted ones, since start (0-1)."),
            )
        }

        # Per worker group (data-parallel replica), labelled with its name.
        by_group = ["model_name", "group"]
        self._group_gauges = {
            field: Gauge(f"llmserve:group_{name}", doc, by_group, registry=r)
            for field, name, doc in (
                ("running", "num_requests_running", "Requests running on the worker group."),
                ("waiting", "num_requests_waiting", "Requests routed to the worker group and waiting there."),
                ("swapped", "num_requests_swapped", "Requests of the worker group swapped out to its host memory."),
                ("num_gpu_blocks", "gpu_blocks", "Device KV blocks of the worker group."),
                ("free_gpu_blocks", "free_gpu_blocks", "Free device KV blocks of the worker group."),
                (
                    "tokens_per_second",
                    "tokens_per_second",
                    "Tokens the worker group computes per second of step time, recent steps weighing most.",
                ),
            )
        }
        self._groups: dict[str, _GroupGauges] = {}

    def add_step_parts(self, parts: dict[str, float]) -> None:
        for part, seconds in parts.items():
            child = self._part_children.get(part)
            if child is None:
                child = self._part_children[part] = self._step_parts.labels(self.model_name, part)
            child.inc(seconds)

    def adapter_requests(self, adapter: str) -> Counter:
        return self._adapter_requests.labels(self.model_name, adapter)

    def adapter_tokens(self, adapter: str) -> Counter:
        return self._adapter_tokens.labels(self.model_name, adapter)

    def group(self, name: str) -> _GroupGauges:
        """The group's gauges; set every step, so the labelled children are looked up once."""
        gauges = self._groups.get(name)
        if gauges is None:
            gauges = self._groups[name] = _GroupGauges(
                {f: g.labels(self.model_name, name) for f, g in self._group_gauges.items()}
            )
        return gauges

    def group_names(self) -> set[str]:
        return set(self._groups)

    def remove_group(self, name: str) -> None:
        """A group that left stops being reported (not frozen at its last values)."""
        self._groups.pop(name, None)
        for gauge in self._group_gauges.values():
            try:
                gauge.remove(self.model_name, name)
            except KeyError:
                pass

    def speculation(self, method: str, drafted: int, accepted: int, rate: float) -> None:
        """Drafted and accepted tokens since the last call, and the acceptance rate so far."""
        labels = (self.model_name, method)
        self._spec["draft_tokens"].labels(*labels).inc(drafted)
        self._spec["accepted_tokens"].labels(*labels).inc(accepted)
        self._spec["acceptance_rate"].labels(*labels).set(rate)  # type: ignore[union-attr]

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)


class _GroupGauges:
    def __init__(self, gauges: dict[str, Gauge]) -> None:
        self._gauges = gauges

    def set(self, load: GroupLoad) -> None:
        for field, gauge in self._gauges.items():
            gauge.set(getattr(load, field))
