"""The native store partitioned by tenant (`ES_PIPELINE_SOURCE=es-tenants`): created so, one partition per tenant."""

from __future__ import annotations

from dataclasses import replace

import psycopg
import pytest

from es_pipeline.errors import IncompatibleSchema, InvalidAppend, TenantRefused, UnknownTenant
from es_pipeline.source.mapping import load, native
from es_pipeline.store import tenants
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline.store.migrations import migrate
from es_pipeline_tests.support.store import make_tenant_store

SOURCE = load("es-tenants")


@pytest.fixture
def bare_tenant_store(empty_dsn: str) -> str:
    """A fresh store partitioned by tenant with no tenant yet (conftest's `tenant_store` holds acme and globex)."""
    make_tenant_store(empty_dsn)
    return empty_dsn


def _add(dsn: str, *names: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in names:
            tenants.add(conn, SOURCE, name)


def test_a_tenant_store_keeps_each_tenant_in_its_own_partition(bare_tenant_store: str) -> None:
    _add(bare_tenant_store, "acme", "globex")
    store = EventStore(bare_tenant_store)
    # The same stream id in two tenants: two streams, each with its own versions.
    assert store.append("cart-1", "cart", [NewEvent("Opened", {"n": 1})], 0, tenant="acme") == 1
    assert store.append("cart-1", "cart", [NewEvent("Opened", {"n": 2}), NewEvent("Added", {})], 0, tenant="globex") == 2
    assert store.append("cart-1", "cart", [NewEvent("Added", {})], 1, tenant="acme") == 2
    # Reads name the tenant too: each tenant's stream is its own.
    assert [e.version for e in store.read_stream("cart-1", tenant="globex")] == [1, 2]
    assert [e.payload for e in store.read_stream("cart-1", tenant="acme")] == [{"n": 1}, {}]
    assert store.stream_version("cart-1", tenant="acme") == 2
    state, version = store.load("cart-1", lambda s, e: {"n": s.get("n", 0) + 1}, revision=1, tenant="globex")
    assert (state, version) == ({"n": 2}, 2)
    with pytest.raises(ValueError, match="partitioned by tenant: pass the stream's tenant"):
        store.read_stream("cart-1")
    with psycopg.connect(bare_tenant_store) as conn:
        rows = conn.execute(
            "SELECT tableoid::regclass::text, tenant, stream_id, version FROM es.events ORDER BY tenant, version"
        ).fetchall()
        bounds = dict(conn.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'es.events'::regclass").fetchall())
    assert [r[1:] for r in rows] == [("acme", "cart-1", 1), ("acme", "cart-1", 2), ("globex", "cart-1", 1),
                                     ("globex", "cart-1", 2)]
    assert {r[0] for r in rows} == {f"es.{tenants.partition_name('acme')}", f"es.{tenants.partition_name('globex')}"}
    assert bounds == {tenants.partition_name("acme"): "FOR VALUES IN ('acme')",
                      tenants.partition_name("globex"): "FOR VALUES IN ('globex')"}


def test_appends_name_a_tenant_that_exists(bare_tenant_store: str) -> None:
    _add(bare_tenant_store, "acme")
    store = EventStore(bare_tenant_store)
    with pytest.raises(UnknownTenant, match="tenant add initech"):
        store.append("s", "t", [NewEvent("E", {})], 0, tenant="initech")
    with pytest.raises(InvalidAppend, match="partitioned by tenant: pass the stream's tenant"):
        store.append("s", "t", [NewEvent("E", {})], 0)
    # A stream of a tenant whose partition and streams were dropped (an erasure): told so, not a version conflict.
    store.append("s", "t", [NewEvent("E", {})], 0, tenant="acme")
    with psycopg.connect(bare_tenant_store, autocommit=True) as conn:
        conn.execute(f"DROP TABLE es.{tenants.partition_name('acme')}")
        conn.execute("DELETE FROM es.streams WHERE tenant = 'acme'")
    with pytest.raises(UnknownTenant, match="tenant add acme"):
        store.append("s", "t", [NewEvent("E", {})], 1, tenant="acme")
    with psycopg.connect(bare_tenant_store) as conn:  # the refused appends claimed no stream either
        assert conn.execute("SELECT count(*) FROM es.streams").fetchone() == (0,)


def test_the_append_only_guard_holds_on_each_partition(bare_tenant_store: str) -> None:
    _add(bare_tenant_store, "acme")
    EventStore(bare_tenant_store).append("s", "t", [NewEvent("E", {})], 0, tenant="acme")
    part = tenants.partition_name("acme")
    for statement in (f"DELETE FROM es.{part}", f"UPDATE es.{part} SET event_type = 'x'", f"TRUNCATE es.{part}",
                      "DELETE FROM es.events"):
        with psycopg.connect(bare_tenant_store) as conn, pytest.raises(psycopg.errors.RestrictViolation):
            conn.execute(statement)


def test_adding_a_tenant_twice_is_a_no_op_and_only_the_tenant_store_has_tenants(
    bare_tenant_store: str, dsn: str,
) -> None:
    with psycopg.connect(bare_tenant_store, autocommit=True) as conn:
        first, created = tenants.add(conn, SOURCE, "acme")
        again, created_again = tenants.add(conn, SOURCE, "acme")
        assert created and not created_again and first == again
        with pytest.raises(TenantRefused, match="empty tenant"):
            tenants.add(conn, SOURCE, "")
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(TenantRefused, match="not es_pipeline's store"):
        tenants.add(conn, native("es"), "acme")
    with pytest.raises(InvalidAppend, match="has no tenants .* pass no tenant"):
        EventStore(dsn).append("s", "t", [NewEvent("E", {})], 0, tenant="acme")


def test_a_store_keeps_the_layout_it_was_created_with(bare_tenant_store: str, dsn: str) -> None:
    assert migrate(bare_tenant_store, tenants=True) == []
    with pytest.raises(IncompatibleSchema, match="partitioned by tenant: set ES_PIPELINE_SOURCE=es-tenants"):
        migrate(bare_tenant_store)
    with pytest.raises(IncompatibleSchema, match="created without tenants"):
        migrate(dsn, tenants=True)


def test_partition_names_are_short_and_distinct() -> None:
    long = "x" * 500
    names = {tenants.partition_name(t) for t in ("Acme", "acme", "a-c-m-e", long, "ÄCME", "a b")}
    assert len(names) == 6 and all(len(n.encode()) <= 63 for n in names)


def test_a_tenant_named_otherwise_than_its_column_spells_it_is_refused(empty_dsn: str) -> None:
    """A cast that truncates (varchar(n)) or respells (uuid) would find another tenant's partition, or erase the
    store under one name and the lake under another: refused, naming the column's spelling."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app; CREATE TABLE app.ev (t varchar(8) NOT NULL, u uuid, id text, v int, "
                     "tx_id xid8) PARTITION BY LIST (t); "
                     "CREATE TABLE app.ev_acme PARTITION OF app.ev FOR VALUES IN ('acme-cor')")
        source = replace(SOURCE, name="x", schema="app", table="ev", tenant="t", native=False)
        assert tenants.find_partition(conn, source, "acme-cor") is not None
        with pytest.raises(TenantRefused, match="reads 'acme-cor'"):
            tenants.find_partition(conn, source, "acme-corp-eu")
        conn.execute("CREATE TABLE app.ev2 (u uuid NOT NULL) PARTITION BY LIST (u); CREATE TABLE app.ev2_a PARTITION OF "
                     "app.ev2 FOR VALUES IN ('847ed188-9e8b-4d23-8eb4-9126ebd77a4d')")
        by_uuid = replace(source, table="ev2", tenant="u")
        with pytest.raises(TenantRefused, match="reads '847ed188-9e8b-4d23-8eb4-9126ebd77a4d'"):
            tenants.find_partition(conn, by_uuid, "847ED1889E8B4D238EB49126EBD77A4D")
        assert tenants.find_partition(conn, by_uuid, "847ed188-9e8b-4d23-8eb4-9126ebd77a4d") is not None


def test_a_tenant_is_not_added_back_while_its_erasure_is_unfinished(bare_tenant_store: str) -> None:
    with psycopg.connect(bare_tenant_store, autocommit=True) as conn:
        tenants.record_start(conn, SOURCE.consumer, "acme", None, 0)
        with pytest.raises(TenantRefused, match="its erasure has not finished"):
            tenants.add(conn, SOURCE, "acme")
        tenants.record_finish(conn, SOURCE.consumer, "acme", {"events": 3})
        tenants.record_start(conn, SOURCE.consumer, "acme", None, 0)  # a finished erasure run again
        tenants.record_finish(conn, SOURCE.consumer, "acme", {"events": 0})
        assert conn.execute("SELECT lake_rows FROM es_pipeline.tenant_erasures").fetchone() == ({"events": 3},)
        assert tenants.add(conn, SOURCE, "acme")[1]  # finished: the tenant may come back, as a new one
