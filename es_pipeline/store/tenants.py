"""Tenants in the store: one partition per tenant, found, added and dropped; the record of erasures.

A store partitioned by tenant keeps each tenant's events in a partition of its own (`PARTITION BY LIST`
on the tenant column), as the native store does when created with `ES_PIPELINE_SOURCE=es-tenants`, and as
Marten, Emmett and hand-rolled tables may. Erasing a tenant from the store is dropping that partition:
no row-by-row DELETE, no dead tuples, and the append-only guard of the native store stays in force for
every other statement. `extraction/erase.py` does the whole erasure (store, lake, files) around this.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass

import psycopg
from psycopg import sql

from es_pipeline.errors import TenantRefused
from es_pipeline.source.mapping import NO_TENANT, Source

LOCK_TIMEOUT = "5s"  # attaching and detaching a partition lock the parent table briefly: never queue writers behind us


@dataclass(frozen=True)
class Partition:
    """The partition that holds one tenant's events, and the partitioned table it belongs to."""

    schema: str
    name: str
    parent: str  # the partitioned table's name, in the same schema

    @property
    def qualified(self) -> str:
        """`schema.name`, for messages and the erasure record (statements use `sql.Identifier`)."""
        return f"{self.schema}.{self.name}"


def partition_name(tenant: str) -> str:
    """`events_t_<readable part>_<hash>`: at most 63 bytes whatever the tenant. Two tenants would share a name only
    if their readable parts and 32-bit hashes matched: `tenant add` then finds the name taken and fails, safely."""
    readable = re.sub(r"[^a-z0-9]+", "_", tenant.lower()).strip("_")[:32]
    return f"events_t_{readable}_{hashlib.sha1(tenant.encode()).hexdigest()[:8]}"


def partition_key(conn: psycopg.Connection, source: Source) -> tuple[str, str] | None:
    """(column, its type) when the source table is partitioned by LIST on the mapping's tenant column, else None."""
    if source.tenant == NO_TENANT:
        return None
    row = conn.execute(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_partitioned_table p "
        "JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = p.partattrs[0] "
        "WHERE p.partrelid = to_regclass(%s) AND p.partstrat = 'l' AND p.partnatts = 1",
        (source.qualified_table,),
    ).fetchone()
    if row is None:
        return None
    column = sql.Identifier(row[0]).as_string(conn)
    # The mapping names the column bare (`tenant_id`), quoted (`"TenantId"`) or qualified by the row alias.
    named = {source.tenant.strip(), source.tenant.strip().removeprefix("t.")}
    return (str(row[0]), str(row[1])) if column in named or row[0] in named else None


def find_partition(conn: psycopg.Connection, source: Source, tenant: str) -> Partition | None:
    """The partition of the source table that holds `tenant` alone (its bound is `IN (tenant)`), or None."""
    key = partition_key(conn, source)
    if key is None:
        return None
    column, type_ = key
    try:
        bound = conn.execute(
            sql.SQL("SELECT CAST(%s AS {})::text, format('FOR VALUES IN (%%L)', CAST(%s AS {})::text)").format(
                sql.SQL(type_), sql.SQL(type_)),  # type: ignore[arg-type]  # a type name from the catalog
            (tenant, tenant),
        ).fetchone()
    except psycopg.errors.DataError:  # not a value of the column's type (a uuid column, a name): no such partition
        conn.rollback()
        return None
    assert bound is not None
    if bound[0] != tenant:  # a cast that truncates (varchar(n)) or respells (uuid): another tenant, or another name
        raise TenantRefused("erase", tenant, f"the tenant column {column} is {type_}, in which it reads {bound[0]!r}",
                            "Name the tenant as the lake shows it (`es-pipeline sql \"SELECT DISTINCT tenant FROM events\"`).")
    bound = (bound[1],)
    row = conn.execute(
        "SELECT n.nspname, c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE i.inhparent = to_regclass(%s) AND pg_get_expr(c.relpartbound, c.oid) = %s",
        (source.qualified_table, bound[0]),
    ).fetchone()
    return Partition(str(row[0]), str(row[1]), source.table) if row else None


def store_has_rows(conn: psycopg.Connection, source: Source, tenant: str) -> bool:
    """Whether the source still holds any event of `tenant` (pruned to its partition where partitioned)."""
    row = conn.execute(
        sql.SQL("SELECT EXISTS (SELECT 1 FROM {} e WHERE e.tenant = %s)").format(source.relation_sql()), (tenant,)
    ).fetchone()
    return bool(row and row[0])


def add(conn: psycopg.Connection, source: Source, tenant: str) -> tuple[Partition, bool]:
    """Create the partition of `tenant` in the native store partitioned by tenant; (partition, created now)."""
    if not source.native_tenants:
        raise TenantRefused("add", tenant, f"{source.label} is not es_pipeline's store partitioned by tenant",
                                "Tenants of another framework's store are created by that framework.")
    if not tenant:
        raise TenantRefused("add", tenant, "the empty tenant is the tenant of a store without tenants",
                                "Name the tenant.")
    if erasures(conn, source.consumer).get(tenant) is False:
        raise TenantRefused("add", tenant, "its erasure has not finished (es_pipeline.tenant_erasures)",
                            f"Run `es-pipeline tenant erase {tenant} --yes` again to finish it, then add the tenant.")
    existing = find_partition(conn, source, tenant)
    if existing is not None:
        return existing, False
    part = Partition(source.schema, partition_name(tenant), source.table)
    with conn.transaction():
        conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
        conn.execute(sql.SQL("CREATE TABLE {} PARTITION OF {} FOR VALUES IN ({})").format(
            sql.Identifier(part.schema, part.name), sql.Identifier(source.schema, source.table), sql.Literal(tenant)))
        # The parent's statement-level guard does not fire for a statement naming the partition itself.
        conn.execute(sql.SQL(
            "CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON {} "
            "FOR EACH STATEMENT EXECUTE FUNCTION {}.events_guard()"
        ).format(sql.Identifier(part.schema, part.name), sql.Identifier(source.schema)))
    return part, True


def count_events(conn: psycopg.Connection, part: Partition) -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(part.schema, part.name))).fetchone()
    return int(row[0]) if row else 0


DROP_ATTEMPTS = 6  # each waits up to LOCK_TIMEOUT for the table's readers, then tries again a moment later


def drop(conn: psycopg.Connection, part: Partition, tenant: str) -> None:
    """Detach and drop the tenant's partition (and its sub-partitions) in one transaction. Detaching locks the
    parent: a long reader (a check's scan) makes it wait, for `LOCK_TIMEOUT` at a time, never queueing writers."""
    for attempt in range(DROP_ATTEMPTS):
        try:
            with conn.transaction():
                conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
                conn.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(
                    sql.Identifier(part.schema, part.parent), sql.Identifier(part.schema, part.name)))
                conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(part.schema, part.name)))
            return
        except psycopg.errors.LockNotAvailable:
            if attempt == DROP_ATTEMPTS - 1:
                raise TenantRefused("erase", tenant, f"{part.schema}.{part.parent} stayed locked by other sessions",
                                    "See pg_locks for long transactions on it, then run `tenant erase` again.") from None
            time.sleep(1.0 + attempt)


def delete_stream_rows(conn: psycopg.Connection, schema: str, tenant: str) -> dict[str, int]:
    """The native store's `streams` rows of `tenant` (its snapshots: `delete_snapshot_rows`)."""
    cur = conn.execute(sql.SQL("DELETE FROM {} WHERE tenant = %s").format(sql.Identifier(schema, "streams")), (tenant,))
    return {f"{schema}.streams": cur.rowcount}


def _exists(conn: psycopg.Connection, table: str) -> bool:
    row = conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()
    return row is not None and row[0] is not None


# -- the record of erasures (es_pipeline.tenant_erasures) ------------------------------------------------------

def record_start(conn: psycopg.Connection, consumer: str, tenant: str, partition: str | None, store_events: int) -> None:
    """Written before anything is removed: a `tenant erase` cut short is finished by running it again. A record
    there already (a run cut short, or a finished erasure run again) keeps what it says."""
    conn.execute(
        "INSERT INTO es_pipeline.tenant_erasures (consumer, tenant, partition, store_events) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT (consumer, tenant) DO UPDATE SET "
        "partition = coalesce(tenant_erasures.partition, excluded.partition), "
        "store_events = CASE WHEN tenant_erasures.partition IS NULL THEN excluded.store_events "
        "                    ELSE tenant_erasures.store_events END",
        (consumer, tenant, partition, store_events),
    )


def record_finish(conn: psycopg.Connection, consumer: str, tenant: str, lake_rows: dict[str, int]) -> None:
    """The first finish records the rows removed; running a finished erasure again changes nothing of it."""
    conn.execute(
        "UPDATE es_pipeline.tenant_erasures SET lake_rows = CASE WHEN finished_at IS NULL THEN %s::jsonb "
        "ELSE lake_rows END, finished_at = coalesce(finished_at, now()) WHERE consumer = %s AND tenant = %s",
        (json.dumps(lake_rows), consumer, tenant),
    )


def erasures(conn: psycopg.Connection, consumer: str) -> dict[str, bool]:
    """tenant -> whether its erasure finished, for every erasure recorded for `consumer`."""
    if not _exists(conn, "es_pipeline.tenant_erasures"):
        return {}
    rows = conn.execute(
        "SELECT tenant, finished_at IS NOT NULL FROM es_pipeline.tenant_erasures WHERE consumer = %s", (consumer,),
    ).fetchall()
    return {str(t): bool(f) for t, f in rows}


def forget_erasure(conn: psycopg.Connection, consumer: str, tenant: str) -> None:
    """A tenant added again after its erasure is a new tenant: its old record would hide a lost partition."""
    if _exists(conn, "es_pipeline.tenant_erasures"):
        conn.execute("DELETE FROM es_pipeline.tenant_erasures WHERE consumer = %s AND tenant = %s", (consumer, tenant))


def missing(conn: psycopg.Connection, source: Source, lake_tenants: dict[str, int]) -> dict[str, int]:
    """The tenants the lake holds (tenant -> events) that the store no longer has and that were not erased
    by `tenant erase`: a partition dropped, detached or truncated behind es_pipeline's back."""
    if source.tenant == NO_TENANT:
        return {}
    erased = erasures(conn, source.consumer)
    return {
        t: n for t, n in sorted(lake_tenants.items())
        if t != "" and t not in erased and not store_has_rows(conn, source, t)
    }
