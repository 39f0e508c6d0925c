"""Rebuilds beside the live table (lake/state/rebuild.py): a reducer revision under a tailing run leaves every other
stream type fresh, builds the new version beside, and swaps it into `stream_state` in one commit; a rebuild killed
half way resumes, a second revision during the first starts again. Every expected value is a fold of the store
(`es.events`), never what the lake says.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.cli import main
from es_pipeline.dev.workload import run_workload
from es_pipeline.domain import Domain, Event, Reducer
from es_pipeline.health.exporter import Latency, Reading, lake_metrics
from es_pipeline.lake.delta import current
from es_pipeline.lake.follow import follow
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.kernel.result import Result
from es_pipeline.lake.kernel.turn import one_at_a_time
from es_pipeline.lake.read.behind import Lake
from es_pipeline.lake.state import forked, rebuild
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.store.conninfo import lock_transaction
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.lake.test_history import expected_rows, lake_rows
from es_pipeline_tests.support.hooks import no_spark
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn


def bumped(domain: Domain, revision: int) -> Domain:
    """`domain` with the cart reducer at `revision`, folding one more thing: how many events it has seen, times the
    revision (so each revision's states differ from the others')."""
    old = domain.reducers["cart"]

    def fold(state: dict[str, Any], event: Event) -> dict[str, Any]:
        seen = state.get("seen", 0)
        return {**old.fold(state, event), "seen": seen + revision}

    out = copy.copy(domain)
    out.reducers = {**domain.reducers, "cart": replace(old, revision=revision, fold=fold)}
    out._folds = None
    return out


def store_states(dsn: StoreDsn, domain: Domain) -> dict[str, tuple[int, dict[str, Any], int]]:
    """Every stream's (version, state, revision) as a fold of the store by `domain` gives it."""
    out: dict[str, tuple[int, dict[str, Any], int]] = {}
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT stream_id, stream_type, version, event_type, payload FROM es.events "
                            "ORDER BY stream_id, version").fetchall()
    for stream_id, stream_type, version, event_type, payload in rows:
        reducer: Reducer = domain.reducers[stream_type]  # (the shop's payloads are of the upcasters' last version)
        _, state, _ = out.get(stream_id, (0, {}, 0))
        state = json.loads(json.dumps(reducer.fold(state, Event(stream_id, version, event_type, payload))))
        out[stream_id] = (version, state, domain.folds[stream_type].revision)
    return out


def lake_states(warehouse: Path, version: int | None = None) -> dict[str, tuple[int, dict[str, Any], int]]:
    rows = DeltaTable(str(warehouse / "stream_state"), version=version).to_pyarrow_table().to_pylist()
    return {r["stream_id"]: (r["version"], json.loads(r["state"]), r["revision"]) for r in rows}


def of_type(states: dict[str, Any], prefix: str, keep: bool = True) -> dict[str, Any]:
    return {k: v for k, v in states.items() if k.startswith(prefix) == keep}


def carts_never_mixed(warehouse: Path, since: int) -> None:
    """At every version of `stream_state` since `since`, every cart row is of one revision: analysts never see a
    half-built type."""
    path = str(warehouse / "stream_state")
    for version in range(since, DeltaTable(path).version() + 1):
        rows = DeltaTable(path, version=version).to_pyarrow_table(columns=["stream_type", "revision"]).to_pylist()
        assert len({r["revision"] for r in rows if r["stream_type"] == "cart"}) <= 1, version


@pytest.mark.slow  # three workloads, a rebuild in four pieces: `make test`, not `make check`'s budget
def test_a_revision_is_built_beside_resumes_after_a_crash_starts_again_on_a_second_one_and_swaps_in_one_commit(
    dsn: StoreDsn, warehouse: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(rebuild.pieces, "count_for", lambda size: 4)  # a small lake, cut as a large one is
    monkeypatch.setattr(forked, "ONE_PROCESS_ROWS", 0)  # each piece folded by forked, niced processes
    store = EventStore(dsn.writer)
    run_workload(store, streams=40, events=400, writers=3, rollback_rate=0.1, max_commit_delay=0.01, seed=61)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP, store_dsn=dsn.extractor)
    first = DeltaTable(str(warehouse / "stream_state")).version()
    two = bumped(SHOP, 2)

    # The tailing run's increment under the new revision: every other type folded, the carts left as they were.
    run_workload(store, streams=40, events=200, writers=3, rollback_rate=0.1, max_commit_delay=0.01, seed=62)
    extract_all(dsn.extractor, None, warehouse)
    before = lake_states(warehouse)
    done = follow(warehouse, dsn.extractor, two)
    state = done["stream_state"]
    assert isinstance(state, Result) and state.listed("rebuilding_types") == ("cart",) and state.events_folded > 0
    now = lake_states(warehouse)
    assert of_type(now, "cart-") == of_type(before, "cart-")  # the old version, in service
    assert of_type(now, "cart-", keep=False) == of_type(store_states(dsn, two), "cart-", keep=False)

    # Built beside, killed after one piece of four: the live table untouched, health says how far it is.
    shadow = rebuild.Shadow(warehouse, "cart")
    with one_at_a_time(dsn.extractor, rebuild.TURN):
        assert not rebuild.build(Engine(spark=no_spark), shadow, two, stop_after=1)
    (found,) = rebuild.progress(warehouse)
    assert (found.stream_type, found.phase, found.pieces_done, found.pieces) == ("cart", "pieces", 1, 4)
    assert 0 < found.events_folded < found.events_total and found.expected_end is not None
    metrics = {m.name: m for m in lake_metrics(Reading(rebuilds=[found]), "shop", Latency())}
    assert [(s.labels["stream_type"], s.value) for s in metrics["es_pipeline_rebuild_events_folded"].samples] == \
        [("cart", found.events_folded)]
    assert lake_states(warehouse) == now

    # A second revision during the first: the shadow built as revision 2 is dropped, and revision 3 starts anew.
    three = bumped(SHOP, 3)
    with one_at_a_time(dsn.extractor, rebuild.TURN):
        assert not rebuild.build(Engine(spark=no_spark), shadow, three, stop_after=2)
    (found,) = rebuild.progress(warehouse)
    assert found.pieces_done == 2 and json.loads(DeltaTable(shadow.state_path).metadata().description)["key"] \
        == rebuild.key_of(three, "cart", DeltaTable(str(warehouse / "events")).metadata().id)

    # `es-pipeline lake rebuilds` says so (its domain the shop's: the carts still held back, by their mark).
    monkeypatch.setenv("ES_PIPELINE_PG_DSN", dsn.extractor)
    monkeypatch.setenv("ES_PIPELINE_WAREHOUSE", str(warehouse))
    monkeypatch.setenv("ES_PIPELINE_DOMAIN", "shop.domain")
    assert main(["lake", "rebuilds"]) == 0
    out = capsys.readouterr().out
    assert "stream types to rebuild: cart" in out and "cart: pieces, " in out and "piece 2 of 4" in out, out

    # More events meanwhile, folded by the tailing run but for the carts; then the rebuild resumed and swapped.
    run_workload(store, streams=40, events=200, writers=3, rollback_rate=0.1, max_commit_delay=0.01, seed=63)
    extract_all(dsn.extractor, None, warehouse)
    assert follow(warehouse, dsn.extractor, three)["stream_state"].listed("rebuilding_types") == ("cart",)
    result = update_stream_state(Engine(spark=no_spark), warehouse, domain=three, store_dsn=dsn.extractor)
    assert result.listed("rebuilt_types") == ("cart",) and not result.listed("rebuilding_types")
    assert lake_states(warehouse) == store_states(dsn, three)
    assert lake_rows(warehouse, "cart") == expected_rows(dsn, three, "cart")
    assert lake_rows(warehouse, "account") == expected_rows(dsn, three, "account")
    assert rebuild.progress(warehouse) == [] and not (warehouse / rebuild.FOLDER).exists() or \
        not any((warehouse / rebuild.FOLDER).iterdir())
    carts_never_mixed(warehouse, first)

    # After the swap the carts are the live table's again: the next increment folds them as any other type.
    run_workload(store, streams=40, events=100, writers=2, rollback_rate=0.1, max_commit_delay=0.01, seed=64)
    extract_all(dsn.extractor, None, warehouse)
    later = follow(warehouse, dsn.extractor, three)["stream_state"]
    assert isinstance(later, Result) and not later.listed("rebuilding_types")
    assert lake_states(warehouse) == store_states(dsn, three)
    assert lake_rows(warehouse, "cart") == expected_rows(dsn, three, "cart")


def test_a_revision_under_concurrent_writers_and_a_tailing_run_keeps_the_other_types_fresh(
    dsn: StoreDsn, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writers append (rollbacks, out-of-order commits), extraction and a tailing run follow them, while the carts'
    new revision is rebuilt on Spark beside the live table; the other types' increments go on all along, and in the
    end the lake equals a fold of the store, every cart row of the new revision since the one commit that swapped
    them in."""
    monkeypatch.setattr(rebuild.pieces, "count_for", lambda size: 3)
    store = EventStore(dsn.writer)
    run_workload(store, streams=40, events=300, writers=3, rollback_rate=0.1, max_commit_delay=0.01, seed=71)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP, store_dsn=dsn.extractor)
    first = DeltaTable(str(warehouse / "stream_state")).version()
    two = bumped(SHOP, 2)

    stop = threading.Event()
    seen: list[Result] = []
    errors: list[BaseException] = []

    def writers() -> None:
        try:
            run_workload(EventStore(dsn.writer), streams=60, events=600, writers=4, rollback_rate=0.15,
                         max_commit_delay=0.05, seed=72, rate=120.0)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    def tailing() -> None:
        try:
            with lock_transaction(dsn.extractor, application_name="test tailing") as conn:
                while not stop.is_set():
                    extract_all(dsn.extractor, None, warehouse)
                    done = follow(warehouse, conn, two).get("stream_state")
                    if isinstance(done, Result):
                        seen.append(done)
                    conn.rollback()
                    time.sleep(0.2)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=writers), threading.Thread(target=tailing)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        swapped = rebuild.run_pending(Engine("spark", spark), warehouse, two, dsn.extractor)
    finally:
        threads[0].join()
        stop.set()
        threads[1].join()
    assert not errors, errors
    assert swapped == ["cart"]
    held = [r for r in seen if r.listed("rebuilding_types") == ("cart",)]
    assert any(r.events_folded for r in held), "the other types were folded while the carts were rebuilt"
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=two, store_dsn=dsn.extractor)
    assert lake_states(warehouse) == store_states(dsn, two)
    assert lake_rows(warehouse, "cart") == expected_rows(dsn, two, "cart")
    carts_never_mixed(warehouse, first)


@pytest.mark.slow  # three workloads and a rebuild: `make test`, not `make check`'s budget
def test_a_revision_rolled_back_before_its_rebuild_still_folds_the_events_it_held_back(
    dsn: StoreDsn, warehouse: Path
) -> None:
    """The carts held back under revision 2 while the live table moved past their events; then revision 2 is rolled
    back before any rebuild: the rows are of the domain's revision again, yet the carts stay pending (their held
    mark), are rebuilt, and every event is in the lake once."""
    store = EventStore(dsn.writer)
    run_workload(store, streams=30, events=200, writers=2, rollback_rate=0.1, max_commit_delay=0.01, seed=81)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP, store_dsn=dsn.extractor)
    run_workload(store, streams=30, events=100, writers=2, rollback_rate=0.1, max_commit_delay=0.01, seed=82)
    extract_all(dsn.extractor, None, warehouse)
    held = follow(warehouse, dsn.extractor, bumped(SHOP, 2))["stream_state"]
    assert isinstance(held, Result) and held.listed("rebuilding_types") == ("cart",)
    run_workload(store, streams=30, events=100, writers=2, rollback_rate=0.1, max_commit_delay=0.01, seed=83)
    extract_all(dsn.extractor, None, warehouse)
    again = follow(warehouse, dsn.extractor, SHOP)["stream_state"]  # rolled back: still held, until rebuilt
    assert isinstance(again, Result) and again.listed("rebuilding_types") == ("cart",)
    done = update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP, store_dsn=dsn.extractor)
    assert done.listed("rebuilt_types") == ("cart",)
    assert lake_states(warehouse) == store_states(dsn, SHOP)
    later = follow(warehouse, dsn.extractor, SHOP)["stream_state"]
    assert isinstance(later, Result) and not later.listed("rebuilding_types")


def test_a_table_with_deletion_vectors_holds_and_swaps_by_spark(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    """`stream_state` with deletion vectors (delta-rs does not write it): the held marks and the swap go by Spark."""
    store = EventStore(dsn.writer)
    run_workload(store, streams=30, events=200, writers=2, rollback_rate=0.1, max_commit_delay=0.01, seed=101)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=spark, small_increments=False), warehouse, domain=SHOP)
    path = str(warehouse / "stream_state")
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = true)")
    run_workload(store, streams=30, events=100, writers=2, rollback_rate=0.1, max_commit_delay=0.01, seed=102)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=spark, small_increments=False), warehouse, domain=SHOP)
    assert current.has_deletion_vectors(DeltaTable(path))

    two = bumped(SHOP, 2)
    run_workload(store, streams=30, events=100, writers=2, rollback_rate=0.1, max_commit_delay=0.01, seed=103)
    extract_all(dsn.extractor, None, warehouse)
    held = update_stream_state(Engine(spark=spark), warehouse, domain=two, rebuilds="hold")
    assert held.engine == "spark" and held.listed("rebuilding_types") == ("cart",)
    events_id = DeltaTable(str(warehouse / "events")).metadata().id
    assert rebuild.held_back(DeltaTable(path), events_id, ["cart", "account"]) == ["cart"]
    done = update_stream_state(Engine(spark=spark), warehouse, domain=two)
    assert done.listed("rebuilt_types") == ("cart",)
    assert rebuild.held_back(DeltaTable(path), events_id, ["cart", "account"]) == []
    rows = spark.read.format("delta").load(path).collect()  # (deletion vectors: read by Spark)
    assert {r["stream_id"]: (r["version"], json.loads(r["state"]), r["revision"]) for r in rows} == \
        store_states(dsn, two)
    for version in range(DeltaTable(path).version() + 1):  # every cart row of one revision at every version
        kinds = spark.read.format("delta").option("versionAsOf", version).load(path) \
            .where("stream_type = 'cart'").select("revision").distinct().count()
        assert kinds <= 1, version


def test_a_rebuild_resumed_after_events_was_vacuumed_starts_again_at_the_live_version_and_says_so(
    dsn: StoreDsn, warehouse: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Vacuum removes files, not log entries: the version a shadow started from still loads, its pieces no longer
    read. The rebuild starts again from the live table's version instead of failing on every retry."""
    monkeypatch.setattr(rebuild.pieces, "count_for", lambda size: 4)
    store = EventStore(dsn.writer)
    run_workload(store, streams=30, events=300, writers=2, rollback_rate=0, max_commit_delay=0, seed=71)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP, store_dsn=dsn.extractor)
    two = bumped(SHOP, 2)
    shadow = rebuild.Shadow(warehouse, "cart")
    with one_at_a_time(dsn.extractor, rebuild.TURN):
        assert not rebuild.build(Engine(spark=no_spark), shadow, two, stop_after=1)
    for seed in (72, 73):
        run_workload(store, streams=30, events=100, writers=2, rollback_rate=0, max_commit_delay=0, seed=seed)
        extract_all(dsn.extractor, None, warehouse)
        follow(warehouse, dsn.extractor, two)  # the other types kept fresh; the carts held back
    events = DeltaTable(str(warehouse / "events"))
    events.optimize.compact()
    events.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)  # the shadow's version unreadable
    run_workload(store, streams=30, events=100, writers=2, rollback_rate=0, max_commit_delay=0, seed=74)
    extract_all(dsn.extractor, None, warehouse)
    follow(warehouse, dsn.extractor, two)  # stream_state folds on, past the vacuum
    said: list[str] = []
    with one_at_a_time(dsn.extractor, rebuild.TURN):
        assert rebuild.build(Engine(spark=no_spark), shadow, two, say=said.append)
    assert any("vacuumed" in line and "started again" in line for line in said), said
    result = update_stream_state(Engine(spark=no_spark), warehouse, domain=two, store_dsn=dsn.extractor)
    assert result.listed("rebuilt_types") == ("cart",) and not result.listed("rebuilding_types")
    assert lake_states(warehouse) == store_states(dsn, two)


def test_a_history_table_held_back_with_its_type_shows_its_distance(dsn: StoreDsn, warehouse: Path) -> None:
    """The health exporter, `status` and `status --watch` read how far each table is behind `events` (lake/read/
    behind.py): a history table too, behind while its type waits for its rebuild."""
    store = EventStore(dsn.writer)
    run_workload(store, streams=20, events=150, writers=2, rollback_rate=0, max_commit_delay=0, seed=81)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP, store_dsn=dsn.extractor)
    lake = Lake(warehouse)
    folded = lake.folded()
    assert folded["stream_state_cart_history"] == folded["stream_state_account_history"] == lake.events_version()
    for seed in (82, 83):  # the carts held for their revision's rebuild; the accounts folded on
        run_workload(store, streams=20, events=50, writers=1, rollback_rate=0, max_commit_delay=0, seed=seed)
        extract_all(dsn.extractor, None, warehouse, 1)
        assert follow(warehouse, dsn.extractor, bumped(SHOP, 2))["stream_state"].listed("rebuilding_types") == ("cart",)
    behind = {b.name: b.versions for b in Lake(warehouse).behind()}
    assert behind["stream_state"] == behind["stream_state_account_history"] == 0
    assert behind["stream_state_cart_history"] == 2, behind
