"""Prometheus metrics of both services, scraped over HTTP while requests run and after."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from pathlib import Path

import grpc

from common.config import SchedulerConfig, ServerConfig
from common.pb.llmserve.v1 import generation_pb2_grpc
from tests.conftest import collect, free_port, request, start_worker
from tests.engine_state import first_scheduler

LABEL = 'model_name="tiny-llama"'


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def value(text: str, name: str, labels: str = LABEL) -> float:
    """The sample `name{labels}`; labels match as a set, whatever order the exporter prints."""
    want = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) == want:
            return float(match.group(2))
    raise AssertionError(f"{name}{{{labels}}} not exported")


async def test_scheduler_and_worker_metrics_move_and_return_to_idle(tiny_model_dir: Path) -> None:
    from scheduler_svc.api.server import SchedulerServer

    worker_metrics = free_port()
    worker = start_worker(
        tiny_model_dir, "--num-gpu-blocks", "64", "--metrics-port", str(worker_metrics), "--profile-steps"
    )
    metrics_port = free_port()
    server = SchedulerServer(
        str(tiny_model_dir),
        worker.address,
        ServerConfig(port=0, metrics_port=metrics_port),
        SchedulerConfig(),
        step_timeout=60.0,
    )
    port = await server.start()
    try:
        while not server.engine.ready:
            await asyncio.sleep(0.05)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            long = stub.Generate(request(ids=[5, 6, 7], max_tokens=300, ignore_eos=True))
            await long.read()
            busy = scrape(metrics_port)
            assert value(busy, "llmserve:num_requests_running") == 1
            assert value(busy, "llmserve:kv_cache_usage_perc") > 0
            long.cancel()
            prompt = [100 + k for k in range(40)]
            for _ in range(2):
                await collect(stub, request(ids=prompt, max_tokens=5, ignore_eos=True))
            try:
                await collect(stub, request(ids=[], max_tokens=5))
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        deadline = time.monotonic() + 5
        while first_scheduler(server.engine).has_work and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        idle = scrape(metrics_port)
        for gauge in (
            "llmserve:num_requests_running",
            "llmserve:num_requests_waiting",
            "llmserve:num_requests_swapped",
            "llmserve:kv_cache_usage_perc",
            "llmserve:cpu_cache_usage_perc",
        ):
            assert value(idle, gauge) == 0, gauge
        assert value(idle, "llmserve:prompt_tokens_total") == 83
        assert value(idle, "llmserve:generation_tokens_total") >= 11
        assert value(idle, "llmserve:prefix_cache_queries_total") == 83
        assert value(idle, "llmserve:prefix_cache_hits_total") == 32  # the repeat: 2 full blocks of 16
        assert value(idle, "llmserve:num_preemptions_total") == 0
        # The long request's decodes were planned while the step before them ran.
        assert value(idle, "llmserve:steps_planned_ahead_total") > 0
        for hist in ("llmserve:time_to_first_token_seconds", "llmserve:request_queue_time_seconds"):
            assert value(idle, hist + "_count") == 3, hist
        assert value(idle, "llmserve:e2e_request_latency_seconds_count") == 2  # of finished requests, not cancelled
        assert value(idle, "llmserve:inter_token_latency_seconds_count") >= 8
        assert (
            value(idle, "llmserve:step_plan_bytes_count") > 0
            and value(idle, "llmserve:step_roundtrip_seconds_count") > 0
        )
        grpc_labels = 'grpc_type="server_stream",grpc_service="llmserve.v1.Generation",grpc_method="Generate"'
        assert value(idle, "grpc_server_started_total", grpc_labels) == 4
        assert value(idle, "grpc_server_handled_total", grpc_labels + ',grpc_code="OK"') == 2
        assert value(idle, "grpc_server_handled_total", grpc_labels + ',grpc_code="InvalidArgument"') == 1
        assert value(idle, "grpc_server_handled_total", grpc_labels + ',grpc_code="Canceled"') == 1
        assert value(idle, "grpc_server_msg_sent_total", grpc_labels) >= 11

        w = scrape(worker_metrics)
        wl = 'model_name="tiny-llama",rank="0"'
        assert value(w, "llmserve_worker:steps_total", wl) > 0
        # Where the steps' time went: the scheduler's parts always, the worker's as it profiles.
        steps = value(idle, "llmserve:steps_total")
        assert steps == value(w, "llmserve_worker:steps_total", wl)
        parts = {
            p: value(idle, "llmserve:step_part_seconds_total", f'{LABEL},part="{p}"')
            for p in (
                "plan_build",
                "plan_encode",
                "transport",
                "result_decode",
                "update",
                "plan_decode",
                "prepare",
                "embed",
                "linear",
                "attention",
                "norm_act",
                "forward_other",
                "lm_head",
                "sampling",
            )
        }
        assert all(v > 0 for v in parts.values()), parts
        worker_busy = value(w, "llmserve_worker:step_execute_seconds_sum", wl)
        inside = sum(
            parts[p]
            for p in ("prepare", "embed", "linear", "attention", "norm_act", "forward_other", "lm_head", "sampling")
        )
        assert inside <= worker_busy * 1.01  # parts of the worker's own time, not more
        assert value(w, "llmserve_worker:num_gpu_blocks", wl) == 64
        assert value(w, "llmserve_worker:step_execute_seconds_count", wl) == value(w, "llmserve_worker:steps_total", wl)
        bidi = 'grpc_type="bidi_stream",grpc_service="llmserve.v1.Worker",grpc_method="Execute"'
        assert value(w, "grpc_server_started_total", bidi) == 1
        assert value(w, "grpc_server_msg_received_total", bidi) == value(w, "llmserve_worker:steps_total", wl)
    finally:
        await server.stop()
        worker.stop()
