"""The alert rules (es_pipeline/health/alerts.yml) under Prometheus's own checker and unit tests (`promtool`,
Debian's `prometheus` package), and every alert with its runbook in docs/operations.md and a unit test."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from es_pipeline.health.exporter import ALERTS

HERE = Path(__file__).parent
OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: `apt-get install prometheus` (.ci/run installs it)")
    return found


def _alerts() -> list[str]:
    return [r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_the_rules_pass_promtools_check_and_unit_tests() -> None:
    promtool = _promtool()
    check = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    tested = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=HERE, capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_unit_test_and_a_runbook() -> None:
    alerts = _alerts()
    assert len(alerts) == len(set(alerts)) >= 10
    tests = (HERE / "alerts_test.yml").read_text()
    runbooks = OPERATIONS.read_text()
    for name in alerts:
        assert f"alertname: {name}\n" in tests, f"{name} has no promtool unit test"
        assert re.search(rf"^### {name}$", runbooks, re.M), f"{name} has no runbook in docs/operations.md"
