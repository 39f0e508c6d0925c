"""`make test`'s tiers against their budgets: each tier's wall time and its slowest tests, printed at the end, so that
the next drill is added with its cost in view (README, "Two commands").

Each tier's make target runs as `python -m es_pipeline_tests.support.budget run <tier> -- <command…>`: the command's
wall time is recorded in `.cache/test-times/<tier>.json`, beside the JUnit XML its pytest writes there
(`--junitxml`, per test case its seconds), and the CPU seconds its processes used (those it waited for: servers it
started detached, such as a local PostgreSQL, are not counted). `make test` ends with `... budget report`: per tier,
its time against its budget, its CPU time, and its five slowest tests; a tier over its budget is named (the run still
passes or fails on its tests). On 2 cores the tiers that run side by side share the machine: the CPU times say which
one to make cheaper."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

from es_pipeline.settings import CACHE

TIMES = CACHE / "test-times"
# Seconds on this kind of machine (2 cores): what a fresh-clone `.ci/run` measured (README, "Two commands"), with a
# little room. The main suite, then the side-by-side tier (its longest), add up to `make test`: 25 minutes at most
# here, so that a machine whose core runs Python 2.4 times slower still lands within CI's 90.
BUDGETS = {"pytest": 960, "e2e": 480, "pg-versions": 480, "bench-smoke": 480}
SLOWEST = 5


def run(tier: str, command: list[str]) -> int:
    """Run `command`, recording its wall time for `tier`; its exit status."""
    TIMES.mkdir(parents=True, exist_ok=True)
    started, before = time.monotonic(), _children_cpu()
    code = subprocess.call(command, close_fds=False)  # a make under it keeps the jobserver (make's `+` recipes)
    (TIMES / f"{tier}.json").write_text(json.dumps({"seconds": round(time.monotonic() - started, 1), "exit": code,
                                                    "cpu": round(_children_cpu() - before, 1),
                                                    "finished": time.time()}))
    return code


def _children_cpu() -> float:
    """User and system seconds of this process's children that have ended (and theirs, waited for)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def slowest(tier: str, n: int = SLOWEST) -> list[tuple[float, str]]:
    """The `n` slowest test cases of every JUnit XML of `tier` (`<tier>*.xml`)."""
    cases = []
    for path in sorted(TIMES.glob(f"{tier}*.xml")):
        for case in ET.parse(path).iter("testcase"):
            cases.append((float(case.get("time") or 0), f"{case.get('classname')}::{case.get('name')}"))
    return sorted(cases, reverse=True)[:n]


def report() -> int:
    lines, over = ["test tiers (wall time, budget, CPU time, slowest tests):"], []
    for tier, budget in BUDGETS.items():
        recorded = TIMES / f"{tier}.json"
        if not recorded.exists():
            continue
        record = json.loads(recorded.read_text())
        seconds = record["seconds"]
        mark = "" if seconds <= budget else "  OVER BUDGET"
        if mark:
            over.append(tier)
        cpu = f", CPU {record['cpu'] / 60:5.1f} min" if "cpu" in record else ""
        lines.append(f"  {tier:<12} {seconds / 60:5.1f} min of {budget / 60:.0f}{cpu}{mark}")
        lines += [f"      {s:7.1f} s  {name}" for s, name in slowest(tier)]
    if over:
        lines.append(f"over budget: {', '.join(over)} (README, \"Two commands\"): make the new test cheaper, or "
                     "move a larger size to `make bench`")
    print("\n".join(lines))
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["run"] and len(argv) > 3 and argv[2] == "--":
        return run(argv[1], argv[3:])
    if argv == ["report"]:
        return report()
    print("usage: python -m es_pipeline_tests.support.budget run <tier> -- <command…> | report", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
