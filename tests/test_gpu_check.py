"""benchmarks/gpu_check.py is ready for a GPU machine without running on one: it parses,
refuses a CPU outside --dry-run/--smoke, its dry run walks every section's set-up and prints
the plan with estimates, a section that raises is recorded while the rest still run, the
budget skips what would not fit with the reason, and the JSON is on disk after every section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
if str(SCRIPT.parent) not in sys.path:
    sys.path.insert(0, str(SCRIPT.parent))  # the package gpu_check lives in benchmarks/

from gpu_check import cli, kernel_tests, runner  # noqa: E402
from gpu_check.context import Context, Skip  # noqa: E402
from gpu_check.report import Report  # noqa: E402
from gpu_check.sections import NAMES, SECTIONS  # noqa: E402

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "1", **(env or {})},
    )


def test_help_names_every_section() -> None:
    out = run("--help")
    assert out.returncode == 0, out.stderr
    assert all(name in out.stdout for name in NAMES)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--no-such-flag"], "unrecognized arguments"),
        (["--iters", "0"], "--iters must be at least 1"),
        (["--budget-s", "0"], "--budget-s must be positive"),
        (["--sections", "decode,warp_drive"], "unknown warp_drive"),
        (["--dry-run", "--smoke"], "not allowed with"),
    ],
)
def test_argument_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@NO_CUDA
def test_refuses_to_measure_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "needs CUDA" in err and "--dry-run" in err
    assert not (tmp_path / "r.json").exists()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """One dry run for the tests below, with prefill_mixed made to raise."""
    out = tmp_path_factory.mktemp("dry") / "r.json"
    proc = run("--dry-run", "--out", str(out), env={runner.FAIL_ENV: "prefill_mixed"})
    return proc, json.loads(out.read_text())


def test_dry_run_prints_the_plan_with_estimates_and_walks_every_section(
    dry_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    proc, result = dry_run
    plan_lines: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():  # the plan comes first; the closing table repeats the names
        if line.strip():
            plan_lines.setdefault(line.split()[0], line.split())
    for s in SECTIONS:
        # The plan's row: name, cold estimate, warm estimate, then what a device run would do.
        assert plan_lines[s.name][1:3] == [f"{s.cold_s:.0f}", f"{s.warm_s:.0f}"]
    assert [row["section"] for row in result["plan"]] == NAMES
    assert list(result["sections"]) == NAMES  # every section's set-up was walked, in order
    assert result["meta"]["mode"] == "dry"
    walked = {name: entry for name, entry in result["sections"].items() if name != "prefill_mixed"}
    assert {name: entry["status"] for name, entry in walked.items()} == dict.fromkeys(walked, "ok"), {
        name: entry.get("error") for name, entry in walked.items()
    }
    assert "section          status" in proc.stdout  # the closing table


def test_a_section_that_raises_is_recorded_and_the_rest_still_run(
    dry_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    proc, result = dry_run
    assert proc.returncode == 1
    broken = result["sections"]["prefill_mixed"]
    assert broken["status"] == "failed" and result["failed"] == ["prefill_mixed"]
    assert broken["error"] == f"RuntimeError: failure injected through {runner.FAIL_ENV}"
    assert "Traceback" in broken["traceback"]
    after = NAMES[NAMES.index("prefill_mixed") + 1 :]
    assert all(result["sections"][name]["status"] == "ok" for name in after)


def test_the_dry_run_plan_shows_what_a_budget_would_skip() -> None:
    sections = [
        runner.Section("a", "", 10, 5, "unused"),
        runner.Section("b", "", 30, 10, "unused"),
        runner.Section("c", "", 20, 5, "unused"),
        runner.Section("tests", "", 5, 5, "unused", takes_rest=True),
    ]
    rows = {row["section"]: row for row in runner.plan(sections, budget_s=35)}
    assert [rows[n]["cold"] for n in "abc"] == ["run", "skip (30 s > 25 s left)", "run"]
    assert [rows[n]["warm"] for n in "abc"] == ["run", "run", "run"]
    assert rows["tests"]["cold"] == "run in the 5 s left" and rows["tests"]["warm"] == "run in the 15 s left"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def context(tmp_path: Path, budget: runner.Budget, mode: str = "smoke") -> Context:
    return Context(torch.device("cpu"), mode, 1, tmp_path / "no-model", tmp_path, budget)


def taking(clock: FakeClock, seconds: float, result: dict[str, Any] | None = None) -> Any:
    def section(ctx: Context) -> dict[str, Any]:
        clock.now += seconds
        return dict(result or {"summary": f"took {seconds}"})

    return section


def test_budget_skips_a_section_whose_estimate_exceeds_what_is_left(tmp_path: Path) -> None:
    clock = FakeClock()
    budget = runner.Budget(20, clock)
    report = Report(tmp_path / "r.json", {})
    sections = [
        runner.Section("first", "", 5, 5, taking(clock, 8)),  # over its estimate: 12 s left
        runner.Section("big", "", 15, 15, taking(clock, 1)),
        runner.Section("small", "", 10, 10, taking(clock, 10)),
        runner.Section("rest", "", 5, 5, taking(clock, 1), takes_rest=True),
    ]
    runner.run_sections(sections, context(tmp_path, budget), report, warm=True)
    status = {name: entry["status"] for name, entry in report.sections.items()}
    assert status == {"first": "ok", "big": "skipped", "small": "ok", "rest": "skipped"}
    assert report.sections["big"]["reason"] == "estimate 15 s > 12 s left of the budget"
    assert report.sections["rest"]["reason"] == "estimate 5 s > 2 s left of the budget"
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["skipped"] == ["big", "rest"] and saved["failed"] == []


@NO_CUDA
def test_a_tiny_budget_skips_every_section_with_its_reason(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert cli.main(["--smoke", "--budget-s", "0.5", "--out", str(out)]) == 0  # skips are not failures
    result = json.loads(out.read_text())
    assert result["skipped"] == NAMES
    assert all("left of the budget" in entry["reason"] for entry in result["sections"].values())


def test_a_raising_section_fails_alone_and_a_check_that_does_not_hold_fails_with_its_numbers(tmp_path: Path) -> None:
    clock = FakeClock()

    def broken(ctx: Context) -> dict[str, Any]:
        raise RuntimeError("illegal memory access")

    def absent(ctx: Context) -> dict[str, Any]:
        raise Skip("no model here")

    report = Report(tmp_path / "r.json", {})
    sections = [
        runner.Section("broken", "", 1, 1, broken),
        runner.Section("absent", "", 1, 1, absent),
        runner.Section("mismatch", "", 1, 1, taking(clock, 1, {"passed": False, "diff": 3.0, "summary": "1/3"})),
        runner.Section("fine", "", 1, 1, taking(clock, 1)),
    ]
    runner.run_sections(sections, context(tmp_path, runner.Budget(None, clock)), report, warm=False)
    entries = report.sections
    assert entries["broken"]["error"] == "RuntimeError: illegal memory access"
    assert "illegal memory access" in entries["broken"]["traceback"]
    assert entries["absent"] == {**entries["absent"], "status": "skipped", "reason": "no model here"}
    assert entries["mismatch"]["status"] == "failed" and entries["mismatch"]["result"]["diff"] == 3.0
    assert entries["fine"]["status"] == "ok"
    assert report.names("failed") == ["broken", "mismatch"]
    table = report.table()
    assert "illegal memory access" in table and "took 1" in table


def test_the_json_is_on_disk_after_every_section(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    seen: list[dict[str, Any]] = []

    def reader(ctx: Context) -> dict[str, Any]:
        seen.append(json.loads(out.read_text()))
        return {}

    def killed(ctx: Context) -> dict[str, Any]:
        raise KeyboardInterrupt  # a run stopped from outside mid-section

    report = Report(out, {})
    sections = [
        runner.Section("first", "", 1, 1, lambda ctx: {"value": 1}),
        runner.Section("second", "", 1, 1, reader),
        runner.Section("third", "", 1, 1, killed),
    ]
    with pytest.raises(KeyboardInterrupt):
        runner.run_sections(sections, context(tmp_path, runner.Budget(None)), report, warm=False)
    assert seen[0]["sections"]["first"]["result"] == {"value": 1}
    assert set(json.loads(out.read_text())["sections"]) == {"first", "second"}


def test_a_section_past_the_end_of_the_budget_is_stopped(tmp_path: Path) -> None:
    def forever(ctx: Context) -> dict[str, Any]:
        while True:
            pass

    report = Report(tmp_path / "r.json", {})
    budget = runner.Budget(0.3)
    runner.run_sections([runner.Section("spin", "", 0.1, 0.1, forever)], context(tmp_path, budget), report, True)
    assert report.sections["spin"]["status"] == "failed"
    assert "SectionTimeout: still running when the budget ran out" in report.sections["spin"]["error"]


def test_kernel_test_counts_from_pytest_output() -> None:
    assert kernel_tests._counts("....F\n1 failed, 4 passed, 2 skipped in 3.10s\n") == {
        "failed": 1,
        "passed": 4,
        "skipped": 2,
    }
    assert kernel_tests._counts("3 passed, 1 error in 2.0s") == {"passed": 3, "error": 1}
    # Killed before pytest's closing line: the progress dots are what ran.
    assert kernel_tests._counts("..F.E. [ 40%]\n..") == {"passed": 6, "failed": 1, "error": 1}


def test_kernel_tests_fit_their_timeouts_in_what_is_left() -> None:
    cmd = kernel_tests.command(100.0)
    assert "--full-kernels" in cmd and "--timeout=100" in cmd
    assert "--session-timeout=85" in cmd  # stopped cleanly before the process is killed at 100 s
    assert "tests/test_kernels.py" in cmd


@NO_CUDA
def test_smoke_measures_the_attention_sections_on_tiny_shapes(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = run("--smoke", "--sections", "versions,decode,prefill_mixed", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())["sections"]
    decode = result["decode"]["result"]
    assert decode["copy_bytes_per_s"] > 0 and all(case["eager_s"] > 0 for case in decode["cases"])
    mixed = result["prefill_mixed"]["result"]["mixed"]
    assert mixed["mixed"]["flops_per_s"] > 0 and mixed["mixed_over_halves"] > 0
    assert result["versions"]["status"] == "ok"
