"""`es-pipeline source adopt`: prepare an existing event table for extraction, touching nothing its framework uses.

What it does, each step skipped when already done (so a second run changes nothing):

1. checks the table and the columns the mapping reads, naming what is missing;
2. adds `tx_id xid8 NOT NULL DEFAULT pg_current_xact_id()` where the table has no such column: a
   catalog-only change (a non-volatile default is stored once, no rewrite), under a short `lock_timeout`.
   Rows already there read the adopting transaction's id, so the first run extracts them all;
3. builds the two indexes the reads need, on the mapping's own expressions, CONCURRENTLY (writers go on):
   `(slice, tx_id)` for the batches and `(tx_id::text::bigint)` for the sensor's probe. A partitioned table
   gets them `ON ONLY` itself, built per partition, then attached;
4. creates es_pipeline's own tables (offsets, pending batches, sinks) in the `es_pipeline` schema;
5. adds the guard the native store has, as far as the framework allows: a row inserted with a `tx_id` that is
   not its own transaction's (`INSERT … SELECT *` from an archive, a copy job) gets its own, and a row an
   UPDATE makes an event under the mapping's `filter` gets the updating transaction's (a draft published):
   either would otherwise lie below a watermark, skipped for good. The framework's own inserts, which take
   the column's default or `pg_current_xact_id()`, never call it (a `WHEN` clause); where the column is
   not a plain name, or the framework's rows cannot be told apart, nothing is added (docs/sources.md);
6. where `es-pipeline db roles` made the extractor role, lets it read the table (SELECT, nothing more)
   and use es_pipeline's own tables.

docs/sources.md says what each preset needs and what this changes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from es_pipeline.errors import SourceNotServable
from es_pipeline.source.mapping import Source
from es_pipeline.store.conninfo import connect
from es_pipeline.store.migrations import MIGRATION_LOCK_KEY, own_tables_statements
from es_pipeline.store.roles import EXTRACTOR, extractor_own_statements

LOCK_TIMEOUT = "5s"  # ADD COLUMN waits this long for writers' locks, then fails (retry later); never queues them


@dataclass
class Adoption:
    """What `adopt` did (empty lists: nothing was needed)."""

    added: list[str] = field(default_factory=list)  # columns
    indexes: list[str] = field(default_factory=list)  # indexes built (one per partition, and their parents)
    guards: list[str] = field(default_factory=list)  # triggers created

    @property
    def changed(self) -> bool:
        return bool(self.added or self.indexes or self.guards)


def index_name(table: str, kind: str) -> str:
    """`<table>_es_<kind>`, cut to PostgreSQL's 63 bytes with a hash of the whole name where too long."""
    name = f"{table}_es_{kind}"
    if len(name.encode()) <= 63:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{name[:50]}_{digest}"


def columns_of(conn: psycopg.Connection, schema: str, table: str) -> dict[str, str]:
    rows = conn.execute(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
        "WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped",
        (sql.Identifier(schema, table).as_string(conn),),
    ).fetchall()
    return {str(n): str(t) for n, t in rows}


def check(conn: psycopg.Connection, source: Source) -> list[str]:
    """What keeps `source` from being served as it stands (empty: nothing); `tx_id` alone may be added."""
    cols = columns_of(conn, source.schema, source.table)
    if not cols:
        return [f"there is no table {source.schema}.{source.table}"]
    problems = []
    missing = [c for c in source.columns if c not in cols and c != source.tx_id]
    if missing:
        problems.append(f"{source.schema}.{source.table} has no column {', '.join(missing)}")
    if source.tx_id in cols and cols[source.tx_id] != "xid8":
        problems.append(f"its column {source.tx_id} is {cols[source.tx_id]}, not xid8")
    return problems


_TIMESTAMP = 1114  # PostgreSQL's type oid of `timestamp without time zone`


def typed_problems(conn: psycopg.Connection, source: Source) -> list[str]:
    """What the types of the mapping's expressions would make es_pipeline guess (empty: nothing): a
    `timestamp without time zone` recorded_at with no `recorded_at_zone` (read in the session's zone, every time
    would shift by hours on a non-UTC server), or a zone given for one that has its zone. (A `bigint` version
    is read as is and refused by the lake's `int` past 2,147,483,647, never wrapped: `reader.conform`.)"""
    cur = conn.execute(  # type: ignore[call-overload]  # the mapping's expressions, from the operator's file
        f"SELECT ({source.recorded_at}) FROM {source.qualified_table} t LIMIT 0")
    recorded = cur.description[0].type_code if cur.description else None
    problems = []
    if recorded == _TIMESTAMP and not source.recorded_at_zone:
        problems.append(f"its recorded_at ({source.recorded_at}) is a timestamp without time zone: say which zone "
                        'the framework writes it in, recorded_at_zone = "UTC" (or its zone), rather than let the '
                        "session's zone be guessed")
    if recorded != _TIMESTAMP and source.recorded_at_zone:
        problems.append(f"recorded_at_zone is for a timestamp without time zone, and recorded_at "
                        f"({source.recorded_at}) has its zone already: leave recorded_at_zone out")
    return problems


def _refuse(source: Source, problems: list[str]) -> SourceNotServable:
    return SourceNotServable(
        source.label, problems,
        "Point ES_PIPELINE_SOURCE at the right preset or schema (`emmett:myschema`), or describe the table "
        "in a TOML file (docs/sources.md).",
    )


def adopt(dsn: str, source: Source, *, echo: Callable[[str], None] = print) -> Adoption:
    """Prepare the table of `source` (see the module's docstring); every statement is echoed before it runs."""
    done = Adoption()
    with connect(dsn, autocommit=True, application_name="es_pipeline adopt") as conn:
        problems = check(conn, source)
        if problems:
            raise _refuse(source, problems)
        table = sql.Identifier(source.schema, source.table)
        if source.tx_id not in columns_of(conn, source.schema, source.table):
            if not source.tx_id.isidentifier():
                raise _refuse(source, [f"it has no column {source.tx_id}, and that is not a name adopt can add"])
            if _has_offsets(conn, source.consumer):
                raise SourceNotServable(source.label, [
                    f"its column {source.tx_id} is gone, though es_pipeline has extracted from it already (a schema "
                    "tool dropped it?)"],
                    "Adding it again would give every event a new id and they would all be extracted again. Keep "
                    "the framework from migrating the table (docs/sources.md), then rebuild: `es-pipeline offsets "
                    "reset` with a new ES_PIPELINE_WAREHOUSE, and adopt again.")
            statement = sql.SQL("ALTER TABLE {} ADD COLUMN {} xid8 NOT NULL DEFAULT pg_current_xact_id()").format(
                table, sql.Identifier(source.tx_id))
            echo(statement.as_string(conn))
            with conn.transaction():
                conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
                conn.execute(statement)
            done.added.append(source.tx_id)
        try:  # the mapping's expressions, checked against the table before anything is built on them
            conn.execute(f"EXPLAIN SELECT * FROM {source.relation()} e LIMIT 0")  # type: ignore[arg-type]
        except psycopg.Error as exc:
            raise _refuse(source, [f"its mapping does not read the table: {str(exc).splitlines()[0]}"]) from None
        problems = typed_problems(conn, source)
        if problems:
            raise _refuse(source, problems)
        for kind, expression in (("slice_tx", f"({source.slice}), {source.tx_id}"),
                                 ("tx_order", f"({source.tx_id}::text::bigint)")):
            _index(conn, source.schema, source.table, index_name(source.table, kind), expression, done, echo)
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
            for own in own_tables_statements():
                conn.execute(own)
        _guard(conn, source, done, echo)
        _grant_reads(conn, source, echo)
    return done


# The guard's one function, for every adopted table: its arguments are the tx_id column and the mapping's filter.
GUARD_FUNCTION = """
CREATE OR REPLACE FUNCTION es_pipeline.adopted_tx_id_guard() RETURNS trigger LANGUAGE plpgsql AS $guard$
DECLARE
    was_event boolean;
    is_event boolean;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        EXECUTE format('SELECT (%s) FROM (SELECT ($1).*) t', TG_ARGV[1]) INTO was_event USING OLD;
        EXECUTE format('SELECT (%s) FROM (SELECT ($1).*) t', TG_ARGV[1]) INTO is_event USING NEW;
        IF is_event IS NOT TRUE OR was_event IS TRUE THEN
            RETURN NEW;  -- not made an event by this update: its id stays (an extracted row is never re-read)
        END IF;
    END IF;
    RETURN jsonb_populate_record(NEW, jsonb_build_object(TG_ARGV[0], pg_current_xact_id()::text));
END
$guard$
"""


def _guard(conn: psycopg.Connection, source: Source, done: Adoption, echo: Callable[[str], None]) -> None:
    """The triggers of step 5 (see the module's docstring), each created once."""
    if not source.tx_id.isidentifier():
        return
    table = sql.Identifier(source.schema, source.table).as_string(conn)
    column = sql.Identifier(source.tx_id).as_string(conn)
    args = f"{sql.Literal(source.tx_id).as_string(conn)}, {sql.Literal(source.filter).as_string(conn)}"
    wanted = [(index_name(source.table, "tx_guard"),
               f"BEFORE INSERT ON {table} FOR EACH ROW WHEN (NEW.{column} IS DISTINCT FROM pg_current_xact_id())")]
    if source.filter.strip().lower() != "true":
        wanted.append((index_name(source.table, "event_guard"), f"BEFORE UPDATE ON {table} FOR EACH ROW"))
    existing = {str(n) for (n,) in conn.execute(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = to_regclass(%s) AND NOT tgisinternal", (table,))}
    todo = [(name, when) for name, when in wanted if name not in existing]
    if not todo:
        return
    with conn.transaction():
        conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
        _run(conn, GUARD_FUNCTION.strip(), echo)
        for name, when in todo:
            _run(conn, f"CREATE TRIGGER {sql.Identifier(name).as_string(conn)} {when} "
                       f"EXECUTE FUNCTION es_pipeline.adopted_tx_id_guard({args})", echo)
            done.guards.append(f"{source.schema}.{source.table}: {name}")


def _grant_reads(conn: psycopg.Connection, source: Source, echo: Callable[[str], None]) -> None:
    """SELECT on the source's tables for the extractor role, if it exists (GRANT is idempotent)."""
    if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (EXTRACTOR,)).fetchone() is None:
        return
    role = sql.Identifier(EXTRACTOR)
    names = sql.SQL(", ").join(sql.Identifier(source.schema, t) for t in (source.table, *source.also_reads))
    for statement in (sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(source.schema), role),
                      sql.SQL("GRANT SELECT ON {} TO {}").format(names, role), *extractor_own_statements()):
        echo(statement.as_string(conn))
        conn.execute(statement)


def _has_offsets(conn: psycopg.Connection, consumer: str) -> bool:
    if conn.execute("SELECT to_regclass('es_pipeline.offsets')").fetchone() == (None,):
        return False
    return conn.execute("SELECT 1 FROM es_pipeline.offsets WHERE consumer = %s LIMIT 1", (consumer,)).fetchone() is not None


def _partitions(conn: psycopg.Connection, schema: str, table: str) -> list[tuple[str, str, bool]] | None:
    """(schema, name, partitioned) of the direct partitions of a partitioned table; None for a plain table."""
    row = conn.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)",
                       (sql.Identifier(schema, table).as_string(conn),)).fetchone()
    if row is None or row[0] != "p":
        return None
    rows = conn.execute(
        "SELECT n.nspname, c.relname, c.relkind = 'p' FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE i.inhparent = to_regclass(%s) ORDER BY c.relname",
        (sql.Identifier(schema, table).as_string(conn),),
    ).fetchall()
    return [(str(s), str(n), bool(p)) for s, n, p in rows]


def _index_state(conn: psycopg.Connection, schema: str, name: str) -> bool | None:
    """None: no index of that name; else whether it is valid (a failed CONCURRENTLY build leaves an invalid one)."""
    row = conn.execute(
        "SELECT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass(%s)",
        (sql.Identifier(schema, name).as_string(conn),),
    ).fetchone()
    return None if row is None else bool(row[0])


def _run(conn: psycopg.Connection, statement: str, echo: Callable[[str], None]) -> None:
    echo(statement)
    conn.execute(statement)  # type: ignore[arg-type]  # identifiers and the mapping's expressions


def _index(
    conn: psycopg.Connection, schema: str, table: str, name: str, expression: str,
    done: Adoption, echo: Callable[[str], None],
) -> None:
    """The index `name` on `expression` over `table`, built CONCURRENTLY; on a partitioned table, per partition."""
    target = sql.Identifier(schema, table).as_string(conn)
    index = sql.Identifier(schema, name).as_string(conn)
    state = _index_state(conn, schema, name)
    parts = _partitions(conn, schema, table)
    if state is False and parts is None:  # a CONCURRENTLY build that failed: dropped and built again
        _run(conn, f"DROP INDEX CONCURRENTLY {index}", echo)
        state = None
    if parts is None:
        if state is None:
            _run(conn, f"CREATE INDEX CONCURRENTLY {sql.Identifier(name).as_string(conn)} ON {target} ({expression})", echo)
            done.indexes.append(f"{schema}.{name}")
        return
    if state is None:  # invalid until every partition's index is attached; built on no rows
        _run(conn, f"CREATE INDEX {sql.Identifier(name).as_string(conn)} ON ONLY {target} ({expression})", echo)
        done.indexes.append(f"{schema}.{name}")
    for child_schema, child, _ in parts:
        child_index = index_name(child, name.rsplit("_es_", 1)[-1])
        _index(conn, child_schema, child, child_index, expression, done, echo)
        attached = conn.execute(
            "SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass(%s) AND inhparent = to_regclass(%s)",
            (sql.Identifier(child_schema, child_index).as_string(conn), index),
        ).fetchone()
        if not attached:
            _run(conn, f"ALTER INDEX {index} ATTACH PARTITION {sql.Identifier(child_schema, child_index).as_string(conn)}",
                 echo)
