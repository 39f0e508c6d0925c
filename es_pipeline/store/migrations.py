"""Versioned, idempotent migrations of the event store and of es_pipeline's own tables.

Each migration runs once, in the same transaction that records it in `<schema>.schema_migrations`,
under an advisory lock so that two `migrate` calls at once do not race. Before creating a table
that already exists but was not made by us, its columns are checked; an incompatible table makes
the whole migration refuse and roll back, changing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from es_pipeline.errors import IncompatibleSchema
from es_pipeline.store.conninfo import connect

OFFSETS_SCHEMA = "es_pipeline"
MIGRATION_LOCK_KEY = 0x65735F6D69677274  # "es_migrt"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: str


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "event store: streams, events, snapshots, slice function, notify trigger",
        """
CREATE FUNCTION {schema}.slice_of(stream_id text) RETURNS smallint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    -- Bitwise AND of the 64-bit hash keeps 0..1023 for every value (abs() overflows on one).
    AS $$ SELECT (hashtextextended(stream_id, 0) & 1023)::smallint $$;

CREATE TABLE {schema}.streams ({streams_tenant}
    stream_id   text        NOT NULL CHECK (length(stream_id) BETWEEN 1 AND 200),
    stream_type text        NOT NULL,
    version     integer     NOT NULL CHECK (version >= 0),
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY ({stream_key})
);
CREATE INDEX streams_type_idx ON {schema}.streams (stream_type);

CREATE TABLE {schema}.events (
    global_position bigint      GENERATED ALWAYS AS IDENTITY,
    tx_id           xid8        NOT NULL DEFAULT pg_current_xact_id(),
    stream_id       text        NOT NULL,
    stream_type     text        NOT NULL,
    version         integer     NOT NULL CHECK (version >= 1),
    slice           smallint    NOT NULL GENERATED ALWAYS AS ({schema}.slice_of(stream_id)) STORED,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    metadata        jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    recorded_at     timestamptz NOT NULL DEFAULT now(),{events_tenant}
    PRIMARY KEY ({event_key})
){partitioning};
-- The extraction and the sensor probe (slice = s AND tx_id >= W(s) AND tx_id < H).
CREATE INDEX events_slice_tx_idx ON {schema}.events (slice, tx_id);

CREATE TABLE {schema}.snapshots (
    stream_id   text        PRIMARY KEY,
    stream_type text        NOT NULL,
    version     integer     NOT NULL,
    state       jsonb       NOT NULL,
    revision    integer     NOT NULL,
    taken_at    timestamptz NOT NULL DEFAULT now()
);

-- One NOTIFY per appending transaction: PostgreSQL folds identical (channel, payload) pairs
-- within a transaction, and the payload is the transaction id.
CREATE FUNCTION {schema}.notify_events() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('es_events', pg_current_xact_id()::text);
    RETURN NULL;
END $$;
CREATE TRIGGER events_notify AFTER INSERT ON {schema}.events
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.notify_events();
""",
    ),
    Migration(
        2,
        "offsets: per consumer and slice, the xid8 watermark",
        """
CREATE SCHEMA IF NOT EXISTS es_pipeline;
CREATE TABLE IF NOT EXISTS es_pipeline.offsets (
    consumer   text        NOT NULL,
    slice      smallint    NOT NULL CHECK (slice >= 0 AND slice < 1024),
    watermark  xid8        NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    run_id     text,
    PRIMARY KEY (consumer, slice)
);
-- A batch being written: recorded before the sink write, deleted with the offset commit.
-- A row left behind by a crash is replayed, byte for byte, by the next run on its slices.
CREATE TABLE IF NOT EXISTS es_pipeline.pending_batches (
    batch_id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer        text        NOT NULL,
    app_id          text        NOT NULL,
    slices          smallint[]  NOT NULL,
    from_watermarks xid8[]      NOT NULL,
    upper_bound     xid8        NOT NULL,
    run_id          text,
    created_at      timestamptz NOT NULL DEFAULT now()
);
""",
    ),
    Migration(
        3,
        "events: index on the transaction order, for the sensor's probe of the newest committed events",
        # The sensor reads the newest events (from the lowest watermark up to the horizon) from the end of
        # this index: one descent whatever the table size (docs/decisions.md, "The sensor's probe"). It is
        # on the expression tx_id::text::bigint, not on tx_id, so that only the probe, which names that
        # expression, can use it: on plain tx_id the planner began reading extraction batches through it.
        # On a large existing table, build it first with CREATE INDEX CONCURRENTLY under this name: the
        # migration then only records itself.
        """
CREATE INDEX IF NOT EXISTS events_tx_order_idx ON {schema}.events ((tx_id::text::bigint));
""",
    ),
    Migration(
        4,
        "sinks: the Delta table a consumer's offsets belong to",
        """
-- A consumer's watermarks say what is in one particular Delta table. Its id (Delta's metaData.id,
-- set when the table is created) is recorded with the first batch, so that a run pointed at another
-- table (a lost, moved or recreated lake) refuses instead of continuing from watermarks that are not its own.
CREATE TABLE IF NOT EXISTS es_pipeline.sinks (
    consumer    text        PRIMARY KEY,
    table_id    text        NOT NULL,
    path        text        NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
""",
    ),
    Migration(
        5,
        "events: append-only, and tx_id is always the writing transaction's",
        """
-- An event placed below a watermark (a tx_id written by hand) or changed after it was extracted would make
-- the lake differ from the store without anyone noticing. So an insert whose tx_id is not the inserting
-- transaction's is refused (the WHEN clause keeps the normal path free of a trigger call), and so are
-- UPDATE, DELETE and TRUNCATE of events. A dump restored into a new cluster keeps its rows' tx_ids:
-- pg_dump creates triggers after it has loaded the data.
CREATE FUNCTION {schema}.events_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        RAISE EXCEPTION 'tx_id is set by the database: leave it out of the insert into %.%', TG_TABLE_SCHEMA, TG_TABLE_NAME
            USING ERRCODE = 'check_violation';
    END IF;
    RAISE EXCEPTION 'events are append-only: % on %.% is refused', TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation',
              HINT = 'Append a new event that corrects the old one; the lake keeps every event once.';
END $$;
CREATE TRIGGER events_tx_id_is_the_writer BEFORE INSERT ON {schema}.events
    FOR EACH ROW WHEN (NEW.tx_id IS DISTINCT FROM pg_current_xact_id()) EXECUTE FUNCTION {schema}.events_guard();
CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON {schema}.events
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.events_guard();
""",
    ),
    Migration(
        6,
        "lake_commits: the last batch in Delta per app id; sinks: the source cluster's identity",
        """
-- The PostgreSQL cluster (pg_control_system().system_identifier) whose transaction ids the watermarks
-- count in. A store restored or replicated into another cluster has other ids: runs refuse there.
ALTER TABLE es_pipeline.sinks ADD COLUMN IF NOT EXISTS source_cluster text;
-- Set by `es-pipeline offsets rebase` after the store moved to another cluster: batches that start below it
-- leave out the events the lake holds already (by key), since restored and new transaction ids interleave.
ALTER TABLE es_pipeline.sinks ADD COLUMN IF NOT EXISTS rebased_below xid8;
-- The slices whose first run after a rebase has still to bring the restored events that lie above the new
-- cluster's horizon (their ids come from the old cluster; waiting for the horizon could take for ever).
CREATE TABLE IF NOT EXISTS es_pipeline.rebase_catchup (
    consumer text     NOT NULL,
    slice    smallint NOT NULL,
    PRIMARY KEY (consumer, slice)
);

-- Written in the transaction that advances the watermarks. At the start of a run it is compared with the
-- Delta table's own record (its txn version for the app id): if they differ beyond a pending batch,
-- Postgres and the lake have parted (a restore, a failover to a replica that was behind, a lake restored
-- from a copy), and the run refuses instead of skipping or repeating batches.
CREATE TABLE IF NOT EXISTS es_pipeline.lake_commits (
    app_id       text        PRIMARY KEY,
    consumer     text        NOT NULL,
    batch_id     bigint      NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT now()
);
""",
    ),
)

MIGRATIONS += (
    Migration(
        7,
        "snapshots: keyed by (tenant, stream_id)",
        """
-- A stream id may be used by two tenants; '' is the tenant of a store without tenants.
ALTER TABLE {schema}.snapshots ADD COLUMN tenant text NOT NULL DEFAULT '';
ALTER TABLE {schema}.snapshots DROP CONSTRAINT snapshots_pkey;
ALTER TABLE {schema}.snapshots ADD PRIMARY KEY (tenant, stream_id);
""",
    ),
)

MIGRATIONS += (
    Migration(
        8,
        "tenant_erasures: what `es-pipeline tenant erase` removed, and when",
        """
-- One row per erased tenant and consumer, written when the erasure starts (so that a run cut short is
-- finished by the next `tenant erase`) and completed when the files are purged. A tenant the lake holds
-- whose partition left the store without a row here is reported by the checks and by `status`.
CREATE TABLE IF NOT EXISTS es_pipeline.tenant_erasures (
    consumer     text        NOT NULL,
    tenant       text        NOT NULL,
    partition    text,
    store_events bigint,
    lake_rows    jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    started_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz,
    PRIMARY KEY (consumer, tenant)
);
-- A store whose roles were applied before this table existed: the extractor reads it in `status` and the checks.
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'es_pipeline_extractor') THEN
        GRANT SELECT, INSERT, UPDATE, DELETE ON es_pipeline.tenant_erasures TO es_pipeline_extractor;
    END IF;
END $$;
""",
    ),
)

MIGRATIONS += (
    Migration(
        9,
        "es_pipeline.snapshots: the snapshot write-back of an adopted framework's store",
        """
-- A framework's store has no snapshot table of es_pipeline's shape, and es_pipeline adds nothing to the
-- framework's schema: the latest snapshot of each stream is written back here instead, one consumer's rows apart.
CREATE TABLE IF NOT EXISTS es_pipeline.snapshots (
    consumer    text        NOT NULL,
    tenant      text        NOT NULL DEFAULT '',
    stream_id   text        NOT NULL,
    stream_type text        NOT NULL,
    version     integer     NOT NULL,
    state       jsonb       NOT NULL,
    revision    integer     NOT NULL,
    taken_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, tenant, stream_id)
);
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'es_pipeline_snapshots') THEN
        GRANT USAGE ON SCHEMA es_pipeline TO es_pipeline_snapshots;
        GRANT SELECT, INSERT, UPDATE ON es_pipeline.snapshots TO es_pipeline_snapshots;
    END IF;
END $$;
""",
    ),
    Migration(
        10,
        "the extractor writes only what extraction writes: the snapshots and the erasure record are read-only to it",
        """
-- Others read es_pipeline.snapshots (the write-back's) and tenant_erasures (`tenant erase`'s, run as the owner) as
-- the truth: a run of the extractor has no business changing them (docs/security.md).
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'es_pipeline_extractor') THEN
        REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON es_pipeline.tenant_erasures, es_pipeline.snapshots
            FROM es_pipeline_extractor;
    END IF;
END $$;
""",
    ),
    Migration(
        11,
        "sinks: the batch id a rebase's first pass sorts its events by",
        """
-- Set by `es-pipeline offsets rebase` (a batch id taken from the sequence, past every batch of the lake): the
-- events each slice's first run after the rebase brings (the restored tail and what the new cluster committed
-- meanwhile) carry it as their `batch_id`, so that they sort after everything extracted before the move and before
-- everything extracted after (docs/domain.md, "The order of events"). Cleared with `rebased_below`.
ALTER TABLE es_pipeline.sinks ADD COLUMN IF NOT EXISTS rebase_batch bigint;
""",
    ),
    Migration(
        12,
        "store_identity: the store's id, which binds a warehouse to it from the first byte",
        """
-- One row: an id made once per store, kept by a dump and its restore (the same store, moved). The first run binds
-- the lake's `events` to `<id>/<consumer>` before any row (the table property es_pipeline.source), so that a
-- second store pointed at the same warehouse is refused before it writes a byte (LakeHoldsAnotherSource).
CREATE TABLE IF NOT EXISTS es_pipeline.store_identity (
    one        boolean     PRIMARY KEY DEFAULT true CHECK (one),
    store_id   uuid        NOT NULL DEFAULT gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO es_pipeline.store_identity DEFAULT VALUES ON CONFLICT DO NOTHING;
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'es_pipeline_extractor') THEN
        GRANT SELECT ON es_pipeline.store_identity TO es_pipeline_extractor;
    END IF;
END $$;
""",
    ),
)


def layout_sql(tenants: bool) -> dict[str, sql.Composable]:
    """The fragments of migration 1 that differ in a store partitioned by tenant (`ES_PIPELINE_SOURCE=es-tenants`):
    a `tenant` column in `events` and `streams`, part of both keys, and `events` partitioned by LIST on it, one
    partition per tenant (`es-pipeline tenant add`), so that a tenant is erased by dropping its partition."""
    if not tenants:
        return {"streams_tenant": sql.SQL(""), "stream_key": sql.SQL("stream_id"), "events_tenant": sql.SQL(""),
                "event_key": sql.SQL("stream_id, version"), "partitioning": sql.SQL("")}
    column = "\n    tenant      text        NOT NULL CHECK (tenant <> '' AND length(tenant) <= 200),"
    return {
        "streams_tenant": sql.SQL(column),  # type: ignore[arg-type]
        "stream_key": sql.SQL("tenant, stream_id"),
        "events_tenant": sql.SQL("\n    tenant          text        NOT NULL CHECK (tenant <> '' AND length(tenant) <= 200),"),
        "event_key": sql.SQL("tenant, stream_id, version"),
        "partitioning": sql.SQL(" PARTITION BY LIST (tenant)"),
    }


def has_tenants(conn: psycopg.Connection, schema: str) -> bool | None:
    """Whether the store's `events` has the `tenant` column, which only the layout partitioned by tenant has (the
    table is made so by migration 1); None when there is no `events` yet."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attname = 'tenant'"
        " AND NOT a.attisdropped) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = 'events'", (schema,),
    ).fetchone()
    return None if row is None else bool(row[0])


# What an existing table must look like for us to adopt it instead of refusing.
EXPECTED_COLUMNS: dict[str, dict[str, str]] = {
    "streams": {"stream_id": "text", "stream_type": "text", "version": "integer"},
    "events": {
        "tx_id": "xid8", "stream_id": "text", "stream_type": "text", "version": "integer",
        "slice": "smallint", "event_type": "text", "payload": "jsonb", "metadata": "jsonb",
    },
    "snapshots": {"stream_id": "text", "version": "integer", "state": "jsonb", "revision": "integer"},
}


# es_pipeline's own tables (schema es_pipeline): needed by every source, created by these migrations alone,
# whose statements are all idempotent (`IF NOT EXISTS`). `source adopt` runs them for a store not our own.
OWN_TABLES_MIGRATIONS = (2, 4, 6, 8, 9, 11, 12)


def own_tables_statements() -> list[sql.Composed]:
    """The statements that create es_pipeline's own tables (for `source adopt`, without `es.events`)."""
    return [sql.SQL(m.statements).format() for m in MIGRATIONS if m.version in OWN_TABLES_MIGRATIONS]  # type: ignore[arg-type]


def applied_versions(conn: psycopg.Connection, schema: str) -> set[int]:
    name = sql.Identifier(schema, "schema_migrations").as_string(conn)  # quoted: any schema name is one name
    exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()
    if not exists or not exists[0]:
        return set()
    rows = conn.execute(
        sql.SQL("SELECT version FROM {}.schema_migrations").format(sql.Identifier(schema))
    ).fetchall()
    return {r[0] for r in rows}


def _check_existing_tables(conn: psycopg.Connection, schema: str) -> None:
    for table, expected in EXPECTED_COLUMNS.items():
        rows = conn.execute(
            "SELECT column_name, format_type(atttypid, atttypmod) FROM information_schema.columns c "
            "JOIN pg_attribute a ON a.attrelid = format('%%I.%%I', c.table_schema, c.table_name)::regclass "
            " AND a.attname = c.column_name "
            "WHERE c.table_schema = %s AND c.table_name = %s",
            (schema, table),
        ).fetchall()
        if not rows:
            continue
        actual = {name: typ for name, typ in rows}
        for column, typ in expected.items():
            if column not in actual:
                raise IncompatibleSchema(f"{schema}.{table}", f"it has no column {column} ({typ})")
            if actual[column] != typ:
                raise IncompatibleSchema(
                    f"{schema}.{table}", f"its column {column} is {actual[column]}, expected {typ}"
                )
        raise IncompatibleSchema(
            f"{schema}.{table}", "it was not created by es_pipeline's migrations (no record in schema_migrations)"
        )


def migrate(dsn: str, schema: str = "es", *, tenants: bool = False) -> list[Migration]:
    """Apply the missing migrations; return the ones applied now (empty when up to date).

    `tenants`: a new store is created partitioned by tenant (`layout_sql`); an existing store must have been
    created the same way, since a table is not turned into a partitioned one in place."""
    applied_now: list[Migration] = []
    with connect(dsn) as conn:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
            done = applied_versions(conn, schema)
            ident = sql.Identifier(schema)
            existing = has_tenants(conn, schema) if done else None
            if existing is not None and existing != tenants:
                raise IncompatibleSchema(
                    f"{schema}.events",
                    "it is partitioned by tenant: set ES_PIPELINE_SOURCE=es-tenants" if existing else
                    "it was created without tenants, and a table is not partitioned in place: create a new store "
                    "with ES_PIPELINE_SOURCE=es-tenants (docs/sources.md, \"Tenants\"), or keep ES_PIPELINE_SOURCE=es",
                )
            if not done:  # a store already migrated needs no CREATE on the database (no CREATE SCHEMA at all)
                _check_existing_tables(conn, schema)
                conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
                conn.execute(
                    sql.SQL(
                        "CREATE TABLE IF NOT EXISTS {}.schema_migrations ("
                        " version integer PRIMARY KEY, name text NOT NULL,"
                        " applied_at timestamptz NOT NULL DEFAULT now())"
                    ).format(ident)
                )
            for m in MIGRATIONS:
                if m.version in done:
                    continue
                conn.execute(sql.SQL(m.statements).format(schema=ident, **layout_sql(tenants)))  # type: ignore[arg-type]
                conn.execute(
                    sql.SQL("INSERT INTO {}.schema_migrations (version, name) VALUES (%s, %s)").format(ident),
                    (m.version, m.name),
                )
                applied_now.append(m)
    return applied_now
