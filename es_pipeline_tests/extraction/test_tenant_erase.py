"""`tenant erase`: one tenant out of the store, the lake, the projections and the snapshots, files and all,
while the other tenants' writers and the extraction go on, and their events land exactly once."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.checks.events import reconcile
from es_pipeline.errors import SliceLocked, TenantRefused, UnknownTenant
from es_pipeline.extraction.erase import erase_tenant
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.offsets import batch_frontier
from es_pipeline.extraction.slices import split
from es_pipeline.extraction.status import status_report
from es_pipeline.lake import cross_stream
from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.delta import erase as lake_erase
from es_pipeline.lake.delta import tables
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state.snapshots import take_snapshots
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.settings import Settings
from es_pipeline.source.mapping import load
from es_pipeline.store import tenants
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.roles import StoreDsn
from es_pipeline_tests.support.store import make_tenant_store

SOURCE = load("es-tenants")
TENANTS = ("acme", "globex", "initech")
GONE = "globex"


@pytest.fixture
def store(empty_dsn: str, logins: dict[str, str]) -> StoreDsn:
    """A fresh store partitioned by tenant holding TENANTS (three: `tenant_store` holds two)."""
    make_tenant_store(empty_dsn, *TENANTS)
    return StoreDsn.of(empty_dsn, logins)


def _settings(store: StoreDsn, warehouse: Path) -> Settings:
    # The erasure drops a partition: it runs as the tables' owner, as `db migrate` and `source adopt` do.
    return replace(Settings.from_env(), pg_dsn=str(store), warehouse=warehouse, source_mapping=SOURCE,
                   source_spec="es-tenants", spark_master="local[2]")


class Rollback(Exception):
    pass


def _writer(dsn: str, tenant: str, seed: int, stop: threading.Event, refused: list[str]) -> None:
    """Appends carts of `tenant` until stopped: out-of-order commits (held open up to 10 ms), 20% rolled back."""
    rng, store, versions = random.Random(seed), EventStore(dsn), {}
    with psycopg.connect(dsn) as conn:
        while not stop.is_set():
            sid = f"cart-{seed % 3}-{rng.randrange(15)}"  # the same stream ids in every tenant
            event = NewEvent("ItemAdded", {"sku": f"sku-{rng.randrange(6)}", "qty": 1, "unit_price": 2.5})
            try:
                with conn.transaction():
                    new = store.append(sid, "cart", [event], versions.get(sid, 0), conn=conn, tenant=tenant)
                    time.sleep(rng.random() * 0.01)
                    if rng.random() < 0.2:
                        raise Rollback
                versions[sid] = new
                time.sleep(0.005)  # about 100 appends a second per writer: the load, not the volume, matters here
            except Rollback:
                pass
            except UnknownTenant:
                refused.append(tenant)  # its partition is gone: the application learns it at once
                return


def _extract_until(stop: threading.Event, extractor: Extractor, errors: list[BaseException]) -> None:
    while not stop.is_set():
        for r in split(4):
            try:
                extractor.run(r)
            except SliceLocked:
                pass  # the erasure holds the slices: this range waits, as a sensor's run would
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                return
        time.sleep(0.05)


def _project(spark: Any, warehouse: Path, store: StoreDsn) -> None:
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP, store_dsn=store.extractor)
    update_stream_catalog(Engine(spark=spark), warehouse, store_dsn=store.extractor)
    update_event_type_daily(Engine(spark=spark), warehouse, store_dsn=store.extractor)
    take_snapshots(Engine(spark=spark), warehouse, EventStore(store.snapshots, "es"), threshold=1)


def _seeded_lake(store: StoreDsn, spark: Any, warehouse: Path) -> None:
    """Three carts of one event in each tenant, extracted, projected and snapshotted: up to date everywhere."""
    writer = EventStore(store.writer)
    for t in TENANTS:
        for n in range(1, 4):
            writer.append(f"cart-{n}", "cart", [NewEvent("ItemAdded", {"sku": "a", "qty": n})], 0, tenant=t)
    for r in split(4):
        Extractor(store.extractor, None, warehouse, source=SOURCE).run(r)
    _project(spark, warehouse, store)


def _store_events(dsn: str) -> dict[tuple[str, str, int], str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT tenant, stream_id, version, payload::text FROM es.events").fetchall()
    return {(t, s, v): p for t, s, v, p in rows}


def _assert_lake_equals_store(spark: Any, warehouse: Path, dsn: str) -> None:
    """Event by event, per tenant; every projection agrees with the store; nothing of the erased tenant anywhere."""
    expected = _store_events(dsn)
    rows = tables.read(spark, str(warehouse / "events")).select("tenant", "stream_id", "version", "payload").collect()
    counts = Counter((r["tenant"], r["stream_id"], r["version"]) for r in rows)
    assert not [k for k, n in counts.items() if n > 1], "events duplicated in the lake"
    assert {(r["tenant"], r["stream_id"], r["version"]): r["payload"] for r in rows} == expected
    per_stream = Counter((t, s) for t, s, _ in expected)
    catalog = {(r["tenant"], r["stream_id"]): (r["events"], r["version"])
               for r in tables.read(spark, str(warehouse / "stream_catalog")).collect()}
    assert catalog == {k: (n, n) for k, n in per_stream.items()}  # versions 1..n, each once
    state = {(r["tenant"], r["stream_id"]): r["version"] for r in tables.read(spark, str(warehouse / "stream_state")).collect()}
    assert state == dict(per_stream)
    daily = Counter()
    for r in tables.read(spark, str(warehouse / "event_type_daily")).collect():
        daily[r["tenant"]] += r["events"]
    assert dict(daily) == dict(Counter(t for t, _, _ in expected))


@pytest.mark.slow  # once, on the suite's PostgreSQL; the other majors run the two below (pg_versions)
def test_erasing_a_tenant_under_load_leaves_the_others_exactly_once(
    store: StoreDsn, spark: Any, warehouse: Path
) -> None:
    _seeded_lake(store, spark, warehouse)  # every lake table and the store's snapshots hold each tenant

    stop_writers, stop_extraction = threading.Event(), threading.Event()
    refused: list[str] = []
    errors: list[BaseException] = []
    writers = [threading.Thread(target=_writer, args=(store.writer, t, i * 10 + n, stop_writers, refused))
               for i, t in enumerate(TENANTS) for n in range(2)]
    extractor = Extractor(store.extractor, None, warehouse, source=SOURCE)
    loop = threading.Thread(target=_extract_until, args=(stop_extraction, extractor, errors))
    for t in [*writers, loop]:
        t.start()
    try:
        time.sleep(2)
        with psycopg.connect(store) as conn:
            in_store = conn.execute("SELECT count(*) FROM es.events WHERE tenant = %s", (GONE,)).fetchone()
        done = erase_tenant(_settings(store, warehouse), GONE, wait_seconds=120, progress=lambda _: None)
        time.sleep(1)  # the other tenants go on being written and extracted
    finally:
        stop_writers.set()
        for t in writers:
            t.join()
        stop_extraction.set()
        loop.join()
    assert not errors, errors
    assert refused == [GONE, GONE]  # both of its writers were told, and stopped
    assert done.partition == f"es.{tenants.partition_name(GONE)}"
    assert in_store is not None and done.store_events >= in_store[0] > 0
    assert done.lake_rows["events"] > 0 and done.lake_rows["stream_state"] > 0
    assert done.store_rows["es.snapshots"] > 0 and done.store_rows["es.streams"] > 0

    extract = Extractor(store.extractor, None, warehouse, source=SOURCE)
    for r in split(4):
        extract.run(r)
    assert done.rebuilt == ["stream_state", "stream_catalog", "event_type_daily"]  # they lagged: rebuilt whole
    _project(spark, warehouse, store)
    _assert_lake_equals_store(spark, warehouse, store)
    with psycopg.connect(store) as conn:
        assert tenants.find_partition(conn, SOURCE, GONE) is None
        assert conn.execute("SELECT count(*) FROM es.snapshots WHERE tenant = %s", (GONE,)).fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM es.snapshots WHERE tenant <> %s", (GONE,)).fetchone()[0] > 0
        record = conn.execute("SELECT partition, store_events, lake_rows, finished_at IS NOT NULL "
                              "FROM es_pipeline.tenant_erasures WHERE tenant = %s", (GONE,)).fetchone()
    assert record is not None and record[0] == done.partition and record[3]
    assert record[2]["events"] == done.lake_rows["events"]
    for name in tables.TABLES:  # no Parquet file under any table holds a row of it: data, old versions, change data
        path = str(warehouse / name)
        assert lake_erase.data_files(path), name
        assert lake_erase.leftovers(path, GONE) == [], name
    assert set(lake_erase.tenant_counts(str(warehouse / "events"))) == set(TENANTS) - {GONE}

    # Running it again finds nothing left to do, and changes nothing.
    again = erase_tenant(_settings(store, warehouse), GONE, wait_seconds=30, progress=lambda _: None)
    assert again.partition is None and not any(again.lake_rows.values())




def test_an_up_to_date_projection_goes_on_from_the_erasure_and_a_shared_table_is_refused(
    store: StoreDsn, spark: Any, warehouse: Path
) -> None:
    _seeded_lake(store, spark, warehouse)
    done = erase_tenant(_settings(store, warehouse), GONE, progress=lambda _: None)
    assert done.rebuilt == [] and done.lake_rows["stream_catalog"] == 3 and done.store_events == 3
    # The next updates are increments after the erasure's version, not rebuilds.
    catalog = update_stream_catalog(Engine(spark=spark), warehouse, store_dsn=store.extractor)
    state = update_stream_state(Engine(spark=spark), warehouse, domain=SHOP, store_dsn=store.extractor)
    assert catalog.previous_events_version >= 0 and state.previous_events_version >= 0
    _assert_lake_equals_store(spark, warehouse, store)

    with pytest.raises(TenantRefused, match="has no tenants"):
        erase_tenant(replace(_settings(store, warehouse), source_mapping=load("es")), "acme")
    with pytest.raises(TenantRefused, match="empty tenant"):
        erase_tenant(_settings(store, warehouse), "")


def test_a_partition_dropped_behind_our_back_is_reported(store: StoreDsn, spark: Any, warehouse: Path) -> None:
    writer = EventStore(store.writer)
    for t in TENANTS:
        writer.append("s", "cart", [NewEvent("ItemAdded", {"sku": "a"})] * 2, 0, tenant=t)
    for r in split(2):
        Extractor(store.extractor, None, warehouse, source=SOURCE).run(r)
    counts = lake_erase.tenant_counts(str(warehouse / "events"))
    with psycopg.connect(store, autocommit=True) as conn:
        assert tenants.missing(conn, SOURCE, counts) == {}
        conn.execute(f"DROP TABLE es.{tenants.partition_name('initech')}")
        assert tenants.missing(conn, SOURCE, counts) == {"initech": 2}
    # `status` says so, as the extractor sees it.
    report = status_report(replace(_settings(store, warehouse), pg_dsn=store.extractor))
    assert "tenant 'initech': 2 events in the lake, none in es-tenants (es.events), and no erasure recorded" in report
    assert "tenant 'acme'" not in report
    # And the events check fails, naming it.
    check = reconcile(Engine(spark=spark), warehouse, store.extractor, SOURCE, None)
    assert not check.passed
    assert check.metadata["tenants_lost"] == "initech (2 events; dropped outside `tenant erase`)"


class Killed(Exception):
    """Stands for the erasure's process dying at that point."""


@pytest.mark.slow  # once, on the suite's PostgreSQL
def test_an_erasure_killed_halfway_is_finished_by_running_it_again(
    store: StoreDsn, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _seeded_lake(store, spark, warehouse)
    real = lake_erase.delete_tenant

    def dies_at_stream_catalog(path: str, tenant: str, **kw: Any) -> Any:
        if path.endswith("stream_catalog"):
            raise Killed(path)
        return real(path, tenant, **kw)

    monkeypatch.setattr(lake_erase, "delete_tenant", dies_at_stream_catalog)
    with pytest.raises(Killed):  # after the store's partition and the lake's events and stream_state rows went
        erase_tenant(_settings(store, warehouse), GONE, progress=lambda _: None)
    monkeypatch.setattr(lake_erase, "delete_tenant", real)
    with psycopg.connect(store, autocommit=True) as conn:
        assert tenants.find_partition(conn, SOURCE, GONE) is None
        with pytest.raises(TenantRefused, match="its erasure has not finished"):
            tenants.add(conn, SOURCE, GONE)
        assert tenants.missing(conn, SOURCE, {GONE: 3}) == {}  # recorded: not reported as lost
    again = erase_tenant(_settings(store, warehouse), GONE, progress=lambda _: None)
    assert again.partition is None and again.lake_rows["stream_catalog"] == 3 and again.lake_rows["events"] == 0
    for name in tables.TABLES:
        assert lake_erase.leftovers(str(warehouse / name), GONE) == [], name
    with psycopg.connect(store) as conn:
        assert conn.execute("SELECT partition IS NOT NULL, store_events, finished_at IS NOT NULL "
                            "FROM es_pipeline.tenant_erasures").fetchone() == (True, 3, True)
    update_stream_catalog(Engine(spark=spark), warehouse, store_dsn=store.extractor)
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP, store_dsn=store.extractor)
    _assert_lake_equals_store(spark, warehouse, store)


@pytest.mark.slow  # once, on the suite's PostgreSQL
def test_extraction_goes_on_while_the_erasure_waits_for_a_projections_turn(
    store: StoreDsn, spark: Any, warehouse: Path
) -> None:
    """The slice locks are held for the store's drop and the `events` delete and purge, not for the projections'
    turns: while a long update holds `stream_state`'s turn, the other tenants' events are extracted."""
    from es_pipeline.extraction.slices import SliceRange
    from es_pipeline.lake.kernel.turn import one_at_a_time

    _seeded_lake(store, spark, warehouse)
    held, release, events_done = threading.Event(), threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def hold_the_turn() -> None:  # what a Spark rebuild of stream_state does for tens of seconds
        with one_at_a_time(str(store), "stream_state"):
            held.set()
            release.wait(120)

    def erase() -> None:
        try:
            outcome["done"] = erase_tenant(_settings(store, warehouse), GONE, wait_seconds=60, progress=lambda line: (
                events_done.set() if "extraction goes on" in line else None))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome["error"] = exc

    holder, eraser = threading.Thread(target=hold_the_turn), threading.Thread(target=erase)
    holder.start()
    assert held.wait(30)
    eraser.start()
    try:
        assert events_done.wait(60), outcome
        late = NewEvent("ItemAdded", {"sku": "sku-1", "qty": 1, "unit_price": 2.5})
        EventStore(store.writer).append("late-1", "cart", [late], 0, tenant="acme")
        result = Extractor(store.extractor, None, warehouse, source=SOURCE).run(SliceRange(0, 1023))
        assert result.rows == 1, "extracted while the erasure waits"
        assert eraser.is_alive(), "the erasure still waits for stream_state's turn"
    finally:
        release.set()
        holder.join()
        eraser.join(120)
    assert "error" not in outcome, outcome
    assert outcome["done"].lake_rows["stream_state"] > 0
    _project(spark, warehouse, store)
    _assert_lake_equals_store(spark, warehouse, store)


@pytest.mark.slow  # once, on the suite's PostgreSQL
def test_a_cross_stream_projection_loses_the_tenant_and_is_folded_anew_without_it(
    store: StoreDsn, spark: Any, warehouse: Path
) -> None:
    """A team's cross-stream projection (`sku_sales`): the erasure deletes the tenant's keys at once and records
    frontier 0, so the next update folds every key from `events` again and nothing of the tenant comes back."""
    _seeded_lake(store, spark, warehouse)
    consumer = SOURCE.consumer

    def sales() -> Any:
        return cross_stream.update(warehouse, SHOP, "sku_sales", store_dsn=store.extractor,
                                   frontier=lambda: batch_frontier(store.extractor, consumer))

    def expected() -> dict[tuple[str, str], int]:
        with psycopg.connect(store) as conn:
            return {(t, s): int(n) for t, s, n in conn.execute(
                "SELECT tenant, payload->>'sku', sum((payload->>'qty')::int) FROM es.events "
                "WHERE event_type = 'ItemAdded' GROUP BY 1, 2").fetchall()}

    def held() -> dict[tuple[str, str], int]:
        return {(r["tenant"], r["sku"]): r["units_added"]
                for r in DeltaTable(str(warehouse / "sku_sales")).to_pyarrow_table().to_pylist()}

    assert sales().previous_events_version == -1 and {t for t, _ in held()} == set(TENANTS)
    done = erase_tenant(_settings(store, warehouse), GONE, progress=lambda _: None)
    assert "sku_sales" in done.rebuilt and done.lake_rows["sku_sales"] == 1
    assert GONE not in {t for t, _ in held()}
    assert lake_erase.leftovers(str(warehouse / "sku_sales"), GONE) == []
    writer = EventStore(store.writer)
    writer.append("cart-9", "cart", [NewEvent("ItemAdded", {"sku": "b", "qty": 4})], 0, tenant="acme")
    for r in split(4):
        Extractor(store.extractor, None, warehouse, source=SOURCE).run(r)
    assert sales().previous_events_version == -1  # folded anew, without the tenant
    assert held() == expected() and GONE not in {t for t, _ in expected()}
    assert sales().events_folded == 0  # and increments from there
