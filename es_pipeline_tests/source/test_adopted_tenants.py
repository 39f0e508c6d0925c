"""An adopted store partitioned by tenant (the design notes' hand-rolled table, in TOML): its snapshots are
written back to es_pipeline.snapshots, and a tenant is erased from it like from the native store."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
from shop.domain import domain as SHOP

from es_pipeline.extraction.erase import erase_tenant
from es_pipeline.lake.delta import erase as lake_erase
from es_pipeline.lake.delta import tables
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state.snapshots import not_in_store_small, take_snapshots
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.settings import Settings
from es_pipeline.source import mapping
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.source.test_presets import SEED_DDL, SEED_TOML, lands_once, source_rows
from es_pipeline_tests.support.roles import StoreDsn


def _cart(conn: psycopg.Connection, writer: str, stream: str, v: int, rng: random.Random) -> None:
    """Like test_presets' seed writer, with a payload the `cart` reducer folds."""
    tenant = ("acme", "globex", "initech")[int(stream.rsplit("-", 1)[-1]) % 3]
    conn.execute('INSERT INTO app."Event" ("TenantId", "StreamId", "Version", "Type", "Data") VALUES (%s, %s, %s, %s, %s)',
                 (tenant, stream, v, "ItemAdded", json.dumps({"sku": f"sku-{rng.randrange(4)}", "qty": 1})))


def test_an_adopted_stores_snapshots_go_back_to_es_pipeline_and_a_tenant_is_erased(
    dsn: StoreDsn, spark: Any, warehouse: Path, tmp_path: Path
) -> None:
    (tmp_path / "event.toml").write_text(SEED_TOML)
    source = mapping.load(str(tmp_path / "event.toml"))
    lands_once(dsn, SEED_DDL, source, _cart, warehouse)
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP, store_dsn=dsn.extractor)
    snapshots = EventStore(dsn.snapshots, snapshots_of=source.consumer)  # as the write-back's own login
    taken = take_snapshots(Engine(spark=spark), warehouse, snapshots, threshold=1)
    with psycopg.connect(dsn) as conn:
        held = conn.execute("SELECT consumer, tenant, count(*) FROM es_pipeline.snapshots GROUP BY 1, 2 ORDER BY 2").fetchall()
    streams_per_tenant = {t: len({s for (t2, s, _) in _keys(dsn, source) if t2 == t}) for t in ("acme", "globex", "initech")}
    assert taken.figures["written_back"] == sum(streams_per_tenant.values())
    assert held == [(source.consumer, t, n) for t, n in sorted(streams_per_tenant.items())]
    assert not_in_store_small(warehouse, snapshots).num_rows == 0  # what snapshots_match_store checks
    one = snapshots.read_snapshot("cart-0-0", tenant="acme")
    assert one is not None and one.tenant == "acme" and one.version > 0

    settings = replace(Settings.from_env(), pg_dsn=str(dsn), warehouse=warehouse, source_mapping=source,
                       source_spec=str(tmp_path / "event.toml"))
    done = erase_tenant(settings, "globex", progress=lambda _: None)
    assert done.partition == 'app.Event_globex' and done.store_events > 0
    assert done.store_rows == {"es_pipeline.snapshots": streams_per_tenant["globex"]}
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regclass('app.\"Event_globex\"')").fetchone() == (None,)
        assert conn.execute("SELECT count(*) FROM es_pipeline.snapshots WHERE tenant = 'globex'").fetchone() == (0,)
    lake = lake_erase.tenant_counts(tables.table_path(warehouse, "events"))
    assert set(lake) == {"acme", "initech"}
    assert sum(lake.values()) == sum(source_rows(dsn, source).values())
    for name in tables.TABLES:
        assert lake_erase.leftovers(tables.table_path(warehouse, name), "globex") == [], name


def _keys(dsn: str, source: mapping.Source) -> list[tuple[str, str, int]]:
    with psycopg.connect(dsn) as conn:
        return [(str(t), str(s), int(v)) for t, s, v in conn.execute(
            f"SELECT tenant, stream_id, version FROM {source.relation()} e").fetchall()]  # type: ignore[arg-type]
