"""One source per warehouse from the first byte: `events` is bound to its store and consumer before any row (the
table property es_pipeline.source, `<store id>/<consumer>`), so a second store pointed at the same
warehouse is refused before it writes, even while the lake holds nothing but that commit, and two stores racing
for a new warehouse end with one lake of one store."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable

from es_pipeline.dev.workload import run_workload
from es_pipeline.errors import LakeHoldsAnotherSource
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake.delta import tables
from es_pipeline.lake.events import EVENTS
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.lakecheck import assert_exactly_once_by_key
from es_pipeline_tests.support.roles import StoreDsn

ALL = SliceRange(0, 1023)


def _another_store(new_store: Callable[[], StoreDsn], events: int, seed: int) -> StoreDsn:
    """A store of its own (a database cloned from the template has the template's id: given a new one here, as
    a store made by `db migrate` would have), holding `events` events."""
    store = new_store()
    with psycopg.connect(store, autocommit=True) as conn:
        conn.execute("UPDATE es_pipeline.store_identity SET store_id = gen_random_uuid()")
    if events:
        run_workload(EventStore(store.writer), streams=20, events=events, writers=1, rollback_rate=0,
                     max_commit_delay=0, seed=seed)
    return store


def _bound_to(warehouse: Path) -> str | None:
    return DeltaTable(str(warehouse / "events")).metadata().configuration.get(tables.SOURCE_PROPERTY)


def test_two_stores_racing_for_a_new_warehouse_one_binds_the_other_is_refused(
    new_store: Callable[[], StoreDsn], tmp_path: Path
) -> None:
    for round_ in range(4):  # fresh stores each round: a store that extracted into one lake refuses another
        stores = [_another_store(new_store, 60, 1), _another_store(new_store, 40, 2)]
        warehouse = tmp_path / f"lake-{round_}"
        start = threading.Barrier(2)
        outcome: dict[int, BaseException | int] = {}

        def run(i: int, warehouse: Path = warehouse, start: threading.Barrier = start,
                outcome: dict[int, BaseException | int] = outcome, stores: list[StoreDsn] = stores) -> None:
            start.wait()
            try:
                outcome[i] = Extractor(stores[i].extractor, None, warehouse).run(ALL).rows
            except Exception as exc:  # noqa: BLE001 - asserted below
                outcome[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        won = [i for i, o in outcome.items() if isinstance(o, int)]
        lost = [o for o in outcome.values() if not isinstance(o, int)]
        assert len(won) == 1 and len(lost) == 1, outcome
        assert isinstance(lost[0], LakeHoldsAnotherSource), lost[0]
        assert assert_exactly_once_by_key(warehouse, stores[won[0]]) == (60, 40)[won[0]]
        with psycopg.connect(stores[won[0]]) as conn:
            store_id = conn.execute("SELECT store_id::text FROM es_pipeline.store_identity").fetchone()
        assert store_id is not None and _bound_to(warehouse) == f"{store_id[0]}/events"
        with pytest.raises(LakeHoldsAnotherSource, match="is the lake of another source"):  # and again, later
            Extractor(stores[1 - won[0]].extractor, None, warehouse).run(ALL)


def test_a_lake_holding_only_its_creation_commit_is_bound_already(
    new_store: Callable[[], StoreDsn], warehouse: Path
) -> None:
    """The window the issue found: a store with nothing to extract yet makes `events` (its creation commit only);
    a second store pointed at the warehouse is refused, writes nothing, and the first one goes on."""
    first, second = _another_store(new_store, 0, 0), _another_store(new_store, 50, 3)
    assert Extractor(first.extractor, None, warehouse).run(ALL).rows == 0
    assert tables.never_written(str(warehouse / "events"))
    version = DeltaTable(str(warehouse / "events")).version()
    with pytest.raises(LakeHoldsAnotherSource, match="another source"):
        Extractor(second.extractor, None, warehouse).run(ALL)
    assert DeltaTable(str(warehouse / "events")).version() == version, "nothing written"
    with psycopg.connect(second) as conn:
        assert conn.execute("SELECT count(*) FROM es_pipeline.sinks").fetchone() == (0,), "nothing recorded"
    run_workload(EventStore(first.writer), streams=10, events=30, writers=1, rollback_rate=0, max_commit_delay=0)
    assert Extractor(first.extractor, None, warehouse).run(ALL).rows == 30


def test_a_lake_made_by_an_older_release_is_bound_at_its_next_run(
    new_store: Callable[[], StoreDsn], warehouse: Path
) -> None:
    store = _another_store(new_store, 30, 4)
    EVENTS.ensure_arrow(warehouse)  # as a release before the binding made it: no es_pipeline.source
    assert _bound_to(warehouse) is None
    assert Extractor(store.extractor, None, warehouse).run(ALL).rows == 30
    assert _bound_to(warehouse) is not None and str(_bound_to(warehouse)).endswith("/events")
    with pytest.raises(LakeHoldsAnotherSource):
        Extractor(_another_store(new_store, 5, 5).extractor, None, warehouse).run(ALL)
