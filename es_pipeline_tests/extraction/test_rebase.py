"""The store dumped and restored into a new cluster: refused until rebased, then exactly once again."""

from __future__ import annotations

import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg
import pytest

from es_pipeline.cli import main
from es_pipeline.errors import SourceChanged
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake.delta import tables
from es_pipeline_tests.support.cluster import another_cluster, dump, restore
from es_pipeline_tests.support.lakecheck import assert_events_checks_pass, assert_exactly_once, extract_all
from es_pipeline_tests.support.roles import StoreDsn, login_roles
from es_pipeline_tests.support.store import append_workload


def _offsets(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM es_pipeline.offsets").fetchone()
    return int(row[0]) if row else 0


def test_a_store_restored_into_a_new_cluster_is_refused_then_rebased_exactly_once(
    dsn: StoreDsn, spark: Any, warehouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    append_workload(dsn, 150, 1)
    extract_all(dsn.extractor, spark, warehouse)
    old_dump = dump(dsn, tmp_path / "old.dump")  # older than what the lake will hold
    append_workload(dsn, 150, 2)
    extract_all(dsn.extractor, spark, warehouse)
    append_workload(dsn, 100, 3)  # committed, not extracted yet: the restore must bring these too
    new_dump = dump(dsn, tmp_path / "new.dump")
    monkeypatch.setenv("ES_PIPELINE_WAREHOUSE", str(warehouse))

    with ExitStack() as stack:
        admin = stack.enter_context(another_cluster("restore"))
        # A restore of a state older than the lake: nothing can be exact, so nothing is changed.
        old_db = restore(old_dump, admin, "es_old")
        made = stack.enter_context(login_roles(admin))  # es_pipeline's login on the new cluster
        old = StoreDsn.of(old_db, made)
        monkeypatch.setenv("ES_PIPELINE_PG_DSN", old.extractor)
        assert main(["offsets", "rebase"]) == 2
        assert "holds 150 event(s) that the event store does not" in capsys.readouterr().err
        assert _offsets(old) == 1024

        restored = StoreDsn.of(restore(new_dump, admin, "es_restored"), made)
        append_workload(restored, 200, 4)  # the applications carry on on the new cluster
        before = tables.table_version(spark, str(warehouse / "events"))
        with pytest.raises(SourceChanged, match="another cluster|dump restored into a new cluster"):
            Extractor(restored.extractor, spark, warehouse).run(SliceRange(0, 1023))
        monkeypatch.setenv("ES_PIPELINE_PG_DSN", restored.extractor)
        assert main(["status"]) == 2
        assert "dump restored into a new cluster" in capsys.readouterr().err
        assert tables.table_version(spark, str(warehouse / "events")) == before, "nothing was written"

        assert main(["offsets", "rebase"]) == 0
        assert "all 300 events of the lake are in the store" in capsys.readouterr().out
        assert main(["offsets", "rebase"]) == 0  # safe twice
        assert "nothing to rebase" in capsys.readouterr().out

        # Writers keep appending while the ranges are extracted again from the start.
        writing = threading.Thread(target=append_workload, args=(restored, 300, 5, 4))
        writing.start()
        extract_all(restored.extractor, spark, warehouse)
        writing.join()
        extract_all(restored.extractor, spark, warehouse)
        assert assert_exactly_once(spark, warehouse, restored) == 300 + 100 + 200 + 300
        # The lake's checks hold too, though restored ids still lie above the new cluster's watermarks.
        assert_events_checks_pass(spark, warehouse, restored.extractor)
