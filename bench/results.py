"""Writing a benchmark's result: `bench/results/<name>.json` (raw figures) and `<name>.md` (a table)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.common import PROJECT_ROOT, RESULTS_DIR, admin_dsn, server_version

_OPS = {">=": float.__ge__, "<=": float.__le__, "<": float.__lt__, ">": float.__gt__}


@dataclass(frozen=True)
class Goal:
    """A target for one ratio, e.g. `backfill / ceiling >= 0.5`."""

    label: str
    value: float
    op: str
    target: float

    @property
    def met(self) -> bool:
        return bool(_OPS[self.op](float(self.value), float(self.target)))

    def describe(self) -> str:
        verdict = "met" if self.met else "NOT met"
        return f"{self.label} = {self.value:.2f} (goal {self.op} {self.target:g}): **{verdict}**"

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "value": round(self.value, 4), "op": self.op, "target": self.target,
                "met": self.met}


def _mem_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _git_commit() -> str:
    res = subprocess.run(["git", "-C", str(PROJECT_ROOT), "describe", "--always", "--dirty"],
                         capture_output=True, text=True, check=False)
    return res.stdout.strip() or "?"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def machine_facts() -> dict[str, Any]:
    """What the figures depend on, taken once per run (load average: other work on the machine)."""
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": len(os.sched_getaffinity(0)),
        "memory_bytes": _mem_total_bytes(),
        "loadavg_at_start": round(os.getloadavg()[0], 2),
        "postgres": server_version(admin_dsn()),
        "pyspark": _version("pyspark"),
        "delta_spark": _version("delta-spark"),
        "python": platform.python_version(),
        "git": _git_commit(),
    }


def facts_line(facts: Mapping[str, Any]) -> str:
    return (
        f"{facts['date']} · nproc {facts['nproc']} · memory {facts['memory_bytes'] / 2**30:.1f} GiB · "
        f"load avg {facts['loadavg_at_start']} at start · PostgreSQL {facts['postgres']} · "
        f"pyspark {facts['pyspark']} · delta-spark {facts['delta_spark']} · Python {facts['python']} · "
        f"git {facts['git']}"
    )


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    numeric = [all(_looks_numeric(r[i]) for r in rows) for i in range(len(columns))]
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" if n else "---" for n in numeric) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]
    return "\n".join(lines)


def _looks_numeric(text: str) -> bool:
    t = text.replace(",", "").replace(".", "").replace("×", "").replace(" ", "").strip()
    return bool(t) and (t.isdigit() or t == "—")


def write_result(
    name: str,
    *,
    title: str,
    facts: Mapping[str, Any],
    parameters: Mapping[str, Any],
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    figures: Mapping[str, Any],
    goals: Sequence[Goal],
    notes: Sequence[str] = (),
    results_dir: Path = RESULTS_DIR,
) -> str:
    """Write `<name>.json` and `<name>.md`, print the markdown, and return it."""
    results_dir.mkdir(parents=True, exist_ok=True)
    raw = {
        "benchmark": name,
        "title": title,
        "machine": dict(facts),
        "parameters": dict(parameters),
        "figures": dict(figures),
        "goals": [g.as_dict() for g in goals],
        "notes": list(notes),
    }
    (results_dir / f"{name}.json").write_text(json.dumps(raw, indent=2, default=str) + "\n")
    md = "\n".join(
        [
            f"# {name}: {title}",
            "",
            f"_{facts_line(facts)}_",
            "",
            "Parameters: " + ", ".join(f"{k} = {_fmt_param(v)}" for k, v in parameters.items()),
            "",
            markdown_table(columns, rows),
            "",
            *(f"- {g.describe()}" for g in goals),
            *([""] if goals and notes else []),
            *notes,
            "",
        ]
    )
    (results_dir / f"{name}.md").write_text(md)
    print("\n" + md, flush=True)
    return md


def _fmt_param(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


# -- number formats for the tables ---------------------------------------------------------------------


def n(value: float) -> str:
    return f"{value:,.0f}"


def secs(value: float) -> str:
    return f"{value:,.2f}"


def ratio(value: float) -> str:
    return f"{value:.2f}"


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f}"
