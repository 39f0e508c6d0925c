"""docs/writing.md's examples, run as written, in order, as the writer role against a fresh store."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from es_pipeline_tests.support.roles import StoreDsn

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing.md"


def test_the_writers_guide_runs_as_written(dsn: StoreDsn, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 4, "the guide's examples"
    monkeypatch.setenv("ES_PIPELINE_PG_DSN", dsn.writer)
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - the guide's own code, as a reader runs it
