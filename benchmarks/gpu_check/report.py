"""The run's record: one JSON file, rewritten after every section, and the closing table.

    {"meta": {...}, "plan": [...], "sections": {name: {"status": "ok" | "failed" | "skipped",
     "seconds", "estimate_s", "summary", "result" | "error" + "traceback" | "reason"}},
     "failed": [...], "skipped": [...]}

`summary` is a section's key numbers in one line (what the table shows); `result` holds
everything it measured.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_atomically(path: Path, text: str) -> None:
    """A reader, or a kill mid-write, sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    """JSON has no infinity or NaN: those become null rather than invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class Report:
    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.meta = meta
        self.plan: list[dict[str, Any]] = []
        self.sections: dict[str, dict[str, Any]] = {}

    def ok(self, name: str, estimate: float, result: dict[str, Any], seconds: float) -> None:
        """A section that ran to its end; one whose check did not hold (`passed` False: a
        parity mismatch, memory over the limit) is recorded as failed, with what it measured."""
        summary = str(result.pop("summary", ""))
        self.sections[name] = {
            "status": "failed" if result.get("passed") is False else "ok",
            "seconds": seconds,
            "estimate_s": estimate,
            "summary": summary,
            "result": result,
        }

    def failed(self, name: str, estimate: float, error: BaseException, trace: str, seconds: float) -> None:
        message = f"{type(error).__name__}: {error}"
        self.sections[name] = {
            "status": "failed",
            "seconds": seconds,
            "estimate_s": estimate,
            "summary": message[:200],
            "error": message,
            "traceback": trace[-4000:],
        }

    def skipped(self, name: str, estimate: float, reason: str, seconds: float = 0.0) -> None:
        self.sections[name] = {
            "status": "skipped",
            "seconds": seconds,
            "estimate_s": estimate,
            "summary": reason,
            "reason": reason,
        }

    def names(self, status: str) -> list[str]:
        return [name for name, entry in self.sections.items() if entry["status"] == status]

    def save(self) -> None:
        document = {
            "meta": self.meta,
            "plan": self.plan,
            "sections": self.sections,
            "failed": self.names("failed"),
            "skipped": self.names("skipped"),
        }
        write_atomically(self.path, json.dumps(_jsonable(document), indent=2) + "\n")

    def table(self) -> str:
        rows = [("section", "status", "seconds", "key numbers")]
        for name, entry in self.sections.items():
            rows.append((name, entry["status"], f"{entry['seconds']:.1f}", entry.get("summary", "")))
        return _format(rows)


def plan_table(plan: list[dict[str, Any]], budget_s: float | None) -> str:
    budget = "no budget" if budget_s is None else f"--budget-s {budget_s:.0f}"
    rows = [("section", "cold s", "warm s", f"cold, {budget}", f"warm, {budget}")]
    for row in plan:
        rows.append((row["section"], f"{row['cold_s']:.0f}", f"{row['warm_s']:.0f}", row["cold"], row["warm"]))
    return _format(rows)


def _format(rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the last column runs free."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths)), row[-1]]).rstrip() for row in rows
    )
