"""One error hierarchy: each error says what is wrong and what to do about it."""

from __future__ import annotations


class EsPipelineError(Exception):
    """Base of every error es_pipeline raises on purpose."""


class Retryable:
    """Marker mixed into errors that a retry may cure (a lock held, a server restarting)."""


class ConfigError(EsPipelineError):
    def __init__(self, setting: str, value: str, expected: str) -> None:
        self.setting, self.value, self.expected = setting, value, expected
        super().__init__(f"{setting}={value!r} is not valid: expected {expected}.")


class DatabaseUnreachable(EsPipelineError, Retryable):
    def __init__(self, host: str, port: str, dbname: str, reason: str) -> None:
        self.host, self.port, self.dbname, self.reason = host, port, dbname, reason
        refused = any(w in reason.lower() for w in ("password", "authentication", "role", "permission"))
        hint = ("Check the user and password of ES_PIPELINE_PG_DSN (or the passfile it names): the server answered "
                "and refused them." if refused else
                "Check ES_PIPELINE_PG_DSN, or start the local server with `es-pipeline db start` (or `make db`).")
        super().__init__(f"cannot connect to PostgreSQL at {host}:{port}, database {dbname!r}: {reason}. {hint}")


class UnsupportedDsn(EsPipelineError):
    """A connection string that one of the read paths cannot use. Never echoes the DSN (it may hold a password)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"ES_PIPELINE_PG_DSN cannot be used by {path}: {reason}.")


class PostgresTooOld(EsPipelineError):
    def __init__(self, version: str) -> None:
        self.version = version
        super().__init__(
            f"PostgreSQL {version} is too old: es_pipeline needs 13 or newer for the xid8 type and "
            "pg_current_xact_id(). Upgrade the server or point ES_PIPELINE_PG_DSN at a newer one."
        )


class IncompatibleSchema(EsPipelineError):
    def __init__(self, table: str, reason: str) -> None:
        self.table, self.reason = table, reason
        super().__init__(
            f"refusing to migrate: table {table} exists but {reason}. Nothing was changed. "
            "Rename or drop that table, or set ES_PIPELINE_SCHEMA to another schema."
        )


class ConcurrencyError(EsPipelineError):
    """An append's expected version did not match the stream's current version; nothing was written."""

    def __init__(self, stream_id: str, expected: int, actual: int) -> None:
        self.stream_id, self.expected, self.actual = stream_id, expected, actual
        super().__init__(
            f"stream {stream_id!r} is at version {actual}, but the append expected {expected}; "
            "nothing was written. Reload the stream and decide again."
        )


class InvalidAppend(EsPipelineError):
    def __init__(self, stream_id: str, reason: str) -> None:
        self.stream_id, self.reason = stream_id, reason
        super().__init__(f"cannot append to stream {stream_id!r}: {reason}. Nothing was written.")


class SliceLocked(EsPipelineError, Retryable):
    def __init__(self, slice_range: str, slices: list[int], holder: str) -> None:
        self.slice_range, self.slices, self.holder = slice_range, slices, holder
        shown = ", ".join(str(s) for s in slices[:8]) + (" …" if len(slices) > 8 else "")
        super().__init__(
            f"slice range {slice_range} is being extracted by {holder} (slices {shown} are locked); "
            "this run wrote nothing. Wait for that run to finish; its range will then be up to date."
        )


class SliceLockLost(EsPipelineError, Retryable):
    """A run's slice locks were gone when it went to record a batch or advance its watermarks."""

    def __init__(self, label: str, holder_pid: int | None) -> None:
        self.label, self.holder_pid = label, holder_pid
        super().__init__(
            f"{label}: the slice locks of this run are no longer held (their connection, backend pid {holder_pid}, "
            "ended: a server restart, a terminated backend, a pooler that dropped it). Nothing more was committed; "
            "a batch already written stays pending and the next run replays it."
        )


class UpdateOverlapped(EsPipelineError, Retryable):
    """An update of a lake table found, just before its commit, that it no longer had the table to itself."""

    def __init__(self, table: str, why: str) -> None:
        self.table = table
        super().__init__(f"{table}: {why}. Nothing was committed; the next update folds in what is left.")


class ReducerError(EsPipelineError):
    def __init__(self, stream_id: str, version: int, event_type: str, reason: str) -> None:
        self.stream_id, self.version, self.event_type, self.reason = stream_id, version, event_type, reason
        super().__init__(
            f"reducer failed on stream {stream_id!r} version {version} ({event_type}): {reason}. "
            "Nothing of this run was committed; the store keeps its events as they are. Fix the reducer (a new revision "
            "rebuilds its type) or reshape such payloads with an upcaster (docs/domain.md), then re-run."
        )


class RunFailed(EsPipelineError):
    """A run `es-pipeline materialize` launched failed: its asset and the cause, in one line (the run's log holds the
    rest, in the Dagster instance)."""

    def __init__(self, asset: str, cause: str) -> None:
        self.asset, self.cause = asset, cause
        super().__init__(f"materialize: {asset} failed: {cause}")


class ProjectionFoldError(EsPipelineError):
    """A cross-stream projection's fold (or its key function) failed on an event; nothing was committed."""

    def __init__(
        self, projection: str, key: str | None, stream_id: str | None, version: int | None, event_type: str | None,
        reason: str,
    ) -> None:
        self.projection, self.key, self.stream_id, self.version = projection, key, stream_id, version
        self.event_type, self.reason = event_type, reason
        where = f" at key {key!r}" if key is not None else ""
        if stream_id is not None:
            where += f" on stream {stream_id!r} version {version}" + (f" ({event_type})" if event_type else "")
        super().__init__(
            f"projection {projection!r} failed{where}: {reason}. Nothing of this run was committed "
            "(ES_PIPELINE_FOLD_ERRORS=stop). Fix the projection's fold (and bump its revision) or the event, then re-run."
        )


class LakeOffsetsMismatch(EsPipelineError):
    """The offsets say events were extracted, but not into the Delta table this run would write to."""

    def __init__(
        self, path: str, consumer: str, slices: list[int], *, recorded: tuple[str, str] | None = None
    ) -> None:
        self.path, self.consumer, self.slices, self.recorded = path, consumer, slices, recorded
        if recorded is None:
            what = f"the Delta table {path} was just created, but"
            where = "(into a table that is no longer there)"
        else:
            what = f"the Delta table at {path} is not the one es_pipeline.offsets describes, and"
            where = f"(into Delta table {recorded[0]}, then at {recorded[1]})"
        super().__init__(
            f"{what} es_pipeline.offsets says {len(slices)} slice(s) were already extracted for consumer "
            f"{consumer!r} {where}. Nothing was written. Either point ES_PIPELINE_WAREHOUSE back at the old lake, "
            "or rebuild it from the event store: `es-pipeline lake rebuild` (it checks the lake against the store, "
            "removes the table, resets the offsets; every projection follows)."
        )


class SinkChanged(EsPipelineError):
    """While a run was writing, its consumer's offsets were bound to another Delta table or reset."""

    def __init__(self, consumer: str, table_id: str) -> None:
        self.consumer, self.table_id = consumer, table_id
        super().__init__(
            f"while this run was writing, the offsets of consumer {consumer!r} were bound to another Delta table "
            f"than {table_id}, or reset. Its watermarks were not advanced; its batch stays pending and the next "
            "run replays it into the table the offsets belong to now. Look for another deployment of es_pipeline "
            "writing to a different ES_PIPELINE_WAREHOUSE with the same database."
        )


class LakeStoreDiverged(EsPipelineError):
    """The Delta table's record of committed batches and Postgres's disagree: one of them went back in time."""

    def __init__(self, app_id: str, path: str, in_lake: int | None, in_store: int | None) -> None:
        self.app_id, self.path, self.in_lake, self.in_store = app_id, path, in_lake, in_store
        if in_store is None or (in_lake is not None and in_lake > in_store):
            what = (f"the Delta table at {path} holds batch {in_lake} of {app_id}, which PostgreSQL has no record of "
                    f"({'none recorded' if in_store is None else f'its last: {in_store}'}): PostgreSQL is behind the lake (a point-in-time restore, a failover to "
                    "a replica that was behind, or synchronous_commit off)")
        else:
            what = (f"PostgreSQL recorded batch {in_store} of {app_id} as committed to the Delta table at {path}, "
                    f"but the table's last is {in_lake}: the lake is behind PostgreSQL (restored from a copy?)")
        super().__init__(
            f"{what}. Nothing was written: extracting on would lose or repeat events. "
            "See docs/operations.md, \"The lake and PostgreSQL disagree\"."
        )


class ReadOnlyStore(EsPipelineError):
    """The DSN reaches a server or role that accepts no writes: es_pipeline's offsets cannot live there."""

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(
            f"the event store at ES_PIPELINE_PG_DSN accepts no writes ({why}): es_pipeline keeps its offsets, locks "
            "and pending batches in it. Nothing was created or written. Point ES_PIPELINE_PG_DSN at the primary, "
            "with a role that may write to the es_pipeline schema."
        )


class SourceChanged(EsPipelineError):
    """The event store is another PostgreSQL cluster than the one the offsets were recorded on."""

    def __init__(self, consumer: str, recorded: str, current: str) -> None:
        self.consumer, self.recorded, self.current = consumer, recorded, current
        super().__init__(
            f"the event store is now PostgreSQL cluster {current}, but the offsets of consumer {consumer!r} count "
            f"transaction ids of cluster {recorded}: a dump restored into a new cluster, a cut-over to a logical "
            "replica, or another server. Its transaction ids do not continue the old ones, so the watermarks mean "
            "nothing there. Nothing was written. See docs/operations.md, \"The store moved to another cluster\"."
        )


class XidSpaceWentBack(EsPipelineError):
    """A watermark lies above the horizon: the server's transaction ids went back."""

    def __init__(self, consumer: str, watermark: int, horizon: int) -> None:
        self.consumer, self.watermark, self.horizon = consumer, watermark, horizon
        super().__init__(
            f"the offsets of consumer {consumer!r} reach transaction {watermark}, above the horizon {horizon} of "
            "this server: its transaction ids went back (a restore, a logical replica, pg_resetwal), so everything "
            "new would look extracted already. Nothing was written. "
            "See docs/operations.md, \"The store moved to another cluster\"."
        )


class FutureTransactionIds(EsPipelineError):
    """The store holds rows whose `tx_id` this cluster has not assigned yet: they were written by another cluster."""

    def __init__(self, consumer: str, table: str, top: int, next_xid: int, *, fresh: bool) -> None:
        self.consumer, self.table, self.top, self.next_xid, self.fresh = consumer, table, top, next_xid, fresh
        super().__init__(
            f"{table} holds events with transaction ids up to {top}, at or above {next_xid}, the next id this "
            "PostgreSQL cluster will assign: they were written by another cluster (a dump restored into a new "
            "cluster, before or after es_pipeline met the store; a copy job or logical-replication apply that "
            "carried tx_id; an attached partition). Read by the horizon they would stay invisible until the "
            f"counter passes them. Nothing was written. Run `es-pipeline offsets rebase` (consumer {consumer!r}): "
            "it brings every such event into the lake exactly once. See docs/operations.md, "
            "\"A store with a past\"."
        )


class LakeAheadOfOffsets(LakeStoreDiverged):
    """The lake holds events at or above their slice's watermark in batches that PostgreSQL has no record of:
    `LakeStoreDiverged` found by the lake's content, whichever app id wrote them."""

    def __init__(self, path: str, consumer: str, events: int, slices: list[int], batches: list[int]) -> None:
        self.path, self.consumer, self.events, self.slices, self.batches = path, consumer, events, slices, batches
        self.app_id, self.in_lake, self.in_store = "", max(batches, default=None), None
        shown = ", ".join(str(s) for s in slices[:8]) + (" …" if len(slices) > 8 else "")
        EsPipelineError.__init__(  # the message is built from the content, not from an app id
            self,
            f"the Delta table at {path} holds {events} event(s) of slice(s) {shown} at or above the watermarks "
            f"of consumer {consumer!r}, in batch(es) {', '.join(str(b) for b in batches[:5])} that PostgreSQL has "
            "no pending or committed record of: PostgreSQL is behind the lake (a failover to a replica that was "
            "behind, a point-in-time restore, or synchronous_commit off). Extracting on would write those events "
            "twice. Nothing was written. See docs/operations.md, \"The lake and PostgreSQL disagree\"."
        )


class WatermarksLeftBehind(EsPipelineError):
    """The lake holds events above their slice's watermark in batches PostgreSQL recorded as committed, and not
    exactly the store's events there: watermarks an older release left behind, and a later pass read again."""

    def __init__(self, path: str, consumer: str, events: int, twice: int, slices: list[int], batches: list[int]) -> None:
        self.path, self.consumer, self.events, self.twice = path, consumer, events, twice
        self.slices, self.batches = slices, batches
        shown = ", ".join(str(s) for s in slices[:8]) + (" …" if len(slices) > 8 else "")
        held = f"{twice} of them twice" if twice else "not exactly the store's events there"
        super().__init__(
            f"the Delta table at {path} holds {events} event(s) of slice(s) {shown} above the watermarks of consumer "
            f"{consumer!r}, in batch(es) {', '.join(str(b) for b in batches[:5])} that PostgreSQL recorded as "
            f"committed, {held}: a pass of es_pipeline 0.1.0 that mixed Arrow and JDBC batches left those watermarks "
            "behind, and a later pass read the events again (PostgreSQL is not behind the lake). Nothing was written. "
            "Run `es-pipeline lake rebuild events`: it extracts every event of the store once, and each projection "
            "rebuilds itself. See docs/operations.md, \"Watermarks left behind\"."
        )


class LakeHoldsAnotherSource(EsPipelineError):
    """A consumer would bind to an `events` table that holds another consumer's (or another store's) events."""

    def __init__(self, path: str, consumer: str, other: str | None, *, bound_to: str | None = None) -> None:
        self.path, self.consumer, self.other, self.bound_to = path, consumer, other, bound_to
        whose = (f"the events of consumer {other!r} (another source, or the same one under another name: a "
                 "renamed schema or table)" if other else
                 f"the lake of another source (its `events` is bound to {bound_to!r}: another store's id, or "
                 "another consumer of this one)" if bound_to else
                 "events that no consumer of this store has recorded (another store's lake?)")
        super().__init__(
            f"the Delta table at {path} {'is' if bound_to and not other else 'holds'} {whose}; consumer {consumer!r} "
            "would extract its whole history into it "
            "again, every event twice. One warehouse holds one source. Nothing was written. Point "
            "ES_PIPELINE_WAREHOUSE at a lake of its own, or, if the source was renamed, see docs/operations.md, "
            "\"One source per warehouse\"."
        )


class RebaseRefused(EsPipelineError):
    """The lake holds events the store does not: the store is older than the lake, a rebase cannot be exact."""

    def __init__(self, path: str, missing: int, example: str) -> None:
        self.path, self.missing, self.example = path, missing, example
        super().__init__(
            f"refusing to rebase: the lake at {path} holds {missing} event(s) that the event store does not, e.g. "
            f"{example} (same stream, version and recorded_at): the store was restored from a state older than the "
            "lake, or events were appended again under keys the lake holds. Nothing was changed. "
            "See docs/operations.md, \"The store moved to another cluster\"."
        )


class RebuildRefused(EsPipelineError):
    """`lake rebuild` of `events` would lose events of the lake that the store does not hold."""

    def __init__(self, path: str, missing: int, example: str) -> None:
        self.path, self.missing, self.example = path, missing, example
        super().__init__(
            f"refusing to rebuild events: the lake at {path} holds {missing} event(s) that the event store does not, "
            f"e.g. {example} (same stream, version and recorded_at), and a rebuild from the store would lose them. "
            "Nothing was changed. If the store is right (they were lost with a failed primary, or the store was "
            "restored on purpose), run again with --accept-loss; else restore the store. See docs/operations.md, "
            "\"Rebuilding the lake\"."
        )


class UnknownLakeTable(EsPipelineError):
    """A table named to `lake rebuild` that the lake does not hold, or that is rebuilt with another."""

    def __init__(self, names: list[str], known: list[str]) -> None:
        self.names, self.known = names, known
        super().__init__(
            f"no table {', '.join(repr(n) for n in names)} to rebuild in this lake: name one of "
            f"{', '.join(known)} (a typed state table is rebuilt with stream_state, a typed event table with "
            "event_tables). Nothing was changed."
        )


class NoEventsYet(EsPipelineError):
    """A projection asked to update before the lake holds an `events` table to build it from."""

    def __init__(self, name: str, path: str) -> None:
        self.name, self.path = name, path
        super().__init__(
            f"{name} is built from `events`, and there is no `events` table at {path} yet: extract first "
            "(`es-pipeline extract`, or materialize `events`), then update it. Nothing was written."
        )


class LakeNotEmpty(EsPipelineError):
    """`offsets reset` would extract every event again into a table that still holds them."""

    def __init__(self, path: str, consumer: str, reason: str) -> None:
        self.path, self.consumer, self.reason = path, consumer, reason
        super().__init__(
            f"refusing to reset the offsets of consumer {consumer!r}: the Delta table at {path} {reason}, and a reset "
            "extracts every event again, so each would be there twice. Nothing was forgotten. To rebuild the lake from "
            "the store, run `es-pipeline lake rebuild` (it removes the table and resets, once the lake's events are "
            "found in the store); if the table is gone but cannot be checked from here, pass --lake-removed."
        )


class SparkSetupError(EsPipelineError):
    """Spark or its Delta jars cannot be set up (no `java`, Maven Central unreachable, jars missing)."""


class MetastoreError(EsPipelineError):
    """The catalog (the Hive metastore in PostgreSQL, lake/read/metastore.py) cannot be reached, made or synced."""


class ForeignDemoTarget(EsPipelineError):
    """A demo command was pointed at a database other than the project's local development server."""

    def __init__(self, where: str, local: str) -> None:
        super().__init__(
            f"the demo writes made-up events, and only into the project's own local server ({local}); "
            f"ES_PIPELINE_PG_DSN points at {where}. Nothing was written. Unset it for the demo "
            "(`env -u ES_PIPELINE_PG_DSN make demo`); to extract from that store, run Dagster or "
            "`es-pipeline extract` instead."
        )


class LocalServerError(EsPipelineError):
    """The local development PostgreSQL server cannot be found, started or stopped."""


class StoreNotMigrated(EsPipelineError):
    """The event store lacks a table or function es_pipeline's migrations make."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"the event store is not migrated for es_pipeline ({detail}): run `es-pipeline db migrate` "
            "(a framework's store: `es-pipeline source adopt`) as a role that may create schemas, then retry. "
            "Nothing was written."
        )


class PrivilegeMissing(EsPipelineError):
    """The role in ES_PIPELINE_PG_DSN lacks a privilege es_pipeline needs."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"the database role lacks a privilege ({detail}): grant it, or use the role the DBA made for "
            "es_pipeline. Nothing was committed."
        )


class WarehouseUnwritable(EsPipelineError):
    """The warehouse folder cannot be created or written."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"the warehouse cannot be written ({detail}): point ES_PIPELINE_WAREHOUSE at a folder this user "
            "may create and write. Nothing was committed."
        )


class SparkConnectRefused(EsPipelineError):
    """The Spark Connect server wants a token this process does not send, or another one."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"the Spark Connect server refused this client ({detail}): set SPARK_CONNECT_AUTHENTICATE_TOKEN to the "
            "server's token (the local one, `es-pipeline spark serve`'s, is in .secrets/spark-connect-token), "
            "and reach a local server as sc://localhost:<port>. Nothing was written."
        )


def explain(exc: BaseException) -> EsPipelineError | None:
    """The one-line error for a database, Delta or filesystem failure met at a boundary (the command
    line, an asset), or None when it is not one of those: then the traceback is the useful answer."""
    import psycopg  # here: `errors` is a leaf that settings import, and most of them never need the driver

    if isinstance(exc, EsPipelineError):
        return exc
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, psycopg.errors.UndefinedTable | psycopg.errors.UndefinedFunction
                  | psycopg.errors.InvalidSchemaName):
        return StoreNotMigrated(first)
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return PrivilegeMissing(first)
    if isinstance(exc, PermissionError | NotADirectoryError | FileNotFoundError | IsADirectoryError):
        return WarehouseUnwritable(first)
    if type(exc).__name__ == "SparkConnectGrpcException" and "authentication token" in first:
        return SparkConnectRefused(first)
    from deltalake.exceptions import DeltaError

    if isinstance(exc, DeltaError) and any(w in first for w in ("directory", "ermission", "ead-only file system")):
        return WarehouseUnwritable(first)
    return None


class SourceNotServable(EsPipelineError):
    """A table that a source mapping cannot read as it stands; nothing was changed."""

    def __init__(self, source: str, problems: list[str], todo: str) -> None:
        self.source, self.problems, self.todo = source, problems, todo
        super().__init__(f"cannot serve {source}: " + "; ".join(problems) + f". Nothing was changed. {todo}")


class UnknownTenant(EsPipelineError):
    """An append for a tenant that has no partition in a store partitioned by tenant; nothing was written."""

    def __init__(self, tenant: str, table: str) -> None:
        self.tenant, self.table = tenant, table
        super().__init__(
            f"tenant {tenant!r} has no partition in {table}: nothing was written. Create it with "
            f"`es-pipeline tenant add {tenant}` (an erased tenant stays erased until it is added again)."
        )


class TenantRefused(EsPipelineError):
    """`tenant add` or `tenant erase` refused before changing anything."""

    def __init__(self, action: str, tenant: str, reason: str, todo: str) -> None:
        self.action, self.tenant, self.reason, self.todo = action, tenant, reason, todo
        super().__init__(f"cannot {action} tenant {tenant!r}: {reason}. Nothing was changed. {todo}")


class ErasureIncomplete(EsPipelineError, Retryable):
    """Files still hold an erased tenant's rows after the purge; the erasure is not recorded as finished."""

    def __init__(self, tenant: str, files: dict[str, list[str]]) -> None:
        self.tenant, self.files = tenant, files
        shown = "; ".join(f"{table}: {', '.join(names[:3])}" + (" …" if len(names) > 3 else "")
                          for table, names in files.items())
        super().__init__(
            f"tenant {tenant!r} is out of the store and the tables, but files still hold its rows ({shown}). "
            f"The erasure is not recorded as finished: run `es-pipeline tenant erase {tenant} --yes` again, which "
            "deletes and purges again; if the files remain, remove them by hand (no table version references them)."
        )


class DomainError(EsPipelineError):
    """A team's domain (ES_PIPELINE_DOMAIN: its reducers and the rest) cannot be loaded or does not add up."""

    def __init__(self, reason: str, fix: str) -> None:
        self.reason, self.fix = reason, fix
        super().__init__(f"{reason}. {fix}")


class TypedStateMismatch(EsPipelineError):
    """A state the reducer returned does not fit the fields its reducer declared (`state=`)."""

    def __init__(self, stream_type: str, stream_id: str, field: str, value: object, reason: str) -> None:
        self.stream_type, self.stream_id, self.field, self.value = stream_type, stream_id, field, value
        super().__init__(
            f"the state of stream {stream_id!r} ({stream_type}) does not fit its declared fields: field {field!r} "
            f"holds {value!r} ({reason}). stream_state is up to date; its typed table waits. Fix the reducer (and "
            "bump its revision) or the declaration, then re-run."
        )


class QueryFailed(EsPipelineError):
    """An analyst's query that its engine refused (`es-pipeline sql`): the engine's own words, and what to try."""

    def __init__(self, engine: str, reason: str, tables: list[str], warehouse: object = None) -> None:
        self.engine, self.reason, self.tables = engine, reason, tables
        known = ", ".join(tables[:12]) + (", …" if len(tables) > 12 else "") if tables else "none yet"
        if warehouse is not None:
            known += f" (in {warehouse}; `es-pipeline config` says where that came from)"
        other = "--engine spark for Spark SQL (time travel, DESCRIBE HISTORY)" if engine == "duckdb" else \
            "the default engine (DuckDB)"
        super().__init__(f"{engine} could not run the query: {reason}. The lake's tables: {known}. "
                         f"Fix the query, or try {other}.")
