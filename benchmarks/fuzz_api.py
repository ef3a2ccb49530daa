"""The API fuzzer of tests/test_api_fuzz.py, run longer: many examples per public method.

    python benchmarks/fuzz_api.py                 # 200 examples per method and input kind
    python benchmarks/fuzz_api.py --examples 1000

Every public RPC (native, TGIS, gateway protocol) gets random messages from its descriptor,
random bytes, and (the generate methods) valid prompts with random parameters, against a real
scheduler and worker; only documented status codes may come back, the server stays SERVING,
no KV block leaks. Prints pytest's summary and writes benchmarks/results/fuzz-api-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=200, help="examples per method and input kind")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args()
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_api_fuzz.py"],
        cwd=REPO_ROOT,
        env={**os.environ, "LLMSERVE_FUZZ_EXAMPLES": str(args.examples)},
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.monotonic() - start
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    print(proc.stdout[-6000:])
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", summary)}
    result = {
        "benchmark": "fuzz_api",
        "date": dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S"),
        "examples_per_test": args.examples,
        "tests": counts,
        "returncode": proc.returncode,
        "seconds": round(seconds, 1),
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"fuzz-api-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{summary}; {seconds:.0f} s; wrote {path}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
