"""State history (lake/state/history.py): every history table, and `state_as_of` at any moment, equal to a fold of
the store up to that moment, computed here from `es.events` (never from the lake).

The shop keeps every state of its carts (`history=True`) and its accounts' state at the end of each UTC day
(`history="daily"`). Concurrent writers with rollbacks and out-of-order commits write carts and accounts "now";
accounts of days past are written beside them with their own `recorded_at` (some going backwards within a
stream, as a transaction's start time can), over several increments: the first build without a JVM, a small
increment (delta-rs MERGE), an increment on Spark (Spark's MERGE), a revision (the types rebuilt).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.dev.workload import run_workload
from es_pipeline.domain import Domain, Event
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.read import query
from es_pipeline.lake.read.as_of import as_of_spark
from es_pipeline.lake.read.catalog import register_tables
from es_pipeline.lake.state import history
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.hooks import no_spark
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn

UTC = dt.UTC
DAY0 = dt.datetime(2026, 10, 28, 9, 0, tzinfo=UTC)


def _store_events(dsn: StoreDsn) -> dict[tuple[str, str], list[tuple[int, str, dict[str, Any], dt.datetime]]]:
    """Every stream's events from the store, in version order: {(type, stream): [(version, type, payload, at)]}."""
    out: dict[tuple[str, str], list[tuple[int, str, dict[str, Any], dt.datetime]]] = {}
    with psycopg.connect(dsn) as conn:
        for stream_id, stream_type, version, event_type, payload, at in conn.execute(
                "SELECT stream_id, stream_type, version, event_type, payload, recorded_at FROM es.events "
                "ORDER BY stream_id, version"):
            out.setdefault((stream_type, stream_id), []).append((version, event_type, payload, at))
    return out


def _states(domain: Domain, stream_type: str, stream_id: str,
            events: list[tuple[int, str, dict[str, Any], dt.datetime]]) -> list[tuple[int, dt.datetime, dict[str, Any]]]:
    """(version, the running maximum of recorded_at up to it, the state after it) for each event of a stream."""
    fold = domain.folds[stream_type].fold
    state: dict[str, Any] = {}
    high: dt.datetime | None = None
    out = []
    for version, event_type, payload, at in events:
        state = fold(state, Event(stream_id, version, event_type, payload))
        high = at if high is None or at > high else high
        out.append((version, high, json.loads(json.dumps(state))))
    return out


def expected_rows(dsn: StoreDsn, domain: Domain, stream_type: str) -> dict[tuple[str, int], tuple[Any, ...]]:
    """The history table of `stream_type` as a fold of the store gives it: {(stream, version_from): (version_to,
    valid_from, valid_to, state)}; "daily": the last state of each UTC day of the running maximum, from the
    day's first change."""
    daily = domain.folds[stream_type].history != "each"
    out: dict[tuple[str, int], tuple[Any, ...]] = {}
    for (kind, stream_id), events in _store_events(dsn).items():
        if kind != stream_type:
            continue
        rows: list[list[Any]] = []
        for version, high, state in _states(domain, kind, stream_id, events):
            if daily and rows and rows[-1][2].date() == high.date():
                rows[-1][1], rows[-1][3] = version, state  # the day's last state, from its first change
            else:
                rows.append([version, version, high, state])
        for i, (first, last, high, state) in enumerate(rows):
            out[(stream_id, first)] = (last, high, rows[i + 1][2] if i + 1 < len(rows) else None, state)
    return out


def lake_rows(warehouse: Path, stream_type: str) -> dict[tuple[str, int], tuple[Any, ...]]:
    table = DeltaTable(str(warehouse / history.table_name(stream_type))).to_pyarrow_table()
    rows = {}
    for r in table.to_pylist():
        assert r["is_current"] == (r["valid_to"] is None), r
        state = json.loads(r["state"])
        if stream_type == "account":
            assert r["balance"] == state["balance"], r  # the typed column, as the JSON has it
        else:
            assert r["total"] == state["total"] and r["status"] == state["status"], r
        rows[(r["stream_id"], r["version_from"])] = (r["version_to"], r["valid_from"], r["valid_to"], state)
    assert len(rows) == table.num_rows, "one row per (stream, version_from)"
    return rows


def expected_as_of(dsn: StoreDsn, domain: Domain, stream_type: str,
                   moment: dt.datetime) -> dict[str, tuple[int, dict[str, Any]]]:
    """Each stream's (version, state) at `moment`: after its last event whose running maximum is not after it."""
    out = {}
    for (kind, stream_id), events in _store_events(dsn).items():
        if kind == stream_type:
            held = [(v, s) for v, high, s in _states(domain, kind, stream_id, events) if high <= moment]
            if held:
                out[stream_id] = held[-1]
    return out


def expected_as_of_daily(dsn: StoreDsn, domain: Domain, stream_type: str,
                         moment: dt.datetime) -> dict[str, tuple[int, dict[str, Any]]]:
    """With `history="daily"`, each stream's (version, state) at `moment` as docs/domain.md promises it: the last state
    of the day `moment` falls in once that day's first change came, else the last state of its day before."""
    return {stream_id: (last, state)
            for (stream_id, _), (last, valid_from, valid_to, state) in expected_rows(dsn, domain, stream_type).items()
            if valid_from <= moment and (valid_to is None or moment < valid_to)}


def _as_of_duckdb(warehouse: Path, stream_type: str, moment: dt.datetime) -> dict[str, tuple[int, dict[str, Any]]]:
    rows = query.run(warehouse, f"SELECT stream_id, version, state FROM state_as_of('{stream_type}', "
                                f"TIMESTAMPTZ '{moment.isoformat()}')").rows
    return {r["stream_id"]: (r["version"], json.loads(r["state"])) for r in rows.to_pylist()}


def _past_accounts(dsn: StoreDsn, wave: int) -> None:
    """Accounts written with their own recorded_at on days past, in transactions committed out of their order: each
    wave goes on with the same streams, some events of a day after a later one (recorded_at going backwards)."""
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        for n in range(6):
            stream_id = f"past-account-{n}"
            base = DAY0 + dt.timedelta(days=3 * wave + n % 3)
            events = [("Opened", {"owner": f"o{n}", "currency": "EUR"}, base)] if wave == 0 else []
            events += [("Deposited", {"amount": 10.0 * (n + 1)}, base + dt.timedelta(hours=2)),
                       ("Withdrawn", {"amount": 3.0}, base - dt.timedelta(hours=1)),  # earlier than the one before
                       ("Deposited", {"amount": 1.5}, base + dt.timedelta(days=1, hours=5))]
            conn = first if n % 2 else second
            have = conn.execute("SELECT coalesce(max(version), 0) FROM es.events WHERE stream_id = %s",
                                (stream_id,)).fetchone()[0]  # type: ignore[index]
            for i, (kind, payload, at) in enumerate(events):
                conn.execute("INSERT INTO es.events (stream_id, stream_type, version, event_type, payload, recorded_at) "
                             "VALUES (%s, 'account', %s, %s, %s, %s)", (stream_id, have + i + 1, kind,
                                                                          json.dumps(payload), at))
        second.commit()  # the later transaction's xid commits first
        first.commit()


def _check(dsn: StoreDsn, warehouse: Path, domain: Domain = SHOP) -> None:
    for stream_type in ("cart", "account"):
        assert lake_rows(warehouse, stream_type) == expected_rows(dsn, domain, stream_type), stream_type
    with psycopg.connect(dsn) as conn:
        moments = [m for (m,) in conn.execute(
            "SELECT DISTINCT recorded_at FROM es.events WHERE stream_type = 'cart' ORDER BY 1").fetchall()]
        days = [d for (d,) in conn.execute("SELECT DISTINCT (recorded_at AT TIME ZONE 'UTC')::date FROM es.events "
                                           "WHERE stream_type = 'account' ORDER BY 1").fetchall()]
    picked = [moments[0] - dt.timedelta(seconds=1), *moments[:: max(1, len(moments) // 6)], moments[-1]]
    for moment in picked:  # every state is exact at any moment
        assert _as_of_duckdb(warehouse, "cart", moment) == expected_as_of(dsn, domain, "cart", moment), moment
    for day in days:  # the state at the end of each day is exact
        end = dt.datetime.combine(day, dt.time.max, UTC)
        assert _as_of_duckdb(warehouse, "account", end) == expected_as_of(dsn, domain, "account", end), day
        for hour in (0, 6, 12, 18):  # within a day: that day's last state once its first change came (docs/domain.md)
            within = dt.datetime.combine(day, dt.time(hour), UTC)
            assert _as_of_duckdb(warehouse, "account", within) == expected_as_of_daily(dsn, domain, "account", within)


def test_history_and_state_as_of_equal_a_fold_of_the_store_on_every_path(
    dsn: StoreDsn, spark: Any, warehouse: Path
) -> None:
    store = EventStore(dsn.writer)
    run_workload(store, streams=30, events=240, writers=3, rollback_rate=0.15, max_commit_delay=0.01, seed=45)
    _past_accounts(dsn, 0)
    extract_all(dsn.extractor, None, warehouse)
    built = update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)  # the first build, without a JVM
    assert built.per("history_rows")["stream_state_cart_history"] > 30
    _check(dsn, warehouse)

    run_workload(store, streams=30, events=120, writers=3, rollback_rate=0.15, max_commit_delay=0.01, seed=46)
    _past_accounts(dsn, 1)
    extract_all(dsn.extractor, None, warehouse)
    small = update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)  # a small increment: delta-rs's MERGE
    assert small.engine == "local" and small.per("history_rows")
    _check(dsn, warehouse)

    run_workload(store, streams=30, events=120, writers=3, rollback_rate=0.15, max_commit_delay=0.01, seed=47)
    _past_accounts(dsn, 2)
    extract_all(dsn.extractor, None, warehouse)
    on_spark = update_stream_state(Engine(spark=spark, small_increments=False), warehouse, domain=SHOP)  # Spark's MERGE
    assert on_spark.engine == "spark" and not on_spark.listed("rebuilt_types")
    _check(dsn, warehouse)

    # docs/analysts.md's month-end balances, as written there (a LATERAL call per month end).
    ends = [dt.datetime(2026, 10, 31, 23, 59, 59, 999999, UTC), dt.datetime(2026, 11, 30, 23, 59, 59, 999999, UTC)]
    month_ends = query.run(warehouse, "SELECT m.month_end, count(*) AS accounts, round(sum(a.balance), 2) AS total "
                                      "FROM (VALUES (TIMESTAMP '2026-10-31 23:59:59.999999'), "
                                      "(TIMESTAMP '2026-11-30 23:59:59.999999')) AS m(month_end), "
                                      "LATERAL (FROM state_as_of('account', m.month_end)) a GROUP BY 1 ORDER BY 1").rows
    for row, end in zip(month_ends.to_pylist(), ends, strict=True):
        held = expected_as_of(dsn, SHOP, "account", end)
        assert (row["accounts"], row["total"]) == (len(held), round(sum(s["balance"] for _, s in held.values()), 2))

    # Spark SQL answers `state_as_of` alike (the call written out as a subquery).
    names = register_tables(spark, str(warehouse))

    def columns_of(name: str) -> list[str]:
        if name not in names:
            raise KeyError(name)
        return [f.name for f in spark.table(name).schema.fields]

    moment = dt.datetime.combine(DAY0.date() + dt.timedelta(days=4), dt.time.max, UTC)
    sql = as_of_spark(f"SELECT stream_id, version, balance FROM state_as_of('account', "
                            f"TIMESTAMP '{moment.replace(tzinfo=None).isoformat(sep=' ')}')", columns_of)
    got = {r["stream_id"]: (r["version"], r["balance"]) for r in spark.sql(sql).collect()}
    assert got == {s: (v, state["balance"]) for s, (v, state) in expected_as_of(dsn, SHOP, "account", moment).items()}
    assert got, "accounts had a state then"


def test_history_turned_on_later_or_left_behind_by_a_crash_is_built_whole(
    dsn: StoreDsn, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import copy
    from dataclasses import replace

    without = copy.copy(SHOP)
    without.reducers = {t: replace(r, history=None) for t, r in SHOP.reducers.items()}
    without._folds = None
    store = EventStore(dsn.writer)
    run_workload(store, streams=20, events=120, writers=2, rollback_rate=0.1, max_commit_delay=0, seed=51)
    _past_accounts(dsn, 0)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=without)
    assert not (warehouse / "stream_state_cart_history").exists()

    run_workload(store, streams=20, events=60, writers=2, rollback_rate=0.1, max_commit_delay=0, seed=52)
    extract_all(dsn.extractor, None, warehouse)
    on = update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)  # turned on: those types rebuilt, their history whole
    assert set(on.listed("rebuilt_types")) == {"account", "cart"}
    _check(dsn, warehouse)

    # A crash between stream_state's commit and the history's: the table is behind, and is built whole next time.
    run_workload(store, streams=20, events=60, writers=2, rollback_rate=0.1, max_commit_delay=0, seed=53)
    _past_accounts(dsn, 1)
    extract_all(dsn.extractor, None, warehouse)
    with monkeypatch.context() as m:
        def crash(*_: Any, **__: Any) -> Any:
            raise RuntimeError("the process died here")
        m.setattr(history, "write_arrow", crash)
        with pytest.raises(RuntimeError, match="died"):
            update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)
    again = update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    assert set(again.listed("rebuilt_types")) == {"account", "cart"}
    _check(dsn, warehouse)
    current = DeltaTable(str(warehouse / "stream_state_cart_history")).to_pyarrow_table(
        filters=[("is_current", "=", True)])
    assert pc.all(pc.is_null(current["valid_to"])).as_py()
    for _, table in history.history_tables(SHOP).values():  # as Spark wrote them: the columns declared, in order
        assert history._same_columns(DeltaTable(str(warehouse / table.name)), table), table.name


@pytest.mark.slow  # a store, two updates and a check of every row: `make test`, not `make check`'s budget
def test_a_declared_field_added_retypes_the_history_in_place_and_the_next_increment_closes_rows_as_before(
    dsn: StoreDsn, warehouse: Path
) -> None:
    """The account state declares one more field: its history table gets the column from its own `state` (no refold,
    no JVM), every row's `is_current` kept, and the next increment closes and adds rows as before."""
    import copy
    from dataclasses import replace

    import pyarrow as pa

    more = copy.copy(SHOP)
    account = SHOP.reducers["account"]
    assert account.state is not None
    more.reducers = {**SHOP.reducers, "account": replace(account, state=pa.schema([*account.state,
                                                                                  pa.field("note", pa.string())]))}
    more._folds = None
    store = EventStore(dsn.writer)
    run_workload(store, streams=20, events=120, writers=2, rollback_rate=0.1, max_commit_delay=0, seed=61)
    _past_accounts(dsn, 0)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)
    _past_accounts(dsn, 1)  # the same accounts go on: their current rows are closed or (same day) replaced
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=more)
    table = DeltaTable(str(warehouse / "stream_state_account_history")).to_pyarrow_table()
    assert "note" in table.column_names and table["note"].null_count == table.num_rows
    _check(dsn, warehouse, more)
