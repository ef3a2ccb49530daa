"""The OpenAI HTTP API: the real smg binary in front of real `llmserve up` processes.

One `llmserve up` (scheduler, worker and the gateway it starts) serves the whole module, next
to a second scheduler started with `--no-http`; the two then stand behind one `llmserve
gateway` for the cache-aware routing test. Requests go through the official `openai` client
and, where the wire itself is the point, plain HTTP. The native gRPC API of the same scheduler
is the reference: at temperature 0 the gateway must return its text.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.model_spec import ModelSpec
from common.pb.llmserve.v1 import generation_pb2 as pb
from llmserve.cli import configs
from llmserve.cli.parser import build_parser
from llmserve.client import LlmserveClient, generate_request
from llmserve.gateway import (
    KEYS_ENV,
    GatewayConfig,
    GatewayUnavailable,
    KubernetesDiscovery,
    smg_command,
    smg_executable,
    smg_process,
)
from tests.conftest import REPO
from tests.test_structured_output import SCHEMAS

MODEL = "tiny-chat"  # the served name: the model directory's name
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def distinct_ports(n: int) -> list[int]:
    """n free ports, all different (each socket stays bound until all are chosen)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None:
            assert proc.poll() is None, f"exited with {proc.returncode} while waiting for: {what}"
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def http(url: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    """(status, body) of a GET, or a POST of `body` as JSON."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus text exposition's samples called `name` that carry `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def is_smg(pid: int) -> bool:
    try:
        return b"smg" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Scheduler:
    """`llmserve up` on the tiny model: gRPC and metrics always, the HTTP gateway unless `http`
    is off. With `log`, its JSON log lines (and smg's) at level info go to that file."""

    def __init__(self, model_dir: Path, http: bool, log: Path | None = None) -> None:
        self.port, self.metrics_port, self.http_port, self.http_metrics_port = distinct_ports(4)
        self.log = log
        cmd = [
            sys.executable,
            "-m",
            "llmserve.cli",
            "--log-level",
            "info" if log else "warning",
            "up",
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--num-gpu-blocks",
            "256",
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
        ]
        cmd += (
            ["--http-port", str(self.http_port), "--http-metrics-port", str(self.http_metrics_port)]
            if http
            else ["--no-http"]
        )
        self.http = http
        self.address = f"127.0.0.1:{self.port}"
        with ExitStack() as files:
            # Appending: up's workers and smg write to the same file, and with a shared offset
            # one process's line could land over another's (two lines ran into one).
            stderr = files.enter_context(open(log, "a")) if log else None
            self.proc = subprocess.Popen(cmd, cwd=REPO, stderr=stderr, env={**os.environ, "LLMSERVE_LOG_JSON": "1"})

    def events(self) -> list[str]:
        """Our own log lines' events, in order (smg's JSON lines have no "event")."""
        assert self.log is not None
        lines = (json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{"))
        return [line["event"] for line in lines if "event" in line]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def serving(self) -> bool:
        with grpc.insecure_channel(self.address) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError:
                return False
        return status == health_pb2.HealthCheckResponse.SERVING

    def wait_ready(self, timeout: float = 180.0) -> None:
        wait_until(self.serving, timeout, f"scheduler {self.address} SERVING", self.proc)
        if self.http:
            wait_until(lambda: http(f"{self.base_url}/readiness")[0] == 200, 60, "gateway /readiness 200", self.proc)

    def metrics(self) -> str:
        return http(f"http://127.0.0.1:{self.metrics_port}/metrics")[1]

    def idle(self) -> bool:
        """No request anywhere and every KV block of every worker group free (cached prefix
        blocks count as free, as in tests/conftest.py's wait_idle)."""
        text = self.metrics()
        return (
            metric(text, "llmserve:num_requests_running") == 0
            and metric(text, "llmserve:num_requests_waiting") == 0
            and metric(text, "llmserve:group_gpu_blocks") > 0
            and metric(text, "llmserve:group_free_gpu_blocks") == metric(text, "llmserve:group_gpu_blocks")
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir: Path, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with SmolLM2's chat template: the gateway renders chats itself."""
    out = tmp_path_factory.mktemp("gateway") / MODEL
    shutil.copytree(tiny_model_dir, out)
    shutil.copy(smollm2_dir / "chat_template.jinja", out / "chat_template.jinja")
    return out


@pytest.fixture(scope="module")
def schedulers(chat_model_dir: Path) -> Iterator[tuple[Scheduler, Scheduler]]:
    """(`up` with its gateway, a second `up --no-http`), started together to share the wait."""
    log = chat_model_dir.parent / "up.log"
    pair = (Scheduler(chat_model_dir, http=True, log=log), Scheduler(chat_model_dir, http=False))
    try:
        for s in pair:
            s.wait_ready()
        yield pair
    finally:
        for s in pair:
            s.stop()


@pytest.fixture(scope="module")
def up(schedulers: tuple[Scheduler, Scheduler]) -> Scheduler:
    return schedulers[0]


@pytest.fixture(scope="module")
def client(up: Scheduler) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{up.base_url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def native(up: Scheduler) -> Iterator[LlmserveClient]:
    with LlmserveClient(up.address) as c:
        yield c


# ---- the OpenAI API ----


def test_a_completion_over_plain_http(up: Scheduler, native: LlmserveClient) -> None:
    status, body = http(f"{up.base_url}/v1/completions", {"model": MODEL, "prompt": "你好，世界", "max_tokens": 50})
    assert status == 200, body
    answer = json.loads(body)
    assert answer["object"] == "text_completion" and answer["model"] == MODEL
    (choice,) = answer["choices"]
    assert isinstance(choice["text"], str) and choice["text"]
    assert choice["finish_reason"] in ("length", "stop")
    usage = answer["usage"]
    # The gateway tokenizes the prompt itself, exactly as the scheduler does.
    assert usage["prompt_tokens"] == len(native.tokenize("你好，世界").token_ids)
    assert 1 <= usage["completion_tokens"] <= 50
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("prompt", ["The capital of France is", "你好，世界", "def fibonacci(n):\n    "])
def test_greedy_completions_equal_the_native_api_streamed_or_not(
    client: openai.OpenAI, native: LlmserveClient, prompt: str
) -> None:
    want = native.generate_text(prompt, max_tokens=24, temperature=0)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert whole.choices[0].text == want
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]


def test_greedy_chat_equals_the_native_api_streamed_or_not(client: openai.OpenAI, native: LlmserveClient) -> None:
    # The gateway renders the chat template with its own engine; the scheduler with ours.
    want = native.generate_text(messages=CHAT, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(native.tokenize(messages=CHAT).token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_n_2_gives_two_choices(client: openai.OpenAI) -> None:
    answer = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in answer.choices) == [0, 1]
    assert all(c.finish_reason == "length" and c.text for c in answer.choices)
    assert answer.usage is not None and answer.usage.completion_tokens == 16


def test_chat_logprobs_match_the_native_api(client: openai.OpenAI, native: LlmserveClient) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,  # type: ignore[arg-type]
    )
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert answer.usage is not None and len(content) == answer.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == choice.message.content
    request = generate_request(messages=CHAT, max_tokens=6, temperature=0)
    request.sampling.logprobs = 3
    reference = [lp for m in native.stream(request) for lp in m.logprobs]
    assert len(reference) == 6
    for got, want in zip(content, reference):
        assert len(got.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert got.top_logprobs[0].token == got.token and got.top_logprobs[0].logprob == pytest.approx(got.logprob)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([t.logprob for t in want.top], abs=1e-4)


def test_completions_logprobs_are_computed_but_not_returned_by_smg(client: openai.OpenAI) -> None:
    """smg 1.13 forwards `logprobs` of /v1/completions to the scheduler (a scheduler started
    with --max-logprobs 1 refuses 5) but leaves them out of the response: docs/api.md says so."""
    answer = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    assert answer.choices[0].text and answer.choices[0].logprobs is None


def test_a_stop_string_ends_the_text_before_it(client: openai.OpenAI, native: LlmserveClient) -> None:
    prompt = "The capital of France is"
    full = native.generate_text(prompt, max_tokens=24, temperature=0)
    assert len(full) > 12
    stop = full[8:12]
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[: full.index(stop)]
    assert (choice.model_extra or {}).get("matched_stop") == stop


def test_the_same_seed_gives_the_same_text_at_temperature_1(client: openai.OpenAI, native: LlmserveClient) -> None:
    def sample(seed: int) -> str:
        answer = client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return answer.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first
    # The seed reaches the engine as it is: the native API with that seed samples the same text.
    assert native.generate_text("Once upon a time", max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True) == first


# ---- structured outputs: what smg 1.13 forwards of response_format (docs/api.md, "Structured outputs") ----


def _native_chat(native: LlmserveClient, so: pb.StructuredOutput, max_tokens: int) -> str:
    request = generate_request(messages=CHAT, max_tokens=max_tokens, temperature=0)
    request.structured_output.CopyFrom(so)
    return "".join(m.text for m in native.stream(request, timeout=60))


def test_response_format_json_schema_gives_content_that_validates(
    client: openai.OpenAI, native: LlmserveClient
) -> None:
    outputs = set()
    for i in (1, 4, 11, 17, 21, 30):
        schema = SCHEMAS[i]
        response_format: Any = {"type": "json_schema", "json_schema": {"name": f"schema_{i}", "schema": schema}}
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
            answer = client.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=160,
                response_format=response_format,
                **sampling,  # type: ignore[arg-type]
            )
            choice = answer.choices[0]
            assert choice.finish_reason == "stop", (schema, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content or ""), schema)
            outputs.add(choice.message.content)
        # Greedy and streamed, the gateway's chat writes what the native API writes under the schema.
        greedy = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=160, temperature=0, response_format=response_format, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in greedy if c.choices)
        assert text == _native_chat(native, pb.StructuredOutput(json_schema=json.dumps(schema)), 160)
    assert len(outputs) > 6  # sampled: the model's choice within each schema


def test_response_format_json_object_is_any_json_object(client: openai.OpenAI, native: LlmserveClient) -> None:
    """smg sends json_object as the schema {"type": "object"} and drops logit_bias, so the tiny
    model, which rarely closes a free key, runs to max_tokens here (the native tests bias it
    to finish); greedy, it writes what the native json_object constraint writes."""
    answer = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, response_format={"type": "json_object"}
    )
    content = answer.choices[0].message.content or ""
    assert content.lstrip().startswith("{") and answer.choices[0].finish_reason == "length"
    assert content == _native_chat(native, pb.StructuredOutput(json_object=True), 24)
    text = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, response_format={"type": "text"}
    )
    assert text.choices[0].message.content == native.generate_text(messages=CHAT, max_tokens=24, temperature=0)


def test_regex_and_ebnf_extra_fields_constrain_the_output(client: openai.OpenAI) -> None:
    regex = r"[a-f]{3}-[0-9]{2,3}"
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=40, temperature=1.0, seed=2, extra_body={"regex": regex}
    )
    assert re.fullmatch(regex, chat.choices[0].message.content or ""), chat.choices[0].message.content
    completion = client.completions.create(
        model=MODEL, prompt="Code:", max_tokens=40, temperature=0, extra_body={"regex": regex}
    )
    assert re.fullmatch(regex, completion.choices[0].text), completion.choices[0].text
    grammar = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [1-9]'
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=40, temperature=0, extra_body={"ebnf": grammar}
    )
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", chat.choices[0].message.content or "")


def test_an_invalid_schema_is_refused_with_the_compilers_reason(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}},
        )
    assert error.value.status_code == 400
    assert "sampling_params.json_schema: cannot be compiled: " in str(error.value) and "no-such-type" in str(
        error.value
    )


def test_an_over_long_prompt_is_a_400_and_the_server_keeps_serving(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="hello " * 600, max_tokens=4)
    assert error.value.status_code == 400
    assert "context length" in str(error.value)
    answer = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
    assert answer.choices[0].text


def test_the_model_field_is_required_and_must_be_the_served_name(up: Scheduler) -> None:
    # vLLM's server takes a request without "model" as one for its model; smg refuses it.
    status, body = http(f"{up.base_url}/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert status == 400 and json.loads(body)["error"]["code"] == "missing_required_parameter", body
    status, body = http(f"{up.base_url}/v1/completions", {"model": "gpt-4", "prompt": "Hello", "max_tokens": 3})
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found", body


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_the_path_given_to_model_names_the_model_too(client: openai.OpenAI, chat_model_dir: Path) -> None:
    # vLLM's default served name, which `vllm bench serve --model PATH` sends.
    answer = client.completions.create(model=str(chat_model_dir), prompt="Hello", max_tokens=3, temperature=0)
    reference = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert answer.model == MODEL and answer.choices[0].text == reference.choices[0].text
    assert client.models.retrieve(str(chat_model_dir)).id == MODEL


def test_a_client_that_disconnects_mid_stream_aborts_its_request(client: openai.OpenAI, up: Scheduler) -> None:
    wait_until(up.idle, 30, "idle before the test")
    generated = metric(up.metrics(), "llmserve:generation_tokens_total")
    stream = client.completions.create(
        model=MODEL,
        prompt="Tell me a long story",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    for _ in stream:
        received += 1
        if received == 3:
            break
    stream.close()
    wait_until(up.idle, 30, "every request gone and every KV block free after the disconnect")
    # Aborted, not finished: far fewer than the 400 tokens it asked for were generated.
    assert metric(up.metrics(), "llmserve:generation_tokens_total") - generated < 200


def test_health_and_metrics_endpoints_answer(up: Scheduler, client: openai.OpenAI) -> None:
    assert http(f"{up.base_url}/health")[0] == 200
    assert http(f"{up.base_url}/liveness")[0] == 200
    status, body = http(f"{up.base_url}/readiness")
    assert status == 200 and json.loads(body)["healthy_workers"] == 1
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    status, text = http(f"http://127.0.0.1:{up.http_metrics_port}/metrics")
    assert status == 200 and metric(text, "smg_http_requests_total") > 0


def test_one_http_ready_line_once_the_gateway_answers(chat_model_dir: Path, tmp_path: Path) -> None:
    """The scheduler's `ready` line comes seconds before smg answers on the HTTP port;
    `http_ready` comes after it, once, and HTTP answers the moment it is seen."""
    up = Scheduler(chat_model_dir, http=True, log=tmp_path / "up.log")
    try:
        wait_until(lambda: "http_ready" in up.events(), 180, "the http_ready line", up.proc)
        status, body = http(f"{up.base_url}/v1/models")
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [MODEL], body
        assert http(f"http://127.0.0.1:{up.http_metrics_port}/metrics")[0] == 200
        assert up.log is not None
        lines = [json.loads(line) for line in up.log.read_text().splitlines() if line.startswith("{")]
        (line,) = [e for e in lines if e.get("event") == "http_ready"]
        assert line["openai"] == f"{up.base_url}/v1"
        assert line["metrics"] == f"http://127.0.0.1:{up.http_metrics_port}/metrics"
        events = up.events()
        assert events.index("ready") < events.index("gateway_started") < events.index("http_ready"), events
    finally:
        up.stop()


# ---- several schedulers behind `llmserve gateway` ----


def test_cache_aware_routing_sends_a_shared_prefix_to_the_scheduler_that_holds_it(
    schedulers: tuple[Scheduler, Scheduler], chat_model_dir: Path
) -> None:
    a, b = schedulers
    http_port, metrics_port = distinct_ports(2)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmserve.cli",
            "--log-level",
            "warning",
            "gateway",
            "--scheduler",
            a.address,
            "--scheduler",
            b.address,
            "--http-port",
            str(http_port),
            "--http-metrics-port",
            str(metrics_port),
            "--policy",
            "cache_aware",
            "--model-alias",
            f"team-model={MODEL}",
        ],
        cwd=REPO,
    )
    gateway_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        wait_until(
            lambda: json.loads(http(f"http://127.0.0.1:{http_port}/readiness")[1] or "{}").get("healthy_workers") == 2,
            60,
            "both schedulers healthy behind the gateway",
            proc,
        )
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0, timeout=60)
        words = random.Random(7).choices(
            ["alpha", "river", "stone", "cloud", "maple", "ember", "quartz", "lumen"], k=220
        )
        prefix = "Shared context: " + " ".join(words)

        def counters() -> list[tuple[float, float]]:
            """(prompt tokens, prefix-cache hit tokens) of each scheduler so far."""
            texts = [s.metrics() for s in schedulers]
            return [
                (metric(t, "llmserve:prompt_tokens_total"), metric(t, "llmserve:prefix_cache_hits_total"))
                for t in texts
            ]

        before = counters()
        assert (
            client.completions.create(model="team-model", prompt=f"{prefix} Question 0?", max_tokens=1).model == MODEL
        )
        after = counters()
        served = [i for i in range(2) if after[i][0] > before[i][0]]
        assert len(served) == 1, (before, after)
        home, other = served[0], 1 - served[0]
        home_url = f"grpc://{schedulers[home].address}"
        # The gateway routes on the prefix-cache events the scheduler streams: wait until it has them.
        wait_until(
            lambda: metric(http(gateway_metrics)[1], "smg_kv_index_blocks", worker=home_url) >= 10,
            30,
            "the prompt's blocks indexed by the gateway",
            proc,
        )
        for q in range(1, 5):
            before = counters()
            client.completions.create(model=MODEL, prompt=f"{prefix} Question {q}?", max_tokens=1)
            after = counters()
            assert after[home][0] > before[home][0], f"question {q} went to the other scheduler"
            assert after[home][1] - before[home][1] >= 160, f"question {q} did not reuse the cached prefix"
            assert after[other] == before[other]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert not [pid for pid in children_of(proc.pid) if alive(pid)]


# ---- supervision ----


def test_the_gateway_is_restarted_when_it_dies(up: Scheduler, client: openai.OpenAI) -> None:
    (smg,) = [pid for pid in children_of(up.proc.pid) if is_smg(pid)]
    os.kill(smg, signal.SIGKILL)
    wait_until(lambda: any(pid != smg and is_smg(pid) for pid in children_of(up.proc.pid)), 30, "a new smg", up.proc)
    wait_until(lambda: http(f"{up.base_url}/readiness")[0] == 200, 60, "the new gateway ready", up.proc)
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices[0].text
    # Each smg process announces itself: the operator who saw gateway_exited learns when HTTP is back.
    wait_until(lambda: up.events().count("http_ready") == 2, 10, "a second http_ready line", up.proc)


def test_sigterm_stops_the_gateway_first_and_leaves_no_process(up: Scheduler) -> None:
    children = children_of(up.proc.pid)
    assert any(is_smg(pid) for pid in children), "llmserve up should have an smg child"
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=60) == 0
    wait_until(lambda: not any(alive(pid) for pid in children), 10, f"children {children} gone")
    # The gateway drains through the scheduler, so it goes first; the worker last.
    events = up.events()
    order = [events.index(e) for e in ("shutting_down", "gateway_stopped", "scheduler_stopped", "worker_stopped")]
    assert order == sorted(order), events[-10:]


# ---- flags and the command line (no processes) ----


def _up(*flags: str) -> Any:
    return build_parser().parse_args(["up", "--model", "/models/m", *flags])


def _up_gateway(*flags: str) -> GatewayConfig | None:
    a = _up(*flags)
    return configs.up_gateway_config(a, configs.served_names(a, a.model))


def test_up_starts_the_gateway_on_8000_by_default_in_front_of_its_scheduler() -> None:
    config = _up_gateway("--host", "0.0.0.0", "--port", "50061")
    assert config is not None
    assert (config.host, config.port, config.schedulers) == ("0.0.0.0", 8000, ("127.0.0.1:50061",))
    assert _up_gateway("--no-http") is None
    # TLS on the public port leaves the gateway's loopback listener as it is.
    assert _up_gateway("--tls-cert", "c.pem", "--tls-key", "k.pem") is not None


def test_served_names_default_to_the_directorys_name_and_the_path_given() -> None:
    a = _up()
    assert configs.served_names(a, a.model) == ("m", "/models/m")
    config = _up_gateway()
    assert config is not None and config.model_aliases == (("/models/m", "m"),)
    a = _up("--served-model-name", "team/chat", "chat", "team/chat")
    assert configs.served_names(a, a.model) == ("team/chat", "chat")  # the first reported, repeats dropped
    config = _up_gateway("--served-model-name", "team/chat", "chat")
    assert config is not None and config.model_aliases == (("chat", "team/chat"),)
    config = _up_gateway("--served-model-name", "only")
    assert config is not None and config.model_aliases == ()
    with pytest.raises(ValueError, match="a name is 1 to 256 characters"):
        _up_gateway("--served-model-name", "ok", " ")
    with pytest.raises(ValueError, match="the alias free of '='"):
        _up_gateway("--served-model-name", "ok", "a=b")
    sched = build_parser().parse_args(["scheduler", "--served-model-name", "team/chat"])
    assert sched.served_model_name == "team/chat"


def test_a_model_served_under_another_name_is_reported_by_it(tiny_model_dir: Path) -> None:
    spec = ModelSpec.from_dir(tiny_model_dir)
    assert spec.public_name == spec.name == tiny_model_dir.name
    renamed = spec.served_as("team/chat")
    # Workers still identify the model by its directory's name.
    assert (renamed.public_name, renamed.name) == ("team/chat", spec.name)
    assert spec.served_as(None) is spec


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--http-port", "50051"), "--http-port 50051 is also --port"),
        (("--metrics-port", "9092"), "--http-metrics-port 9092 is also --metrics-port"),
        (("--http-port", "70000"), "--http-port 70000 is not a TCP port"),
        (("--http-port", "0"), "--http-port 0 is not a TCP port"),
        (("--http-metrics-port", "8000"), "--http-port and --http-metrics-port are both 8000"),
    ],
)
def test_up_refuses_bad_gateway_flags(flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _up_gateway(*flags)


def test_up_refuses_a_held_http_port_before_starting_anything(tiny_model_dir: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "llmserve.cli",
                "up",
                "--model",
                str(tiny_model_dir),
                "--http-port",
                str(port),
                "--port",
                str(distinct_ports(1)[0]),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 2, out.stderr
    assert f"--http-port 127.0.0.1:{port}: in use by another process" in out.stderr
    assert "worker_started" not in out.stderr


def test_gateway_command_needs_schedulers_or_discovery() -> None:
    def config(*flags: str) -> GatewayConfig:
        return configs.gateway_config(build_parser().parse_args(["gateway", *flags]))

    with pytest.raises(ValueError, match="needs --scheduler"):
        config()
    with pytest.raises(ValueError, match="exclude each other"):
        config("--scheduler", "a:1", "--k8s-selector", "app=x")
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        config("--scheduler", "just-a-host")
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        config("--k8s-selector", "app")
    with pytest.raises(ValueError, match="is not ALIAS=NAME"):
        config("--scheduler", "a:1", "--model-alias", "chat")
    with pytest.raises(ValueError, match="given twice"):
        config("--scheduler", "a:1", "--model-alias", "chat=m", "--model-alias", "chat=n")
    with pytest.raises(ValueError, match="names the model itself"):
        config("--scheduler", "a:1", "--model-alias", "m=m")
    aliased = config("--scheduler", "a:1", "--model-alias", "chat=team/m=2")
    assert aliased.model_aliases == (("chat", "team/m=2"),)
    assert smg_command(aliased, "smg")[-4:-2] == ["--model-alias", "chat=team/m=2"]
    two = config("--scheduler", "s1:50051", "--scheduler", "s2:50051", "--policy", "round_robin")
    assert two.schedulers == ("s1:50051", "s2:50051") and two.policy == "round_robin"


def test_the_smg_command_line() -> None:
    listed = smg_command(
        GatewayConfig(schedulers=("s1:50051", "s2:50051"), host="0.0.0.0", port=8000, metrics_port=9092), "smg"
    )
    assert listed[:4] == ["smg", "launch", "--backend", "vllm"]
    assert listed[listed.index("--worker-urls") + 1 :][:2] == ["grpc://s1:50051", "grpc://s2:50051"]
    # The metrics listener is always placed explicitly (smg's default is 0.0.0.0:29000).
    assert (
        listed[listed.index("--prometheus-host") + 1] == "0.0.0.0"
        and listed[listed.index("--prometheus-port") + 1] == "9092"
    )
    assert listed[listed.index("--policy") + 1] == "cache_aware"
    found = smg_command(
        GatewayConfig(discovery=KubernetesDiscovery(("app.kubernetes.io/component=scheduler",), 50051, "prod")), "smg"
    )
    assert "--worker-urls" not in found and "--service-discovery" in found
    assert found[found.index("--selector") + 1] == "app.kubernetes.io/component=scheduler"
    assert found[found.index("--service-discovery-port") + 1] == "50051"
    assert found[found.index("--service-discovery-namespace") + 1] == "prod"


def test_http_keys_reach_smg_through_its_environment_never_its_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    from common.grpc.auth import key_name

    first, second = "admin-key-0001", "client-key-0002"
    config = GatewayConfig(schedulers=("s1:50051",), api_keys=(first, second))
    assert first not in repr(config)
    cmd, env = smg_process(config, "/venv/bin/smg")
    assert cmd[:2] == [sys.executable, "-c"] and cmd[3:] == smg_command(config, "smg")[1:]
    assert env is not None and not [arg for arg in cmd if first in arg or second in arg]
    # The first key is smg's shared one (every route); the others per tenant (/v1 only).
    assert json.loads(env[KEYS_ENV]) == ["--api-key", first, "--tenant-api-key", f"{key_name(second)}:{second}"]
    assert smg_process(GatewayConfig(schedulers=("s1:50051",)), "smg") == (smg_command(config, "smg"), None)

    monkeypatch.setenv("LLMSERVE_API_KEY", "env-key-0003")
    parsed = configs.gateway_config(
        build_parser().parse_args(["gateway", "--scheduler", "s1:50051", "--api-key", first, "--api-key", second])
    )
    assert parsed.api_keys == (first, second, "env-key-0003")
    with pytest.raises(ValueError, match="at least 8 characters"):
        configs.gateway_config(build_parser().parse_args(["gateway", "--scheduler", "s1:1", "--api-key", "short"]))
    # An admin key, from its variable too, comes first: a client key never holds smg's control plane.
    monkeypatch.setenv("LLMSERVE_ADMIN_API_KEY", "env-admin-0004")
    parsed = configs.gateway_config(build_parser().parse_args(["gateway", "--scheduler", "s1:50051"]))
    assert parsed.api_keys == ("env-admin-0004", "env-key-0003")


def test_smg_is_found_beside_the_interpreter_then_on_path_else_a_clear_error(tmp_path: Path) -> None:
    beside, on_path = tmp_path / "venv-bin", tmp_path / "path-bin"
    beside.mkdir()
    on_path.mkdir()
    with pytest.raises(GatewayUnavailable, match=r"pip install smg==1\.13\.0"):
        smg_executable(beside, str(on_path))
    (on_path / "smg").write_text("#!/bin/sh\n")
    (on_path / "smg").chmod(0o755)
    assert smg_executable(beside, str(on_path)) == str(on_path / "smg")
    (beside / "smg").write_text("#!/bin/sh\n")
    (beside / "smg").chmod(0o755)
    assert smg_executable(beside, str(on_path)) == str(beside / "smg")
    # This environment's own: pip puts it next to the interpreter.
    assert Path(smg_executable()).parent == Path(sys.executable).parent
