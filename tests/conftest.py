"""Shared fixtures: model directories, real service processes, and a gRPC client."""

from __future__ import annotations

import os

# The suite runs two test files at once on as few as two cores, each starting workers whose
# OpenMP threads would otherwise spin between parallel regions (a worker serving alone
# should: see worker_svc/service/main_thread.py) and starve the other file's processes. Set before
# torch loads libgomp, so it holds here too, and inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Without CUDA the Triton kernels run in Triton's interpreter. It is chosen when a kernel is
# defined, so the variable must be set before anything imports a kernel module.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import asyncio
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from common import log as logsetup
from common.config import SchedulerConfig, ServerConfig
from common.pb.llmserve.v1 import generation_pb2 as pb
from common.pb.llmserve.v1 import generation_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
logsetup.configure("warning", json=False)


# Where the Triton kernels run in tests: the GPU when there is one, else the interpreter on CPU.
KERNEL_DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full-kernels", action="store_true", help="run the whole kernel test grid (slow without CUDA)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from llmserve.cli.configs import cache_root
    from llmserve.model_prep import prepare_default_model

    return prepare_default_model(cache_root())


def make_tiny_model(
    out: Path, tokenizer_from: Path, config_cls: Any = None, model_cls: Any = None, **overrides: object
) -> Path:
    """A random-weight Llama (or the family `config_cls` / `model_cls` name) with SmolLM2's
    tokenizer: fast, and real files end to end.

    initializer_range is large so the logits are peaked: greedy choices then do not hinge on
    rounding, and different computation orders (recompute vs decode) agree.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config_cls, model_cls = config_cls or LlamaConfig, model_cls or LlamaForCausalLM

    params: dict[str, object] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
    )
    params.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**params)).float()
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


def transformers_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy float32 continuation of each prompt, `new_tokens` long (no EOS stop):
    the reference outputs are compared with."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", smollm2_dir)


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[bytes]
    address: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def llmserve_command(command: str, model_dir: Path, *extra: str, dtype: str = "float32") -> list[str]:
    """`llmserve COMMAND` on the CPU for `model_dir`, as the tests start it (warnings only)."""
    cli = [sys.executable, "-m", "llmserve.cli", "--log-level", "warning", command]
    return [*cli, "--model", str(model_dir), "--dtype", dtype, "--device", "cpu", *extra]


def start_worker(model_dir: Path, *extra: str, dtype: str = "float32") -> WorkerProcess:
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(llmserve_command("worker", model_dir, "--listen", address, *extra, dtype=dtype), cwd=REPO)
    return WorkerProcess(proc, address)


@pytest.fixture(scope="session")
def tiny_worker(tiny_model_dir: Path) -> Iterator[WorkerProcess]:
    """One worker for the whole session (a start costs seconds): the worker keeps no state
    between schedulers, so each test's scheduler starts from a fresh pool on it."""
    worker = start_worker(tiny_model_dir, "--num-gpu-blocks", "64")
    yield worker
    worker.stop()


@dataclass
class Scheduler:
    """An in-process scheduler service on a real port, for tests that inspect its state."""

    server: object
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationStub
    port: int

    @property
    def engine(self):  # type: ignore[no-untyped-def]
        return self.server.engine  # type: ignore[attr-defined]

    async def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.engine.ready:
            if time.monotonic() > deadline:
                raise TimeoutError("scheduler never became ready")
            await asyncio.sleep(0.05)

    async def wait_idle(self, timeout: float = 5.0) -> None:
        """Every request gone and every KV block of every worker group back in its free pool
        (integrity checked)."""
        deadline = time.monotonic() + timeout
        while True:
            busy = [r for r in self.engine.replicas if not _replica_idle(r)]
            if not busy and not self.engine._streams:
                break
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not idle after {timeout}s: streams={len(self.engine._streams)} "
                    + " ".join(f"{r.name}: {r.load()}" for r in busy)
                )
            await asyncio.sleep(0.02)
        for replica in self.engine.replicas:
            replica.scheduler.check_integrity()


def _replica_idle(replica) -> bool:  # type: ignore[no-untyped-def]
    sched = replica.scheduler
    bm = sched.block_manager
    return (
        not sched.has_work
        and not replica.inbox
        and bm.num_free_blocks == bm.num_blocks
        and bm.host.num_free == bm.host.num_blocks
    )


async def wait_serving(channel: grpc.aio.Channel, timeout: float = 60.0) -> None:
    """Poll the standard health service until the server behind `channel` says SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if (
                await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
            ).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        assert time.monotonic() < deadline, "the server never became SERVING"
        await asyncio.sleep(0.2)


async def start_scheduler(model_dir: Path, worker_address: str, **config: int) -> Scheduler:
    from scheduler_svc.api.server import SchedulerServer

    server = SchedulerServer(
        str(model_dir),
        worker_address,
        ServerConfig(host="127.0.0.1", port=0),
        SchedulerConfig(**config),
        step_timeout=60.0,
    )
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return Scheduler(server, channel, generation_pb2_grpc.GenerationStub(channel), port)


async def stop_scheduler(s: Scheduler) -> None:
    await s.channel.close()
    await s.server.stop()  # type: ignore[attr-defined]


@pytest.fixture
async def tiny_scheduler(tiny_model_dir: Path, tiny_worker: WorkerProcess) -> AsyncIterator[Scheduler]:
    """Scheduler over the module's tiny worker; afterwards every block must be free."""
    s = await start_scheduler(tiny_model_dir, tiny_worker.address)
    await s.wait_ready()
    try:
        yield s
        await s.wait_idle()
    finally:
        await stop_scheduler(s)


def request(
    prompt: str = "", ids: list[int] | None = None, max_tokens: int = 8, **stopping_and_sampling: object
) -> pb.GenerateRequest:
    sampling_keys = {
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "n",
        "best_of",
        "beam_width",
        "length_penalty",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "prompt_logprobs",
        "logit_bias",
    }
    priority = int(stopping_and_sampling.pop("priority", 0))  # type: ignore[call-overload]
    sampling = {k: v for k, v in stopping_and_sampling.items() if k in sampling_keys}
    stopping = {k: v for k, v in stopping_and_sampling.items() if k not in sampling_keys}
    return pb.GenerateRequest(
        prompt=prompt,
        prompt_token_ids=ids or [],
        sampling=pb.SamplingParams(**sampling),  # type: ignore[arg-type]
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, **stopping),  # type: ignore[arg-type]
        priority=priority,
    )


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    messages: list[pb.GenerateResponse]

    @property
    def final(self) -> pb.GenerateResponse:
        return self.messages[-1]


async def collect(stub: generation_pb2_grpc.GenerationStub, req: pb.GenerateRequest) -> Generation:
    messages = [m async for m in stub.Generate(req)]
    return Generation([t for m in messages for t in m.token_ids], "".join(m.text for m in messages), messages)


def run_benchmark(script: str | Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """A benchmark script run as a user runs it, from the repository root; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, str(script), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def skip_without_cuda() -> pytest.MarkDecorator:
    import torch

    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
