"""The Node.js example (examples/node) against a live scheduler and tiny worker.

Skipped without `node` and `npm`. The packages pinned in examples/node/package-lock.json are
installed with `npm ci` once, when node_modules does not already hold those versions
(node_modules is gitignored).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from llmserve.client import AsyncLlmserveClient
from tests import test_client
from tests.conftest import REPO, Scheduler, collect, free_port, request

NODE_DIR = REPO / "examples" / "node"
SCRIPT = NODE_DIR / "generate.mjs"

# A scheduler whose model has a chat template, over the tiny worker.
chat_model_dir = test_client.chat_model_dir
chat_scheduler = test_client.chat_scheduler

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None, reason="needs node and npm on the PATH"
)


def _installed_matches_pins() -> bool:
    pins = json.loads((NODE_DIR / "package.json").read_text())["dependencies"]
    for name, version in pins.items():
        manifest = NODE_DIR / "node_modules" / name / "package.json"
        if not manifest.is_file() or json.loads(manifest.read_text())["version"] != version:
            return False
    return True


@pytest.fixture(scope="module")
def node_example() -> Path:
    """examples/node/generate.mjs with its pinned dependencies installed."""
    if not _installed_matches_pins():
        done = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"npm ci failed (registry unreachable?): {done.stderr[-2000:]}")
    return SCRIPT


async def run_node(script: Path, *args: str, timeout: float = 120.0) -> tuple[int, str, str]:
    """Runs the example without blocking the event loop that serves the in-process scheduler."""
    proc = await asyncio.create_subprocess_exec(
        "node", str(script), *args, cwd=NODE_DIR, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_node_streams_the_same_tokens_as_a_python_call(tiny_scheduler: Scheduler, node_example: Path) -> None:
    expected = await collect(tiny_scheduler.stub, request(ids=[10, 20, 30, 40], max_tokens=7, ignore_eos=True))
    code, out, err = await run_node(
        node_example,
        "--address",
        f"127.0.0.1:{tiny_scheduler.port}",
        "--ids",
        "10,20,30,40",
        "--max-tokens",
        "7",
        "--ignore-eos",
    )
    assert code == 0, err
    assert out == expected.text + "\n"
    assert "[finish: length, prompt_tokens: 4, completion_tokens: 7, request_id: " in err


async def test_node_text_prompt_with_seeded_sampling(tiny_scheduler: Scheduler, node_example: Path) -> None:
    prompt = "Hello there, how are you?"
    seed = 2**64 - 1  # travels as a decimal string: exact beyond 2**53
    expected = await collect(
        tiny_scheduler.stub, request(prompt, max_tokens=6, ignore_eos=True, temperature=0.9, seed=seed)
    )
    code, out, err = await run_node(
        node_example,
        prompt,
        "--address",
        f"127.0.0.1:{tiny_scheduler.port}",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--temperature",
        "0.9",
        "--seed",
        str(seed),
    )
    assert code == 0, err
    assert out == expected.text + "\n"
    n_prompt = len(tiny_scheduler.engine.tokenizer.encode(prompt))
    assert f"[finish: length, prompt_tokens: {n_prompt}, completion_tokens: 6, " in err


async def test_node_reports_a_refused_request_and_exits_1(tiny_scheduler: Scheduler, node_example: Path) -> None:
    code, _, err = await run_node(node_example, "--address", f"127.0.0.1:{tiny_scheduler.port}", "--ids", "1,49152")
    assert code == 1
    assert "error: INVALID_ARGUMENT (3): prompt_token_ids[1]" in err


async def test_node_reports_an_unreachable_server(node_example: Path) -> None:
    code, _, err = await run_node(node_example, "--address", f"127.0.0.1:{free_port()}", "hello")
    assert code == 1
    assert "error: UNAVAILABLE (14)" in err


async def test_node_rejects_bad_flags_with_usage(node_example: Path) -> None:
    code, _, err = await run_node(node_example, "--max-tokens", "lots", "hello")
    assert code == 2
    assert "--max-tokens must be a non-negative integer" in err and "usage:" in err


# --- Methods other than Generate -------------------------------------------------------------


async def test_node_info_prints_model_info(tiny_scheduler: Scheduler, node_example: Path) -> None:
    code, out, err = await run_node(node_example, "--address", f"127.0.0.1:{tiny_scheduler.port}", "--info")
    assert code == 0, err
    info = json.loads(out)
    assert info["max_model_len"] == tiny_scheduler.engine.limits.max_model_len
    assert info["vocab_size"] == 49152


async def test_node_tokenize_prints_the_prompt_tokens(tiny_scheduler: Scheduler, node_example: Path) -> None:
    prompt = "Hello there"
    code, out, err = await run_node(node_example, prompt, "--address", f"127.0.0.1:{tiny_scheduler.port}", "--tokenize")
    assert code == 0, err
    assert json.loads(out)["token_ids"] == tiny_scheduler.engine.tokenizer.encode(prompt)


async def test_node_chat_sends_a_user_message(chat_scheduler: Scheduler, node_example: Path) -> None:
    question = "What is the capital of France?"
    async with AsyncLlmserveClient(f"127.0.0.1:{chat_scheduler.port}") as client:
        expected = await client.generate_text(
            messages=[{"role": "user", "content": question}], max_tokens=6, ignore_eos=True
        )
        n_prompt = len((await client.tokenize(messages=[{"role": "user", "content": question}])).token_ids)
    code, out, err = await run_node(
        node_example,
        "--chat",
        question,
        "--address",
        f"127.0.0.1:{chat_scheduler.port}",
        "--max-tokens",
        "6",
        "--ignore-eos",
    )
    assert code == 0, err
    assert out == expected + "\n"
    assert f"[finish: length, prompt_tokens: {n_prompt}, completion_tokens: 6, " in err
