"""The typed event tables through Dagster: a store of a few hundred event types whose payloads change shape
(fields added, widened, surprising values) while writers append, materialized round after round into typed
tables that hold every event exactly once."""

from __future__ import annotations

import random
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from deltalake import DeltaTable

from es_pipeline.defs.events.asset import build_events_asset
from es_pipeline.defs.events.partitions import slice_ranges_partitions
from es_pipeline.defs.projections.assets import build_event_tables_asset
from es_pipeline.domain import NO_DOMAIN
from es_pipeline.lake.typed import event_tables
from es_pipeline.location import build_definitions
from es_pipeline.settings import Settings
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.lake.test_event_tables import assert_typed_tables_equal_the_store
from es_pipeline_tests.support.roles import StoreDsn

TYPES = 240


def _payload(rng: random.Random, shape: int, i: int) -> dict[str, Any]:
    """Round 0: {n, label}. Round 1 adds `extra` and widens `n` to a double. Round 2 brings surprises: an
    object where numbers were, a key that is no name, a number where strings were, a nested object."""
    if shape == 0:
        return {"n": i, "label": f"t{i}"}
    if shape == 1:
        return {"n": i + 0.5, "label": f"t{i}", "extra": rng.random() < 0.5}
    return rng.choice([{"n": {"unexpected": i}}, {"odd key": i, "n": 1}, {"label": i, "detail": {"at": i, "tags": ["a"]}}])


def _writer(dsn: str, seed: int, shape: int, count: int) -> None:
    rng, store = random.Random(seed), EventStore(dsn)
    for k in range(count):
        t = rng.randrange(TYPES)
        store.append(f"w{seed}-{shape}-{k}", "probe", [NewEvent(f"Probe{t}Happened", _payload(rng, shape, t))], 0)


@pytest.mark.slow
def test_a_store_of_hundreds_of_changing_types_lands_in_typed_tables_exactly_once_through_dagster(
    dsn: StoreDsn, settings: Settings, warehouse: Path
) -> None:
    settings = replace(settings, slice_ranges=2, tail_seconds=0)
    resources = dict(build_definitions(settings, NO_DOMAIN).resources)
    events = build_events_asset(slice_ranges_partitions(2), settings, NO_DOMAIN)
    typed = build_event_tables_asset(NO_DOMAIN)
    store = EventStore(dsn.writer)
    for t in range(TYPES):  # every type once, in its first shape
        store.append(f"seed-{t}", "probe", [NewEvent(f"Probe{t}Happened", _payload(random.Random(t), 0, t))], 0)
    metadata = []
    with dg.instance_for_test() as instance:
        for shape in (0, 1, 2):
            writers = [threading.Thread(target=_writer, args=(dsn.writer, 10 * shape + w, shape, 150)) for w in range(3)]
            for w in writers:
                w.start()
            for _ in range(2):  # while the writers append, and once more after
                for key in ("0000-0511", "0512-1023"):
                    assert dg.materialize([events], partition_key=key, resources=resources, instance=instance).success
                done = dg.materialize([typed], resources=resources, instance=instance)
                assert done.success
                metadata.append(done.asset_materializations_for_node("event_tables")[0].metadata)
                for w in writers:
                    w.join()
    assert metadata[0]["full_rebuild"].value is True and metadata[-1]["full_rebuild"].value is False
    assert sum(m["events_folded"].value for m in metadata) == TYPES + 3 * 3 * 150
    assert any("n: bigint → double" in m["widened_columns"].value for m in metadata)
    assert sum(m["overflow_values"].value for m in metadata) > 0
    assert assert_typed_tables_equal_the_store(dsn, warehouse) == TYPES + 3 * 3 * 150
    mapping = DeltaTable(str(warehouse / event_tables.NAME)).to_pyarrow_table().to_pylist()
    assert len({r["table_name"] for r in mapping}) == TYPES
