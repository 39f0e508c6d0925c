"""Typed event tables (lake/typed/event_tables.py): every event of the store in its type's table exactly once, each payload
field in its column or in `_overflow`, through concurrent writers, payloads that change shape, killed runs, a
lost change feed and hundreds of types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from shop.domain import domain as SHOP

from es_pipeline.dev.workload import run_workload
from es_pipeline.domain import Domain, Event
from es_pipeline.errors import DomainError
from es_pipeline.lake.delta import tables
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.read import query
from es_pipeline.lake.typed import event_tables, typed_rows
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.lakecheck import extract_all, same_value
from es_pipeline_tests.support.roles import StoreDsn

PLAIN = Domain("plain")  # no upcasters: payloads as stored


def assert_typed_tables_equal_the_store(dsn: str, warehouse: Path, domain: Domain = PLAIN) -> int:
    """Event by event: each event of the store is one row of its type's table (the mapping says which), whose
    columns and `_overflow` together hold its payload (upcast where `domain` says so); no other row. The count."""
    with psycopg.connect(dsn) as conn:
        store = conn.execute("SELECT coalesce(NULL, ''), stream_id, stream_type, version, event_type, payload::text "
                             "FROM es.events").fetchall()
    mapping = DeltaTable(str(warehouse / event_tables.NAME)).to_pyarrow_table().to_pylist()
    table_of = {r["event_type"]: r["table_name"] for r in mapping}
    held: dict[tuple[str, str, int], dict[str, Any]] = {}
    for name in set(table_of.values()):
        for row in DeltaTable(str(warehouse / name)).to_pyarrow_table().to_pylist():
            key = (row["tenant"], row["stream_id"], row["version"])
            assert key not in held, f"{key} twice in the typed tables"
            held[key] = {**row, "_table": name}
    assert len(held) == len(store), (len(held), len(store))
    for tenant, stream_id, stream_type, version, event_type, text in store:
        row = held[(tenant, stream_id, version)]
        assert row["_table"] == table_of[domain.base_type(event_type)] and row["event_type"] == event_type
        payload = json.loads(text)
        if event_type in {u.event_type for u in domain.upcasters.values()}:
            payload = domain.upcast(stream_type, Event(stream_id, version, event_type, payload)).payload
        spilled = json.loads(row["_overflow"]) if row["_overflow"] else {}
        if not isinstance(payload, dict):  # no object: kept whole
            assert spilled == {"$payload": payload}, (stream_id, version)
            continue
        for field, value in payload.items():
            column = typed_rows.column_for(field, row)
            if field in spilled:
                assert spilled[field] == value and (column is None or row[column] is None), (stream_id, version, field)
            else:
                assert column is not None and same_value(row[column], value), (stream_id, version, field, row.get(column))
        payload_columns = [c for c in row if c not in typed_rows.ENVELOPE.names and c != "_table"]
        for column in payload_columns:  # no value from nowhere
            assert row[column] is None or typed_rows.field_of(column) in payload, (stream_id, version, column)
    return len(store)


def _assert_duckdb_reads_every_typed_table(warehouse: Path) -> None:
    """Each typed table as DuckDB's delta reader counts it: delta-rs's count (no column type it cannot read)."""
    con, _ = query.duckdb_connection(warehouse)
    for name in event_tables.table_names(warehouse):
        got = con.execute(f'SELECT count(*) FROM delta_scan(\'{warehouse / name}\')').fetchone()
        assert got is not None and got[0] == DeltaTable(str(warehouse / name)).to_pyarrow_table().num_rows, name
    con.close()


def _append(store: EventStore, stream: str, *events: tuple[str, dict[str, Any]]) -> None:
    version = 0
    with psycopg.connect(store.dsn) as conn:
        row = conn.execute("SELECT max(version) FROM es.events WHERE stream_id = %s", (stream,)).fetchone()
        version = row[0] or 0 if row else 0
    store.append(stream, "probe", [NewEvent(t, p) for t, p in events], version)


@pytest.mark.parametrize("domain", [PLAIN, pytest.param(SHOP, marks=pytest.mark.slow)], ids=["as-stored", "upcast"])
def test_typed_tables_hold_every_event_once_through_writers_new_shapes_and_a_killed_update(
    dsn: StoreDsn, warehouse: Path, domain: Domain, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = EventStore(dsn)
    run_workload(store, streams=40, events=600, writers=4, rollback_rate=0.1, max_commit_delay=0.01, seed=7)
    _append(store, "probe-0", ("Measured", {"detail": {"a": 1}, "big": 2**60 + 1}))
    extract_all(dsn.extractor, None, warehouse)
    built = event_tables.update(warehouse, domain)
    assert built.full_rebuild and built.events_folded == 601 and "events_item_added" in built.figures["new_tables"]
    assert_typed_tables_equal_the_store(dsn, warehouse, domain)

    # Payloads change shape: a new field, an int widened to double, a number where a string was, a
    # conflicting object, odd names, an outsize integer, a payload that is no object, an envelope name.
    _append(store, "probe-1", ("ItemAdded", {"sku": "s-1", "qty": 2.5, "unit_price": 1.0, "gift": True}),
            ("Deposited", {"amount": {"value": 3}, "currency": "EUR"}),
            ("Opened", {"owner": 42, "currency": "EUR", "version": 7, "Owner": "case clash", "odd-name": 1}),
            ("Deposited", {"amount": 123456789012345678901}),
            ("weird.type", {"x": [1, "two", {"three": 3}]}),
            ("Measured", {"detail": {"a": 2, "b": None}}),  # a nested field seen only as null: no `void` column
            ("Measured", {"big": 0.5}),  # a large whole number widened to double
            ("Opened", {"version": 1, "payload_version": 2}))  # two fields for one column: the second is overflow
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO es.events (stream_id, stream_type, version, event_type, payload) "
                     "VALUES ('probe-2', 'probe', 1, 'Deposited', '[1, 2]'::jsonb)")
    run_workload(store, streams=10, events=150, writers=3, rollback_rate=0.1, max_commit_delay=0.01, seed=8)
    extract_all(dsn.extractor, None, warehouse)
    grown = event_tables.update(warehouse, domain)
    assert not grown.full_rebuild and grown.events_folded == 159
    assert "events_item_added.qty: bigint → double" in grown.figures["widened_columns"]
    assert "events_item_added.gift boolean" in grown.figures["new_columns"]
    assert grown.figures["overflow/events_deposited"] >= 3 and grown.figures["overflow/events_opened"] >= 2
    assert_typed_tables_equal_the_store(dsn, warehouse, domain)
    history = DeltaTable(str(warehouse / event_tables.NAME)).to_pyarrow_table().to_pylist()
    qty = [(r["data_type"], r["change"]) for r in history if r["table_name"] == "events_item_added"
           and r["column_name"] == "qty"]
    assert qty == [("bigint", "added"), ("double", "widened from bigint")]
    assert ("weird.type", "events_weird_type") in {(r["event_type"], r["table_name"]) for r in history}
    assert "events_measured.big: bigint → double" in grown.figures["widened_columns"]
    _assert_duckdb_reads_every_typed_table(warehouse)

    # A run killed after some tables took their rows and before the cursor: the replay adds nothing twice.
    run_workload(store, streams=10, events=200, writers=3, rollback_rate=0.1, max_commit_delay=0.01, seed=9)
    extract_all(dsn.extractor, None, warehouse)
    real_write, calls = event_tables.write_deltalake, [0]

    def dies_on_the_third(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("killed")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(event_tables, "write_deltalake", dies_on_the_third)
    monkeypatch.setattr(event_tables, "WINDOW", 1)  # one `events` commit per window: the replay goes window by window
    with pytest.raises(RuntimeError, match="killed"):
        event_tables.update(warehouse, domain)
    monkeypatch.setattr(event_tables, "write_deltalake", real_write)
    replayed = event_tables.update(warehouse, domain)
    assert not replayed.full_rebuild and 0 < replayed.events_folded < 200  # the tables written before the kill are skipped
    assert replayed.events_version == DeltaTable(str(warehouse / "events")).version()
    assert_typed_tables_equal_the_store(dsn, warehouse, domain)
    assert event_tables.update(warehouse, domain).events_folded == 0


def test_a_lost_change_feed_rebuilds_and_a_new_definition_too(dsn: StoreDsn, warehouse: Path) -> None:
    store = EventStore(dsn)
    run_workload(store, streams=20, events=200, writers=2, rollback_rate=0, max_commit_delay=0, seed=3)
    _append(store, "b-1", ("Backup", {"x": 1}))
    foreign = warehouse / "events_backup"  # a table someone else keeps, under a name a type would take
    write_deltalake(str(foreign), pa.table({"kept": [1, 2, 3]}))
    extract_all(dsn.extractor, None, warehouse)
    event_tables.update(warehouse, PLAIN)
    assert DeltaTable(str(foreign)).to_pyarrow_table().num_rows == 3
    backup = event_tables.table_name("Backup")
    assert [n for n in event_tables.table_names(warehouse) if n.startswith(backup)] == [f"{backup}_{_hash('Backup')}"]
    run_workload(store, streams=5, events=50, writers=1, rollback_rate=0, max_commit_delay=0, seed=4)
    extract_all(dsn.extractor, None, warehouse)
    events = DeltaTable(str(warehouse / "events"))
    events.optimize.compact()  # rewrites the files, then the old ones go: the feed of the last commits is lost
    events.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    rebuilt = event_tables.update(warehouse, PLAIN)
    assert rebuilt.full_rebuild and rebuilt.events_folded == 251
    assert_typed_tables_equal_the_store(dsn, warehouse)
    # The shop's upcaster: the cart tables hold the upcast payloads, built anew; then on, and back to the first
    # definition: built anew again, never appended to tables another definition built (no event twice).
    assert event_tables.update(warehouse, SHOP).full_rebuild
    assert_typed_tables_equal_the_store(dsn, warehouse, SHOP)
    run_workload(store, streams=5, events=50, writers=1, rollback_rate=0, max_commit_delay=0, seed=5)
    extract_all(dsn.extractor, None, warehouse)
    assert not event_tables.update(warehouse, SHOP).full_rebuild
    assert event_tables.update(warehouse, PLAIN).full_rebuild
    assert assert_typed_tables_equal_the_store(dsn, warehouse) == 301
    assert DeltaTable(str(foreign)).to_pyarrow_table().num_rows == 3


@pytest.mark.slow
def test_three_hundred_types_stay_cheap_and_a_tick_touches_only_its_types(dsn: StoreDsn, warehouse: Path) -> None:
    store = EventStore(dsn)
    for i in range(300):
        _append(store, f"s-{i}", (f"Type{i}Happened", {"n": i, "label": f"t{i}"}))
    extract_all(dsn.extractor, None, warehouse)
    built = event_tables.update(warehouse, PLAIN)
    assert len(built.figures["new_tables"].split(", ")) == 300 and len(tables.table_names(warehouse, event_tables.PREFIX)) == 300
    versions = {n: DeltaTable(tables.table_path(warehouse, n)).version()
                for n in tables.table_names(warehouse, event_tables.PREFIX)}
    for i in range(5):
        _append(store, f"s-{i}", (f"Type{i}Happened", {"n": -i, "extra": True}))
    extract_all(dsn.extractor, None, warehouse)
    tick = event_tables.update(warehouse, PLAIN)
    assert sorted(tick.figures["tables"].split(", ")) == sorted(event_tables.table_name(f"Type{i}Happened") for i in range(5))
    for name, version in versions.items():
        moved = DeltaTable(tables.table_path(warehouse, name)).version() != version
        assert moved == (name in tick.figures["tables"].split(", ")), name
    assert_typed_tables_equal_the_store(dsn, warehouse)


def test_a_declared_payload_schema_wins_over_inference(dsn: StoreDsn, warehouse: Path) -> None:
    declared = Domain("declared")
    declared.event_schema("Measured", pa.schema([("at", pa.timestamp("us", tz="UTC")), ("reading", pa.float64()),
                                                  ("unit", pa.string())]))
    store = EventStore(dsn)
    _append(store, "m-1", ("Measured", {"at": "2026-11-26T10:00:00Z", "reading": 1, "unit": "C"}))
    extract_all(dsn.extractor, None, warehouse)
    first = event_tables.update(warehouse, declared)
    assert first.figures["overflow_values"] == 0
    _append(store, "m-2", ("Measured", {"at": "not a time", "reading": "high", "unit": 5, "extra": True}),
            ("Measured", {"at": "2026-11-26T11:30:00+01:00", "reading": 2.5}))
    extract_all(dsn.extractor, None, warehouse)
    second = event_tables.update(warehouse, declared)
    assert second.figures["widened_columns"] == "-" and second.figures["new_columns"] == "events_measured.extra boolean"
    table = DeltaTable(str(warehouse / "events_measured"))
    assert [(f.name, f.type) for f in pa.schema(table.schema().to_arrow()) if f.name in ("at", "reading", "unit")] == \
        [("at", pa.timestamp("us", tz="UTC")), ("reading", pa.float64()), ("unit", pa.string())]
    rows = {(r["stream_id"], r["version"]): r for r in table.to_pyarrow_table().to_pylist()}
    one, odd, late = rows[("m-1", 1)], rows[("m-2", 1)], rows[("m-2", 2)]
    assert one["at"].isoformat() == "2026-11-26T10:00:00+00:00" and one["reading"] == 1.0 and one["unit"] == "C"
    assert odd["at"] is None and odd["reading"] is None and odd["unit"] == "5" and odd["extra"] is True
    assert json.loads(odd["_overflow"]) == {"at": "not a time", "reading": "high"}
    assert late["at"].isoformat() == "2026-11-26T10:30:00+00:00" and late["reading"] == 2.5
    with pytest.raises(DomainError, match="two payload schemas"):
        declared.event_schema("Measured", pa.schema([("at", pa.string())]))


def _hash(event_type: str) -> str:
    import hashlib

    return hashlib.sha1(event_type.encode()).hexdigest()[:8]


@pytest.mark.slow  # make check's budget: the rule itself is checked in test_typed_values / test_state_json
def test_declared_and_widened_values_are_the_same_built_by_increments_or_at_once(dsn: StoreDsn,
                                                                                 warehouse: Path) -> None:
    """The four scenarios of issue 40's first item, replayed through Delta: a number never becomes a date, a
    declared map and decimal are kept, a whole number widened twice reads `1`, a value `_overflow` kept moves into
    the column that comes for it; and the tables equal those a rebuild makes of the same events."""
    declared = Domain("declared-due")
    declared.event_schema("Due", pa.schema([("due", pa.date32()), ("price", pa.decimal128(10, 2)),
                                            ("tags", pa.map_(pa.string(), pa.int64()))]))
    store = EventStore(dsn)
    for batch in ([("d-1", {"due": 45000, "price": 12.5, "tags": {"a": 1}, "n": 1})],
                  [("d-2", {"due": "2024-05-01", "price": "3.10", "tags": {"b-c": 2}, "n": 1.5}),
                   ("d-3", {"n": [], "m": {}})],
                  [("d-4", {"n": "x", "m": {"k": 1}, "price": 1.234})]):
        for stream, payload in batch:
            _append(store, stream, ("Due", payload))
        extract_all(dsn.extractor, None, warehouse)
        event_tables.update(warehouse, declared)

    def rows() -> dict[str, dict[str, Any]]:
        table = DeltaTable(str(warehouse / "events_due")).to_pyarrow_table()
        return {r["stream_id"]: {k: (json.loads(v) if k == "_overflow" and v else v) for k, v in r.items()
                                 if k not in ("recorded_at", "tx_id", "global_position")} for r in table.to_pylist()}

    by_increments = rows()
    one, two, three, four = (by_increments[s] for s in ("d-1", "d-2", "d-3", "d-4"))
    assert one["due"] is None and one["_overflow"] == {"due": 45000}
    assert str(two["due"]) == "2024-05-01" and str(two["price"]) == "3.10" and two["tags"] == [("b-c", 2)]
    assert str(one["price"]) == "12.50" and one["tags"] == [("a", 1)]
    assert [one["n"], two["n"], four["n"]] == ["1", "1.5", "x"]
    assert three["m"] == {"k": None} and three["_overflow"] == {"n": []} and four["m"] == {"k": 1}
    assert four["price"] is None and four["_overflow"] == {"price": 1.234}
    _append(store, "o-1", ("Other", {"x": 1}))
    extract_all(dsn.extractor, None, warehouse)
    events = DeltaTable(str(warehouse / "events"))
    events.optimize.compact()  # the change feed lost: the next update builds every typed table at once
    events.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    assert event_tables.update(warehouse, declared).full_rebuild
    assert rows() == by_increments
    assert_typed_tables_equal_the_store(dsn, warehouse)


def _typed_tables(warehouse: Path) -> dict[str, tuple[list[str], dict[tuple[str, str, int], dict[str, Any]]]]:
    """Each typed table: its columns (sorted: the two engines may order new columns differently) and its rows by
    event key."""
    out = {}
    for name in event_tables.table_names(warehouse)[1:]:
        rows = DeltaTable(str(warehouse / name)).to_pyarrow_table()
        out[name] = (sorted(rows.column_names), {(r["tenant"], r["stream_id"], r["version"]): r
                                                for r in rows.to_pylist()})
    return out


@pytest.mark.slow
def test_a_build_on_spark_equals_the_build_in_process_and_increments_go_on_from_it(
    dsn: StoreDsn, spark: Any, warehouse: Path
) -> None:
    """Issue 42: the whole build shaped, typed and written on Spark (committed by delta-rs with the same ids) holds
    every event once, as the in-process build does, column for column and row for row (odd shapes and upcasters
    included); the next update goes on from it in process."""
    store = EventStore(dsn)
    run_workload(store, streams=30, events=500, writers=2, rollback_rate=0.1, max_commit_delay=0, seed=42)
    _append(store, "odd-1", ("Measured", {"detail": {"a": 1}, "big": 2**60 + 1}),
            ("Opened", {"owner": 42, "currency": "EUR", "version": 7, "Owner": "case clash", "odd-name": 1}),
            ("Deposited", {"amount": 123456789012345678901}), ("weird.type", {"x": [1, "two", {"three": 3}]}),
            ("Measured", {"detail": {"a": 2, "b": None}, "big": 0.5, "tags": [None, 1]}))
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO es.events (stream_id, stream_type, version, event_type, payload) "
                     "VALUES ('odd-2', 'probe', 1, 'Deposited', '[1, 2]'::jsonb)")
    extract_all(dsn.extractor, None, warehouse)
    built = event_tables.update(warehouse, SHOP, store_dsn=dsn.extractor, engine=Engine("spark", spark))
    assert built.full_rebuild and built.engine == "spark" and built.metadata()["engine"] == "spark"
    total = assert_typed_tables_equal_the_store(dsn, warehouse, SHOP)
    assert built.events_folded == total and "events_item_added" in built.figures["new_tables"]
    on_spark = _typed_tables(warehouse)
    spark_mapping = {(r["event_type"], r["table_name"], r["column_name"], r["data_type"]) for r in
                     DeltaTable(str(warehouse / event_tables.NAME)).to_pyarrow_table().to_pylist()}
    for name in built.figures["tables"].split(", "):  # the executors' files, committed by delta-rs
        uris = DeltaTable(str(warehouse / name)).file_uris()
        assert uris and all("/spark-build-" in u for u in uris), (name, uris[:2])
    assert event_tables.update(warehouse, SHOP, engine=Engine("spark", spark)).events_folded == 0  # the cursor: committed

    DeltaTable(str(warehouse / event_tables.NAME)).alter.set_table_properties(
        {event_tables.BUILT_FOR: event_tables.BUILDING}, raise_if_not_exists=False)  # built again, in process
    local = event_tables.update(warehouse, SHOP, engine=Engine("local", spark))
    assert local.full_rebuild and local.engine == "local" and local.events_folded == built.events_folded
    assert local.figures["tables"] == built.figures["tables"]
    assert local.figures["overflow_values"] == built.figures["overflow_values"]
    assert _typed_tables(warehouse) == on_spark
    assert {(r["event_type"], r["table_name"], r["column_name"], r["data_type"]) for r in
            DeltaTable(str(warehouse / event_tables.NAME)).to_pyarrow_table().to_pylist()} == spark_mapping

    DeltaTable(str(warehouse / event_tables.NAME)).alter.set_table_properties(
        {event_tables.BUILT_FOR: event_tables.BUILDING}, raise_if_not_exists=False)  # on Spark again, over tables that exist
    assert event_tables.update(warehouse, SHOP, engine=Engine("spark", spark)).engine == "spark"
    _append(store, "odd-1", ("Measured", {"big": "now a string", "new_field": True}))
    run_workload(store, streams=5, events=60, writers=1, rollback_rate=0, max_commit_delay=0, seed=43)
    extract_all(dsn.extractor, None, warehouse)
    grown = event_tables.update(warehouse, SHOP, engine=Engine("spark", spark))
    assert not grown.full_rebuild and grown.engine == "local" and grown.events_folded == 61
    assert "events_measured.new_field boolean" in grown.figures["new_columns"]
    assert_typed_tables_equal_the_store(dsn, warehouse, SHOP)


def test_an_increment_stopped_at_a_feed_it_cannot_read_says_it_did_not_catch_up(
    dsn: StoreDsn, warehouse: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tailing run's follow (`increment`) folds the windows it can read and stops at one it cannot: the result says
    it is short of `events`, so the run does not report the tables as kept up (lake/follow.py)."""
    store = EventStore(dsn)
    run_workload(store, streams=10, events=60, writers=1, rollback_rate=0, max_commit_delay=0, seed=6)
    extract_all(dsn.extractor, None, warehouse, 1)
    event_tables.update(warehouse, PLAIN)
    monkeypatch.setattr(event_tables, "WINDOW", 1)  # a window per commit: the first readable, the second not
    for seed in (7, 8):
        run_workload(store, streams=5, events=10, writers=1, rollback_rate=0, max_commit_delay=0, seed=seed)
        extract_all(dsn.extractor, None, warehouse, 1)
    events = warehouse / "events"
    last = DeltaTable(str(events)).version()
    log = (events / "_delta_log" / f"{last:020d}.json").read_text().splitlines()
    for action in (json.loads(line) for line in log):
        if "add" in action:  # the last commit's files gone, as a vacuum leaves a compacted table's
            (events / action["add"]["path"]).unlink()
    short = event_tables.increment(warehouse, PLAIN)
    assert short is not None and short.events_folded == 10 and not short.caught_up
    assert event_tables.increment(warehouse, PLAIN) is None, "nothing more it can read"
