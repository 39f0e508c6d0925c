"""The role model: what each part of a deployment may do in the event store, as SQL a DBA can read.

Four group roles (NOLOGIN); a DBA grants one to each login role (`GRANT es_pipeline_extractor TO etl`):

- `es_pipeline_owner`: owns the schemas and runs `es-pipeline db migrate`.
- `es_pipeline_writer`: the applications. Appends events (INSERT on every column but `tx_id`, which
  the store fills with the writing transaction's id), reads and versions streams, loads snapshots.
  No UPDATE or DELETE of events (the append-only trigger refuses them anyway).
- `es_pipeline_extractor`: es_pipeline's runs, sensor, checks and `status`. Reads the store; writes
  only the tables extraction writes (offsets, pending batches, sinks, lake commits, rebase catch-up) and
  only reads es_pipeline's others (snapshots, the erasure record); `pg_read_all_stats`,
  so that the age of other roles' open transactions (what holds the horizon back) is seen, not 0.
- `es_pipeline_snapshots`: the snapshot write-back. Writes `snapshots` and nothing else.

`es-pipeline db roles` applies it (idempotent) as a role that may create roles and grant on the
schemas (the owner or a superuser), and prints every statement. docs/security.md has the table.
"""

from __future__ import annotations

from collections.abc import Callable

from psycopg import sql

from es_pipeline.store.conninfo import connect
from es_pipeline.store.migrations import has_tenants

OWNER = "es_pipeline_owner"
WRITER = "es_pipeline_writer"
EXTRACTOR = "es_pipeline_extractor"
SNAPSHOTS = "es_pipeline_snapshots"
ROLES = (OWNER, WRITER, EXTRACTOR, SNAPSHOTS)
OWN_SCHEMA = "es_pipeline"  # es_pipeline's own tables (offsets, pending batches, sinks, lake commits)
# es_pipeline's own tables that extraction writes, and those it only reads (the write-back's, `tenant erase`'s).
EXTRACTION_TABLES = ("offsets", "pending_batches", "sinks", "lake_commits", "rebase_catchup")
OTHERS_TABLES = ("snapshots", "tenant_erasures")
# The columns a writer may set; tx_id, global_position, slice and recorded_at are the store's.
WRITER_EVENT_COLUMNS = ("stream_id", "stream_type", "version", "event_type", "payload", "metadata")


def statements(schema: str, *, tenants: bool = False) -> list[sql.Composed]:
    """Every statement of the role model for the store in `schema`, in order; each is safe to repeat.
    `tenants`: the store is partitioned by tenant, and writers name the tenant too."""
    s, own = sql.Identifier(schema), sql.Identifier(OWN_SCHEMA)
    owner, writer, extractor, snapshots = (sql.Identifier(r) for r in ROLES)
    table = lambda name: sql.Identifier(schema, name)  # noqa: E731 - a one-line helper for the list below
    columns = sql.SQL(", ").join(sql.Identifier(c) for c in (*WRITER_EVENT_COLUMNS, *(("tenant",) if tenants else ())))
    out: list[sql.Composed] = [
        sql.SQL(
            # Roles are the cluster's: another database's `db roles` may create it between the look and CREATE.
            "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {name}) "
            "THEN CREATE ROLE {role} NOLOGIN; END IF; "
            "EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$"
        ).format(name=sql.Literal(r), role=sql.Identifier(r))
        for r in ROLES
    ]
    out += [
        sql.SQL("GRANT USAGE ON SCHEMA {} TO {}, {}, {}").format(s, writer, extractor, snapshots),
        sql.SQL("GRANT ALL ON SCHEMA {}, {} TO {}").format(s, own, owner),
        # writer: append, version streams, read streams and snapshots
        sql.SQL("GRANT SELECT ON {}, {}, {} TO {}").format(table("events"), table("streams"), table("snapshots"),
                                                           writer),
        sql.SQL("GRANT INSERT ({}) ON {} TO {}").format(columns, table("events"), writer),
        sql.SQL("GRANT INSERT, UPDATE ON {} TO {}").format(table("streams"), writer),
        # extractor: read the store, write es_pipeline's own tables only
        sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(s, extractor),
        *extractor_own_statements(),
        # snapshot write-back: the snapshots table, nothing else
        sql.SQL("GRANT SELECT, INSERT, UPDATE ON {} TO {}").format(table("snapshots"), snapshots),
        *snapshots_own_statements(),
    ]
    return out


def extractor_own_statements() -> list[sql.Composed]:
    """The extractor's grants on es_pipeline's own tables (also made by `source adopt` for a foreign store)."""
    own, extractor = sql.Identifier(OWN_SCHEMA), sql.Identifier(EXTRACTOR)
    return [
        sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(own, extractor),
        # Reads all of them; writes only what extraction writes. The snapshots and the erasure record are others'
        # truth (the write-back's, `tenant erase`'s, run as the owner): read-only here, also where granted before.
        sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(own, extractor),
        sql.SQL(
            "DO $$ DECLARE t text; BEGIN "
            "FOREACH t IN ARRAY ARRAY[{writes}] LOOP IF to_regclass('es_pipeline.' || t) IS NOT NULL THEN "
            "EXECUTE format('GRANT INSERT, UPDATE, DELETE ON es_pipeline.%I TO {role}', t); END IF; END LOOP; "
            "FOREACH t IN ARRAY ARRAY[{reads}] LOOP IF to_regclass('es_pipeline.' || t) IS NOT NULL THEN "
            "EXECUTE format('REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON es_pipeline.%I FROM {role}', t); END IF; "
            "END LOOP; END $$"
        ).format(writes=sql.SQL(", ").join(sql.Literal(t) for t in EXTRACTION_TABLES),
                 reads=sql.SQL(", ").join(sql.Literal(t) for t in OTHERS_TABLES), role=sql.SQL(EXTRACTOR)),
        # UPDATE: setval, when a lake adopted after a restore carries batch ids above the sequence
        sql.SQL("GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {} TO {}").format(own, extractor),
        sql.SQL("GRANT pg_read_all_stats TO {}").format(extractor),
    ]


def snapshots_own_statements() -> list[sql.Composed]:
    """The write-back's grants on `es_pipeline.snapshots`, where an adopted store's snapshots go."""
    own, snapshots = sql.Identifier(OWN_SCHEMA), sql.Identifier(SNAPSHOTS)
    return [
        sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(own, snapshots),
        # `db roles` may run on a store not yet migrated to 9 (migration 9 grants it then, the role existing).
        sql.SQL("DO $$ BEGIN IF to_regclass('es_pipeline.snapshots') IS NOT NULL THEN "
                "GRANT SELECT, INSERT, UPDATE ON es_pipeline.snapshots TO {}; END IF; END $$").format(snapshots),
    ]


def apply(dsn: str, schema: str, *, echo: Callable[[str], None] = print) -> int:
    """Apply the role model to the store at `dsn` in one transaction; echo each statement. Returns their count."""
    with connect(dsn) as conn, conn.transaction():
        todo = statements(schema, tenants=bool(has_tenants(conn, schema)))
        for statement in todo:
            echo(statement.as_string(conn) + ";")
            conn.execute(statement)
    return len(todo)
