"""A store with a past: rows another cluster wrote, tenants through a rebase, moves after moves, failovers
across app ids, and one source per warehouse. Each drill compares the lake with the store event by event,
by (tenant, stream id, version); none needs Spark (delta-rs writes, Arrow reads)."""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable
from psycopg.conninfo import make_conninfo

from es_pipeline.cli import main
from es_pipeline.dev import local_server
from es_pipeline.errors import FutureTransactionIds, LakeHoldsAnotherSource, LakeStoreDiverged
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.source.mapping import load
from es_pipeline.store import roles
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline.store.migrations import migrate
from es_pipeline_tests.support.cluster import another_cluster, cluster, dump, restore
from es_pipeline_tests.support.lakecheck import assert_exactly_once_by_key, extract_all
from es_pipeline_tests.support.roles import StoreDsn, login_roles
from es_pipeline_tests.support.store import append_workload, burn_transaction_ids

TENANTS = load("es-tenants")


def _ids(dsn: str) -> tuple[int, int]:
    """(highest tx_id stored, the next id the cluster will assign)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT (SELECT max(tx_id::text::bigint) FROM es.events), "
                           "pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _version(warehouse: Path) -> int:
    return DeltaTable(str(warehouse / "events")).version()


@pytest.mark.slow  # clusters of their own: once, on the suite's PostgreSQL (pg_versions skips it)
def test_a_store_restored_before_its_first_extraction_is_extracted_whole(
    dsn: StoreDsn, warehouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    burn_transaction_ids(dsn, 3000)  # the old cluster's counter runs well ahead of a new one's
    append_workload(dsn, 300, 1, writers=4)
    old = dump(dsn, tmp_path / "old.dump")
    with ExitStack() as stack:
        admin = stack.enter_context(another_cluster("before-adoption"))
        store = StoreDsn.of(restore(old, admin, "es_restored"), stack.enter_context(login_roles(admin)))
        append_workload(store, 100, 2)  # the applications carry on there, years before es_pipeline
        top, next_xid = _ids(store)
        assert top >= next_xid, "the drill needs restored ids above the new cluster's counter"
        monkeypatch.setenv("ES_PIPELINE_PG_DSN", store.extractor)
        monkeypatch.setenv("ES_PIPELINE_WAREHOUSE", str(warehouse))

        # Never a silent "caught up": status names the cause and the command.
        assert main(["status"]) == 2
        err = capsys.readouterr().err
        assert "the next id this PostgreSQL cluster will assign" in err and "es-pipeline offsets rebase" in err

        # Nothing extracted and no lake: the first run rebases by itself, while writers go on.
        writing = threading.Thread(target=append_workload, args=(store, 200, 3, 3))
        writing.start()
        extract_all(store.extractor, None, warehouse)
        writing.join()
        extract_all(store.extractor, None, warehouse)
        assert assert_exactly_once_by_key(warehouse, store) == 600
        assert main(["status"]) == 0
        capsys.readouterr()

        # The runbook's "rebuild the lake" on this cluster, while the restored ids are still ahead of it.
        shutil.rmtree(warehouse / "events")
        assert main(["offsets", "reset"]) == 0
        assert "this cluster has not assigned yet" in capsys.readouterr().out, "reset says what the next run will do"
        assert main(["extract"]) == 0
        assert assert_exactly_once_by_key(warehouse, store) == 600
        assert _ids(store)[0] >= _ids(store)[1], "the restored ids were still ahead: the rebuild was the hard case"


def test_rows_copied_in_with_their_tx_id_are_refused_then_rebased_tenant_by_tenant(
    tenant_store: StoreDsn, warehouse: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    store = EventStore(tenant_store)
    for i in range(30):
        store.append(f"order-{i}", "order", [NewEvent("Placed", {"n": i}), NewEvent("Paid", {"n": i})], 0, tenant="acme")
    extract_all(tenant_store.extractor, None, warehouse, source=TENANTS)
    # A copy job applying globex's history as logical replication does (no trigger fires), with the ids of the
    # cluster it was written on; globex's stream ids are acme's.
    with psycopg.connect(tenant_store, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")
        far = int(conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()[0]) + 50_000
        for i in range(30):
            for v in (1, 2, 3):
                conn.execute(
                    "INSERT INTO es.events (tenant, tx_id, stream_id, stream_type, version, event_type, payload) "
                    "VALUES ('globex', %s::text::xid8, %s, 'order', %s, 'Copied', %s)",
                    (str(far + i), f"order-{i}", v, f'{{"v": {v}, "n": {i}}}'))
    before = _version(warehouse)
    with pytest.raises(FutureTransactionIds, match="offsets rebase"):
        Extractor(tenant_store.extractor, None, warehouse, source=TENANTS).run(SliceRange(0, 1023))
    assert _version(warehouse) == before, "nothing was written"
    monkeypatch.setenv("ES_PIPELINE_PG_DSN", tenant_store.extractor)
    monkeypatch.setenv("ES_PIPELINE_WAREHOUSE", str(warehouse))
    monkeypatch.setenv("ES_PIPELINE_SOURCE", "es-tenants")
    assert main(["status"]) == 2
    assert main(["offsets", "rebase"]) == 0
    assert "all 60 events of the lake are in the store" in capsys.readouterr().out
    store.append("order-0", "order", [NewEvent("Shipped", {})], 2, tenant="acme")  # and the writers go on
    extract_all(tenant_store.extractor, None, warehouse, source=TENANTS)
    assert assert_exactly_once_by_key(warehouse, tenant_store, TENANTS) == 60 + 90 + 1
    assert main(["offsets", "rebase"]) == 0
    assert "nothing to rebase" in capsys.readouterr().out


@pytest.mark.slow  # clusters of their own: once, on the suite's PostgreSQL (pg_versions skips it)
def test_a_second_move_catches_up_as_the_first_did(
    dsn: StoreDsn, warehouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    burn_transaction_ids(dsn, 3000)
    append_workload(dsn, 150, 1)
    extract_all(dsn.extractor, None, warehouse)
    append_workload(dsn, 100, 5)  # committed on A, not extracted yet: B's catch-up brings these (its chunks commit)
    monkeypatch.setenv("ES_PIPELINE_WAREHOUSE", str(warehouse))
    with ExitStack() as stack:
        b_admin = stack.enter_context(another_cluster("move-b"))
        b_db = restore(dump(dsn, tmp_path / "a.dump"), b_admin, "es_b")
        made = stack.enter_context(login_roles(b_admin))
        b = StoreDsn.of(b_db, made)
        append_workload(b, 100, 2)
        monkeypatch.setenv("ES_PIPELINE_PG_DSN", b.extractor)
        assert main(["offsets", "rebase"]) == 0
        extract_all(b.extractor, None, warehouse)
        assert assert_exactly_once_by_key(warehouse, b) == 350
        burn_transaction_ids(b, 3000)  # B's own ids run ahead of C's, as A's did of B's
        with psycopg.connect(b) as conn:
            tail_after = int(conn.execute("SELECT max(global_position) FROM es.events").fetchone()[0])
        append_workload(b, 100, 3)  # committed on B, not extracted yet: the move to C must bring these too

        c_admin = stack.enter_context(another_cluster("move-c"))
        c_db = restore(dump(b, tmp_path / "b.dump"), c_admin, "es_c")
        c = StoreDsn.of(c_db, stack.enter_context(login_roles(c_admin)))
        append_workload(c, 50, 4)
        with psycopg.connect(c) as conn:
            above = conn.execute("SELECT count(*) FROM es.events WHERE global_position > %s "
                                 "AND tx_id >= pg_snapshot_xmax(pg_current_snapshot())", (tail_after,)).fetchone()
        assert above is not None and above[0] > 0, "the drill needs B's own ids above C's counter"
        monkeypatch.setenv("ES_PIPELINE_PG_DSN", c.extractor)
        assert main(["offsets", "rebase"]) == 0
        # One pass, with the restored tail still above C's horizon: the catch-up brings it now.
        extract_all(c.extractor, None, warehouse)
        assert assert_exactly_once_by_key(warehouse, c) == 500


@contextmanager
def _standby_copy(data: Path, port: int, copy: Path) -> Iterator[None]:
    """A copy of the cluster's data directory taken now (what a standby has); put back on leaving, as a
    failover to that standby does."""
    local_server.stop(data)
    subprocess.run(["cp", "-a", str(data), str(copy)], check=True)
    local_server.start(port, data)
    yield
    local_server.stop(data, mode="immediate")
    shutil.rmtree(data)
    subprocess.run(["cp", "-a", str(copy), str(data)], check=True)
    local_server.start(port, data)


@pytest.mark.slow  # clusters of their own: once, on the suite's PostgreSQL (pg_versions skips it)
def test_a_failover_that_lost_a_batch_is_refused_by_every_app_id(warehouse: Path) -> None:
    with ExitStack() as stack:
        c = stack.enter_context(cluster("failover"))
        with psycopg.connect(c.admin_dsn, autocommit=True) as conn:
            conn.execute('CREATE DATABASE "es_failover"')
        owner = make_conninfo(c.admin_dsn, dbname="es_failover")
        migrate(owner)
        roles.apply(owner, "es", echo=lambda _: None)
        store = StoreDsn.of(owner, stack.enter_context(login_roles(c.admin_dsn)))
        append_workload(store, 200, 1)
        extract_all(store.extractor, None, warehouse, n_ranges=8)  # hand materializations' app ids
        append_workload(store, 1000, 2)
        with _standby_copy(c.data, c.port, c.data.parent / f"{c.data.name}-standby"):
            Extractor(store.extractor, None, warehouse).run(SliceRange(0, 1023))  # the tailing run's app id
        shutil.rmtree(c.data.parent / f"{c.data.name}-standby")
        assert assert_exactly_once_by_key(warehouse, store) == 1200
        before = _version(warehouse)
        for r in (SliceRange(0, 127), SliceRange(0, 1023), SliceRange(128, 511)):
            with pytest.raises(LakeStoreDiverged, match="PostgreSQL is behind the lake"):
                Extractor(store.extractor, None, warehouse).run(r)
        assert _version(warehouse) == before, "nothing was written"
        assert assert_exactly_once_by_key(warehouse, store) == 1200


def test_a_consumer_never_binds_to_a_lake_another_source_filled(
    dsn: StoreDsn, empty_dsn: str, logins: dict[str, str], warehouse: Path,
) -> None:
    append_workload(dsn, 100, 1)
    extract_all(dsn.extractor, None, warehouse)
    before = _version(warehouse)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER SCHEMA es RENAME TO es2")
    with pytest.raises(LakeHoldsAnotherSource, match=r"bound to '[0-9a-f-]+/events'"):  # its creation commit says
        Extractor(dsn.extractor, None, warehouse, schema="es2").run(SliceRange(0, 1023))
    migrate(empty_dsn)
    roles.apply(empty_dsn, "es", echo=lambda _: None)
    other = StoreDsn.of(empty_dsn, logins)
    append_workload(other, 50, 2)
    with pytest.raises(LakeHoldsAnotherSource, match="the lake of another source"):  # another store's id
        Extractor(other.extractor, None, warehouse).run(SliceRange(0, 1023))
    assert _version(warehouse) == before, "nothing was written"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER SCHEMA es2 RENAME TO es")
    assert assert_exactly_once_by_key(warehouse, dsn) == 100


def test_what_the_lake_holds_is_known_by_tenant_stream_and_version(tmp_path: Path) -> None:
    """Below a rebase mark, a batch leaves out the events the lake holds: acme's order-1@1 there must not hide
    globex's order-1@1, nor a lake from before tenants (tenant NULL) hide anything but its own."""
    import pyarrow as pa

    from es_pipeline.extraction.extractor import EVENTS_LAKE_ARROW_SCHEMA
    from es_pipeline.lake.delta import tables
    from es_pipeline.lake.delta.arrow_append import append_batches

    def rows(tenants_: list[str | None]) -> pa.RecordBatch:
        n = len(tenants_)
        cols = {f.name: pa.nulls(n, f.type) for f in EVENTS_LAKE_ARROW_SCHEMA}
        cols.update(tenant=pa.array(tenants_, pa.string()), stream_id=pa.array(["order-1"] * n),
                    version=pa.array(range(1, n + 1), pa.int32()), slice=pa.array([7] * n, pa.int32()),
                    tx_id=pa.array([1] * n, pa.int64()), payload=pa.array(["{}"] * n))
        return pa.RecordBatch.from_pydict(cols, schema=EVENTS_LAKE_ARROW_SCHEMA)

    path = str(tmp_path / "events")
    tables.ensure_table_arrow(path, EVENTS_LAKE_ARROW_SCHEMA)
    append_batches([rows(["acme", None])], EVENTS_LAKE_ARROW_SCHEMA, path, app_id="t", version=1,
                   table=DeltaTable(path))
    kept = pa.Table.from_batches(list(tables.without_events_in_lake(iter([rows(["globex", "globex", ""])]), path)))
    # globex's two are new; the third (no tenant, version 3) is new too; acme@1 and the tenant-less @2 are held.
    assert sorted(zip(kept["tenant"].to_pylist(), kept["version"].to_pylist(), strict=True)) == [
        ("", 3), ("globex", 1), ("globex", 2)]
    again = list(tables.without_events_in_lake(iter([rows(["acme", ""])]), path))
    assert sum(b.num_rows for b in again) == 0, "acme@1 and the tenant-less @2 are in the lake already"
