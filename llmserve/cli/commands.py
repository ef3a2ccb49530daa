"""The smaller `llmserve` commands (scheduler, gateway, generate, prepare-model), and how a
command runs its services until SIGINT or SIGTERM.

`up` (up.py) and `worker` (worker.py) are larger and have modules of their own; they stop
their services the same way, through `run_until_signal` and `serve` here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from llmserve.cli import configs
from llmserve.gateway import Gateway, smg_executable


def run_until_signal(body: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run `body(stop)` in an event loop; SIGINT and SIGTERM set `stop`."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await body(stop)

    asyncio.run(main())


class Service(Protocol):
    """A scheduler or worker server, as `serve` drives it."""

    async def start(self) -> int: ...
    async def stop(self) -> None: ...


async def serve(server: Service, stop: asyncio.Event) -> None:
    """Start `server`, then stop it (it drains what is in flight) once `stop` is set."""
    await server.start()
    try:
        await stop.wait()
    finally:
        await server.stop()


def cmd_scheduler(a: argparse.Namespace) -> None:
    from scheduler_svc.api.server import SchedulerServer

    server_config, worker_tls = configs.server_config(a), configs.client_tls_config(a, "worker")
    registry_config = configs.registry_config(a)
    model = configs.model_dir(a.model)

    async def body(stop: asyncio.Event) -> None:
        # gRPC aio objects belong to the running loop: build the server inside it.
        server = SchedulerServer(
            model,
            a.worker,
            server_config,
            configs.scheduler_config(a),
            step_timeout=a.step_timeout,
            worker_tls=worker_tls,
            health_interval=a.worker_health_interval,
            registry_config=registry_config,
            served_name=a.served_model_name,
        )
        await serve(server, stop)

    run_until_signal(body)


def cmd_gateway(a: argparse.Namespace) -> None:
    config = configs.gateway_config(a)
    executable = smg_executable()
    configs.check_gateway_ports(config)

    async def body(stop: asyncio.Event) -> None:
        gateway = Gateway(config, executable)
        gateway.start()
        try:
            while not stop.is_set():
                gateway.restart_if_dead()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
        finally:
            await asyncio.to_thread(gateway.stop)

    run_until_signal(body)


def cmd_generate(a: argparse.Namespace) -> None:
    import grpc

    from common.grpc.auth import bearer_metadata
    from common.pb.llmserve.v1 import generation_pb2 as pb
    from common.pb.llmserve.v1 import generation_pb2_grpc

    if a.system is not None and not a.chat:
        raise ValueError("--system needs --chat")
    sampling = pb.SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    if a.seed is not None:
        sampling.seed = a.seed
    request = pb.GenerateRequest(
        sampling=sampling,
        stopping=pb.StoppingCriteria(max_tokens=a.max_tokens, stop=a.stop, ignore_eos=a.ignore_eos),
    )
    if a.chat:
        if a.system is not None:
            request.messages.add(role="system", content=a.system)
        request.messages.add(role="user", content=a.prompt)
    else:
        request.prompt = a.prompt
    with grpc.insecure_channel(a.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        last = None
        try:
            for last in stub.Generate(request, metadata=bearer_metadata(a.api_key)):
                sys.stdout.write(last.text)
                sys.stdout.flush()
        except grpc.RpcError as error:
            sys.stdout.write("\n")
            sys.exit(f"error: {error.code().name}: {_flag_names(error.details() or '')}")
    sys.stdout.write("\n")
    if last is not None:
        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        print(
            f"[{last.prompt_tokens} prompt tokens, {last.completion_tokens} generated, finish: {reason}]",
            file=sys.stderr,
        )


# The request fields `generate` sets, by the flag that sets them: the server's errors name fields.
_GENERATE_FLAGS = {
    "sampling.temperature": "--temperature",
    "sampling.top_p": "--top-p",
    "sampling.top_k": "--top-k",
    "sampling.seed": "--seed",
    "stopping.max_tokens": "--max-tokens",
    "stopping.stop": "--stop",
    "messages": "--chat",
    "prompt": "prompt",
}


def _flag_names(details: str) -> str:
    """The server's message, with the flag beside each request field it names."""
    for field, flag in _GENERATE_FLAGS.items():
        if details.startswith(f"{field}:") or details.startswith(f"{field}["):
            return f"{flag} ({details})"
    return details


def cmd_prepare_model(a: argparse.Namespace) -> None:
    from llmserve.model_prep import prepare_default_model

    print(prepare_default_model(configs.cache_root()))
