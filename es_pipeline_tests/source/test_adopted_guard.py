"""An adopted table's guard: rows that become events after their own transaction (a draft published by an UPDATE,
an archive put back with `INSERT … SELECT *` carrying its old ids) are extracted, once, like the native store's."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from es_pipeline.errors import SourceNotServable
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.source import mapping
from es_pipeline.store.adopt import adopt
from es_pipeline_tests.support.lakecheck import assert_exactly_once_by_key
from es_pipeline_tests.support.roles import StoreDsn

TOML = """
[source]
table = "app.log"
stream_id = "stream"
version = "v"
event_type = "kind"
payload = "body"
recorded_at = "at"
filter = "status = 'published'"
columns = ["stream", "v", "kind", "body", "at", "status"]
"""


def _insert(conn: psycopg.Connection, stream: str, versions: range, status: str) -> None:
    for v in versions:
        conn.execute("INSERT INTO app.log (stream, v, kind, body, status) VALUES (%s, %s, 'Noted', %s, %s)",
                     (stream, v, f'{{"v": {v}}}', status))


def test_rows_that_become_events_late_are_extracted_once(dsn: StoreDsn, warehouse: Path, tmp_path: Path) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app; CREATE TABLE app.log (id bigserial PRIMARY KEY, stream text NOT NULL, "
                     "v int NOT NULL, kind text NOT NULL, body jsonb NOT NULL, at timestamptz NOT NULL DEFAULT now(), "
                     "status text NOT NULL, UNIQUE (stream, v))")
    (tmp_path / "log.toml").write_text(TOML)
    source = mapping.load(str(tmp_path / "log.toml"))
    adopted = adopt(dsn, source, echo=lambda _: None)
    assert adopted.added == ["tx_id"] and len(adopted.guards) == 2
    assert not adopt(dsn, source, echo=lambda _: None).changed, "adopting twice changes nothing"

    extractor = Extractor(dsn.extractor, None, warehouse, source=source)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(5):
            _insert(conn, f"s-{i}", range(1, 4), "published")
        _insert(conn, "draft-1", range(1, 3), "draft")  # not events yet
        # An archive of the same shape, its rows carrying the ids of the transactions that once wrote them.
        conn.execute("CREATE TABLE app.archive AS SELECT * FROM app.log WHERE false")
        conn.execute("INSERT INTO app.archive (id, stream, v, kind, body, at, status, tx_id) "
                     "SELECT 1000 + g, 'old-' || g, 1, 'Noted', '{}', now(), 'published', '5'::xid8 "
                     "FROM generate_series(1, 4) g")
    extractor.run(SliceRange(0, 1023))

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE app.log SET status = 'published' WHERE stream = 'draft-1'")  # published later
        conn.execute("INSERT INTO app.log SELECT * FROM app.archive")  # put back, ids and all
        conn.execute("UPDATE app.log SET body = '{\"v\": 9}' WHERE stream = 's-0' AND v = 1")  # an event stays one
        own = conn.execute("SELECT count(*) FROM app.log WHERE stream LIKE 'old-%' AND tx_id = '5'::xid8").fetchone()
    assert own == (0,), "the guard gave the archived rows their own transaction's id"
    extractor.run(SliceRange(0, 1023), run_id="after")
    # The edited event is not read again (its id was kept): the lake has its first payload, once.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE app.log SET body = '{\"v\": 1}' WHERE stream = 's-0' AND v = 1")
    assert assert_exactly_once_by_key(warehouse, dsn, source) == 15 + 2 + 4


NAIVE = """
[source]
table = "naive.log"
stream_id = "stream"
version = "v"
event_type = "kind"
payload = "body"
recorded_at = "at"
"""


def test_a_zoneless_recorded_at_is_read_in_its_declared_zone_never_the_sessions(
    dsn: StoreDsn, warehouse: Path, tmp_path: Path,
) -> None:
    """A `timestamp without time zone` column read in the session's zone would shift every time by hours on a
    non-UTC server: adopt refuses to guess, and a declared zone is applied whatever the session's."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA naive; CREATE TABLE naive.log (stream text, v int, kind text, body jsonb, "
                     "at timestamp without time zone NOT NULL, PRIMARY KEY (stream, v))")
        conn.execute("INSERT INTO naive.log VALUES ('s-1', 1, 'Noted', '{}', '2026-01-02 03:04:05')")
        conn.execute(sql.SQL("ALTER DATABASE {} SET timezone = 'Asia/Tokyo'").format(
            sql.Identifier(str(conninfo_to_dict(dsn)["dbname"]))))
    (tmp_path / "guess.toml").write_text(NAIVE)
    with pytest.raises(SourceNotServable, match='recorded_at_zone = "UTC"'):
        adopt(dsn, mapping.load(str(tmp_path / "guess.toml")), echo=lambda _: None)
    (tmp_path / "utc.toml").write_text(NAIVE + 'recorded_at_zone = "UTC"\n')
    source = mapping.load(str(tmp_path / "utc.toml"))
    adopt(dsn, source, echo=lambda _: None)
    Extractor(dsn.extractor, None, warehouse, source=source).run(SliceRange(0, 1023))
    lake = DeltaTable(str(warehouse / "events")).to_pyarrow_table(columns=["recorded_at"])
    assert lake["recorded_at"].to_pylist() == [datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)]
    (tmp_path / "wrong.toml").write_text(TOML + 'recorded_at_zone = "UTC"\n')
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app; CREATE TABLE app.log (stream text, v int, kind text, body jsonb, "
                     "at timestamptz, status text)")
    with pytest.raises(SourceNotServable, match="has its zone already"):
        adopt(dsn, mapping.load(str(tmp_path / "wrong.toml")), echo=lambda _: None)
