"""Per-slice watermarks, slice locks, pending batches and sink bindings in Postgres. No Spark here.

Every statement on es_pipeline's own tables is in this module (the sensor's probe, one statement
over the events and the offsets together, is in `probe.py`). docs/architecture.md explains them:

- `es_pipeline.offsets`: for a consumer and a slice, all events with `tx_id < watermark` are in the sink.
- Advisory locks (consumer, slice): one place per slice; a second run fails fast naming the holder.
- `es_pipeline.pending_batches`: a batch is recorded before its sink write and deleted together with
  the offset commit, so a crash in between leaves a record that the next run replays exactly.
- `es_pipeline.sinks`: the Delta table a consumer's watermarks describe.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from es_pipeline.errors import (
    FutureTransactionIds,
    LakeHoldsAnotherSource,
    LakeNotEmpty,
    LakeOffsetsMismatch,
    LakeStoreDiverged,
    ReadOnlyStore,
    SinkChanged,
    SliceLocked,
    SliceLockLost,
    SourceChanged,
    StoreNotMigrated,
    XidSpaceWentBack,
)
from es_pipeline.extraction.slices import NUM_SLICES
from es_pipeline.lake.delta import tables
from es_pipeline.source.mapping import Source, as_source, native
from es_pipeline.store.conninfo import connect, int_array, lock_transaction, no_timeouts_sql

# The consumer whose sink is the Delta `events` table, for the native store in `es` (`Source.consumer` names
# every source's: its offsets, sinks, batches and lock keys are its own).
EVENTS_CONSUMER = native().consumer
# A commit moves the watermarks of the slices its batch brought rows of; every slice's at least this often
# (`OffsetSession.commit`), so that each slice's watermark, its lag and `status` stay near the horizon.
FULL_ADVANCE_SECONDS = 60.0


def events_consumer(schema: str) -> str:
    """The consumer that extracts the native store in `schema` (`Source.consumer`)."""
    return native(schema).consumer


def lock_namespace(consumer: str) -> int:
    """The first key of the two-int advisory lock: a stable int4 per consumer."""
    return zlib.crc32(f"es_pipeline:{consumer}".encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class Batch:
    """Events of `slices` with `from_watermarks[i] <= tx_id < upper` (per slice). Deterministic."""

    consumer: str
    app_id: str
    slices: tuple[int, ...]
    from_watermarks: tuple[int, ...]
    upper: int
    batch_id: int | None = None

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """(slice, lower bound) for the slices that have anything below `upper`."""
        return [(s, w) for s, w in zip(self.slices, self.from_watermarks, strict=True) if w < self.upper]


class OffsetSession:
    """The connections of one run: one that holds its slice locks, one that commits its offsets.

    The locks are transaction-level advisory locks held by a transaction that stays open for the run
    (`_lock_holder`): a transaction keeps its server connection even behind a transaction-pooling
    PgBouncer, where session-level locks would sit on whatever backend ran the statement. It holds no
    transaction id and no snapshot between statements, so it holds back neither the horizon nor vacuum.
    Every statement that records a batch or advances watermarks first checks, in its own transaction,
    that the holder still holds every slice's lock (`_verify_locks`).
    """

    def __init__(
        self, dsn: str, consumer: str, *, run_id: str, label: str, source: Source | str | None = None
    ) -> None:
        self.dsn = dsn
        self.consumer = consumer
        self.source = as_source(source) if source is not None else None  # what `check_source` reads
        self.run_id = run_id
        self.label = label
        self.namespace = lock_namespace(consumer)
        self.conn: psycopg.Connection = connect(dsn, autocommit=True, application_name=self._name())
        # An offset commit must survive a crash of the server once it is acknowledged, and no timeout meant for
        # applications may cut a run's statements, whatever the role's defaults.
        self.conn.execute("SET synchronous_commit = on")
        self.conn.execute(no_timeouts_sql(local=False))
        self._holder_conn: psycopg.Connection | None = None
        self.holder_pid: int | None = None
        self.locked: set[int] = set()
        self.sink_id: str | None = None  # the Delta table these offsets were checked against (bind_sink)
        self.cluster: str | None = None  # the source cluster's identity, once checked (check_source)
        self.rebased_below: int | None = None  # set by `offsets rebase`: below it, batches leave out what the lake holds
        self.rebase_batch: int | None = None  # set with it: the batch id a slice's first run after it writes its rows as
        self._advanced_all = -FULL_ADVANCE_SECONDS  # when `commit` last moved every slice of a batch (monotonic)

    def _name(self) -> str:
        return f"es_pipeline {self.label} run {self.run_id}"[:63]

    def close(self) -> None:
        try:
            if self._holder_conn is not None and not self._holder_conn.closed:
                self._holder_conn.rollback()  # ends the transaction: every slice lock is released
        except psycopg.OperationalError:
            pass  # the holder's connection is gone already, and with it its locks
        finally:
            self.locked.clear()
            if self._holder_conn is not None:
                self._holder_conn.close()
            self.conn.close()

    def __enter__(self) -> OffsetSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- locks -------------------------------------------------------------------------------------

    def _lock_holder(self) -> psycopg.Connection:
        if self._holder_conn is None:
            holder = lock_transaction(self.dsn, application_name=self._name())
            row = holder.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            self._holder_conn, self.holder_pid = holder, int(row[0])
        return self._holder_conn

    def lock(self, slices: Sequence[int], range_key: str) -> None:
        """Take the advisory lock of every slice, or none of them and raise `SliceLocked`."""
        wanted = [s for s in slices if s not in self.locked]
        if not wanted:
            return
        holder = self._lock_holder()
        holder.execute("SAVEPOINT es_pipeline_lock")  # rolling back to it releases the locks it took
        rows = holder.execute(
            "SELECT s, pg_try_advisory_xact_lock(%s, s) FROM unnest(%s::int[]) AS s", (self.namespace, int_array(wanted))
        ).fetchall()
        got = [s for s, ok in rows if ok]
        missed = sorted(s for s, ok in rows if not ok)
        if missed:
            holder.execute("ROLLBACK TO SAVEPOINT es_pipeline_lock")
            raise SliceLocked(range_key, missed, self._holder(missed[0]))
        holder.execute("RELEASE SAVEPOINT es_pipeline_lock")
        self.locked.update(got)

    def verify_locks(self, slices: Sequence[int]) -> None:
        """`SliceLockLost` unless this run still holds every slice's lock (for work outside a commit)."""
        with self.conn.transaction():
            self._verify_locks(slices)

    def clear_rebase_mark_if_passed(self) -> None:
        """Forget the rebase mark once every slice's watermark has passed it and every first run is done."""
        self.conn.execute(
            "UPDATE es_pipeline.sinks s SET rebased_below = NULL, rebase_batch = NULL "
            "WHERE consumer = %(c)s AND rebased_below IS NOT NULL "
            "AND NOT EXISTS (SELECT 1 FROM es_pipeline.rebase_catchup WHERE consumer = %(c)s) "
            "AND (SELECT count(*) FROM es_pipeline.offsets o WHERE o.consumer = %(c)s "
            "     AND o.watermark >= s.rebased_below) = %(n)s",
            {"c": self.consumer, "n": NUM_SLICES},
        )

    def _verify_locks(self, slices: Sequence[int]) -> None:
        """In the caller's transaction: raise `SliceLockLost` unless the holder still has every slice's lock."""
        wanted = sorted(set(slices))
        row = self.conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s AND classid = %s::oid "
            "AND objid = ANY(%s::oid[]) AND objsubid = 2 AND granted",
            (self.holder_pid or 0, self.namespace, int_array(wanted)),
        ).fetchone()
        if self.holder_pid is None or row is None or int(row[0]) != len(wanted):
            raise SliceLockLost(self.label, self.holder_pid)

    def _holder(self, slice_: int) -> str:
        row = self.conn.execute(
            "SELECT a.application_name, a.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objid = %s AND l.objsubid = 2 AND l.granted",
            (self.namespace, slice_),
        ).fetchone()
        if row is None:
            return "another run (it has just finished; retry)"
        name, pid = row
        return f"'{name}' (backend pid {pid})" if name else f"backend pid {pid}"

    # -- the sink the watermarks belong to -----------------------------------------------------------

    def bind_sink(self, table_id: str, path: str, *, created_now: bool = False) -> None:
        """Check that the watermarks of this consumer describe the Delta table `table_id`, or record it.

        Raises `LakeOffsetsMismatch` when some slice is already extracted but not into this table:
        another table is recorded, or none is (offsets older than this record) and this run has just
        created the table. Continuing would leave the events below those watermarks out of it. With no
        slice extracted (a fresh start, or after `offsets reset`) the table is simply recorded. The
        source cluster (`check_source`) is recorded with it where none is yet.
        """
        try:
            with self.conn.transaction():
                self._bind(table_id, path, created_now)
                row = self.conn.execute(
                    "UPDATE es_pipeline.sinks SET source_cluster = coalesce(source_cluster, %s) WHERE consumer = %s "
                    "RETURNING rebased_below::text::bigint, rebase_batch",
                    (self.cluster, self.consumer),
                ).fetchone()
        except psycopg.errors.UndefinedColumn as exc:  # a store migrated by an older release
            raise StoreNotMigrated(f"es_pipeline.sinks lacks a column of migration 11: {exc}") from None
        self.rebased_below = None if row is None or row[0] is None else int(row[0])
        self.rebase_batch = None if row is None or row[1] is None else int(row[1])
        self.sink_id = table_id

    def _bind(self, table_id: str, path: str, created_now: bool) -> None:
        row = self.conn.execute(
            "INSERT INTO es_pipeline.sinks (consumer, table_id, path) VALUES (%s, %s, %s) "
            "ON CONFLICT (consumer) DO UPDATE SET consumer = excluded.consumer "
            "RETURNING table_id, path, xmax = 0 AS inserted",
            (self.consumer, table_id, path),
        ).fetchone()
        assert row is not None
        recorded_id, recorded_path, inserted = row
        if inserted and not created_now:
            self._refuse_another_source(table_id, path)
        if recorded_id == table_id and not (inserted and created_now):
            if recorded_path != path:  # the same table, moved: remember where it is now
                self.conn.execute("UPDATE es_pipeline.sinks SET path = %s WHERE consumer = %s", (path, self.consumer))
            return
        extracted = [s for (s,) in self.conn.execute(
            "SELECT slice FROM es_pipeline.offsets WHERE consumer = %s AND watermark > '0'::xid8 ORDER BY slice",
            (self.consumer,),
        )]
        if extracted:
            recorded = None if inserted else (recorded_id, recorded_path)
            raise LakeOffsetsMismatch(path, self.consumer, extracted, recorded=recorded)
        if not inserted:
            self.conn.execute(
                "UPDATE es_pipeline.sinks SET table_id = %s, path = %s, recorded_at = now() WHERE consumer = %s",
                (table_id, path, self.consumer),
            )

    def _refuse_another_source(self, table_id: str, path: str) -> None:
        """`LakeHoldsAnotherSource` when the table this consumer is binding to for the first time holds events:
        another consumer's (bound to it), or, with no consumer bound and nothing extracted by this one, another
        store's. (A consumer with watermarks and no record is one from before the record: its lake is adopted.)"""
        other = self.conn.execute(
            "SELECT consumer FROM es_pipeline.sinks WHERE table_id = %s AND consumer <> %s ORDER BY consumer LIMIT 1",
            (table_id, self.consumer),
        ).fetchone()
        if other is not None:
            raise LakeHoldsAnotherSource(path, self.consumer, str(other[0]))
        extracted = self.conn.execute(
            "SELECT 1 FROM es_pipeline.offsets WHERE consumer = %s AND watermark > '0'::xid8 LIMIT 1", (self.consumer,),
        ).fetchone()
        if extracted is None and tables.holds_rows(path):
            raise LakeHoldsAnotherSource(path, self.consumer, None)

    def source_tag(self) -> str | None:
        """`<store id>/<consumer>`: what this consumer binds a lake to (tables.SOURCE_PROPERTY); None in a store
        whose identity row is gone (then only the sink's checks guard the lake)."""
        try:
            row = self.conn.execute("SELECT store_id::text FROM es_pipeline.store_identity").fetchone()
        except psycopg.errors.UndefinedTable as exc:  # a store migrated by an older release
            raise StoreNotMigrated(f"es_pipeline.store_identity is missing (migration 12): {exc}") from None
        return None if row is None else f"{row[0]}/{self.consumer}"

    def check_source(self) -> None:
        """Refuse a store whose transaction ids are not the ones the offsets count (see `check_source`)."""
        if self.source is None:
            raise ValueError("this session was opened without its source: it cannot check the store")
        self.cluster = check_source(self.conn, self.consumer, self.source)

    # -- the lake's record of batches against ours ---------------------------------------------------

    def check_lake_commits(self, app_id: str, in_lake: int | None, path: str) -> None:
        """Compare the Delta table's last batch of `app_id` (its txn version) with the one recorded here.

        They agree when the table's is the recorded one, or a batch still pending (written to Delta, then
        a crash before its watermarks advanced). Anything else means PostgreSQL or the lake went back in
        time, and `LakeStoreDiverged` stops the run before it writes. Where nothing is recorded for the app id
        (a store migrated from a release without this record, or after `offsets rebase`, which forgets it) the
        table's batch is adopted: the caller has checked first that the lake holds no event above the watermarks
        outside a pending batch (`Extractor`), which a batch whose offsets were lost would (a sequence value alone
        proves nothing: PostgreSQL WAL-logs its sequences 32 values ahead, so a failover keeps ids it lost).
        """
        row = self.conn.execute(
            "SELECT (SELECT batch_id FROM es_pipeline.lake_commits WHERE app_id = %(a)s), "
            " (SELECT array_agg(batch_id) FROM es_pipeline.pending_batches WHERE app_id = %(a)s)",
            {"a": app_id},
        ).fetchone()
        assert row is not None
        recorded, pending = row[0], set(row[1] or ())
        if in_lake == recorded or in_lake in pending:
            return
        if recorded is None and in_lake is not None:
            # The sequence may be behind the lake's batch ids (a rebase, a restore, a failover): move it past
            # them, so that no new batch can take an id Delta would skip as done.
            self.conn.execute("SELECT setval('es_pipeline.pending_batches_batch_id_seq', greatest(%s, "
                              "(SELECT last_value FROM es_pipeline.pending_batches_batch_id_seq)))", (in_lake,))
            self._record_lake_commit(app_id, in_lake)
            return
        raise LakeStoreDiverged(app_id, path, in_lake, recorded)

    def _record_lake_commit(self, app_id: str, batch_id: int) -> None:
        self.conn.execute(
            "INSERT INTO es_pipeline.lake_commits AS c (app_id, consumer, batch_id) VALUES (%s, %s, %s) "
            "ON CONFLICT (app_id) DO UPDATE SET batch_id = excluded.batch_id, committed_at = now() "
            "WHERE c.batch_id < excluded.batch_id",
            (app_id, self.consumer, batch_id),
        )

    def lake_commit_apps(self) -> list[str]:
        """Every Delta app id this consumer has recorded a committed batch of (every range layout, every run kind)."""
        return [str(a) for (a,) in self.conn.execute(
            "SELECT app_id FROM es_pipeline.lake_commits WHERE consumer = %s ORDER BY app_id", (self.consumer,))]

    def recorded_lake_commits(self) -> dict[str, int]:
        """The newest batch recorded as committed to the lake, per Delta app id of this consumer."""
        return {str(a): int(b) for a, b in self.conn.execute(
            "SELECT app_id, batch_id FROM es_pipeline.lake_commits WHERE consumer = %s", (self.consumer,))}

    def move_up(self, bounds: dict[int, tuple[int, int]]) -> None:
        """Move each slice's watermark from `lo` up to `hi` for `bounds[slice] = (lo, hi)`, in one transaction, under
        our locks (a slice never extracted has no row yet, watermark 0). A watermark never moves down. The caller has
        shown that the lake holds each event of the store in [lo, hi) once (`Extractor`'s check of the lake)."""
        with self.conn.transaction():
            self.conn.execute("SET LOCAL synchronous_commit = on")  # per transaction: also behind a pooler
            self._verify_locks(list(bounds))
            self.conn.execute(
                "INSERT INTO es_pipeline.offsets AS o (consumer, slice, watermark, updated_at, run_id) "
                "SELECT %s, m.slice, m.hi, now(), %s FROM unnest(%s::smallint[], %s::xid8[]) AS m(slice, hi) "
                "ON CONFLICT (consumer, slice) DO UPDATE SET watermark = excluded.watermark, "
                "updated_at = excluded.updated_at, run_id = excluded.run_id WHERE o.watermark < excluded.watermark",
                (self.consumer, self.run_id, int_array(bounds), int_array(hi for _, hi in bounds.values())),
            )

    def catchup_slices(self, slices: Sequence[int]) -> list[int]:
        """The slices of these whose first run since a rebase is still to come (see extraction/rebase.py)."""
        return [int(s) for (s,) in self.conn.execute(
            "SELECT slice FROM es_pipeline.rebase_catchup WHERE consumer = %s AND slice = ANY(%s::smallint[]) "
            "ORDER BY slice", (self.consumer, int_array(slices)))]

    def rows_batch_id(self, batch: Batch) -> int:
        """The `batch_id` a batch's rows carry: its own, but in a slice's first run after a rebase the rebase's
        (`mark_rebased`), so that the restored tail and what the new cluster committed meanwhile sort together, by
        position, after everything extracted before the move and before everything after (docs/domain.md)."""
        assert batch.batch_id is not None
        if self.rebase_batch is None or not self.catchup_slices(batch.slices):
            return batch.batch_id
        return self.rebase_batch

    def catchup_done(self, slices: Sequence[int]) -> None:
        self.conn.execute("DELETE FROM es_pipeline.rebase_catchup WHERE consumer = %s AND slice = ANY(%s::smallint[])",
                          (self.consumer, int_array(slices)))

    def forget_pending(self, batch: Batch) -> None:
        """Drop a pending record whose batch must not be replayed (Delta refused it as already committed)."""
        self.conn.execute("DELETE FROM es_pipeline.pending_batches WHERE batch_id = %s", (batch.batch_id,))

    # -- horizon and watermarks --------------------------------------------------------------------

    def horizon(self) -> int:
        """H: every transaction below it has ended, and none can start below it."""
        row = self.conn.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())").fetchone()
        assert row is not None
        return int(row[0])

    def watermarks(self, slices: Sequence[int]) -> dict[int, int]:
        return read_watermarks(self.conn, self.consumer, slices)

    def commit(self, batch: Batch, *, in_lake: bool = True, moved: Collection[int] | None = None) -> None:
        """Advance the watermarks of the batch's slices to its upper bound and drop its pending record.

        `moved`: the slices the batch brought rows of. Only theirs move then, and every slice at most every
        FULL_ADVANCE_SECONDS: a slice without rows in the batch had no committed event in [its watermark, upper)
        (below the horizon every transaction has ended), so leaving its watermark lower is exact, and the next read
        finds nothing more there. A tailing pass over 1024 slices thus writes the few dozen rows that moved instead
        of 1024 every 2.5 s (docs/decisions/0045).

        If the run checked its sink, the binding must still hold (FOR SHARE keeps it until the commit):
        another range's run may have bound the consumer to another table meanwhile. Then nothing is
        committed and the batch stays pending, to be replayed into the table now bound.
        """
        with self.conn.transaction():
            self.conn.execute("SET LOCAL synchronous_commit = on")  # per transaction: also behind a pooler
            self._verify_locks(batch.slices)
            if self.sink_id is not None and self.conn.execute(
                "SELECT 1 FROM es_pipeline.sinks WHERE consumer = %s AND table_id = %s FOR SHARE",
                (self.consumer, self.sink_id),
            ).fetchone() is None:
                raise SinkChanged(self.consumer, self.sink_id)
            slices = list(batch.slices)
            if moved is not None and time.monotonic() - self._advanced_all < FULL_ADVANCE_SECONDS:
                slices = [s for s in batch.slices if s in moved]
            else:
                self._advanced_all = time.monotonic()
            if slices:
                self.conn.execute(
                    "INSERT INTO es_pipeline.offsets AS o (consumer, slice, watermark, updated_at, run_id) "
                    "SELECT %s, s, %s::text::xid8, now(), %s FROM unnest(%s::smallint[]) AS s "
                    "ON CONFLICT (consumer, slice) DO UPDATE SET watermark = excluded.watermark, "
                    "updated_at = excluded.updated_at, run_id = excluded.run_id "
                    "WHERE o.watermark < excluded.watermark",
                    (self.consumer, str(batch.upper), self.run_id, int_array(slices)),
                )
            if batch.batch_id is not None:
                self.conn.execute("DELETE FROM es_pipeline.pending_batches WHERE batch_id = %s", (batch.batch_id,))
                if in_lake:  # a batch left with no rows (all in the lake already) made no Delta commit
                    self._record_lake_commit(batch.app_id, batch.batch_id)

    # -- pending batches ---------------------------------------------------------------------------

    def record_pending(self, batch: Batch) -> Batch:
        with self.conn.transaction():
            self.conn.execute("SET LOCAL synchronous_commit = on")  # per transaction: also behind a pooler
            self._verify_locks(batch.slices)
            row = self._insert_pending(batch)
        assert row is not None
        return Batch(batch.consumer, batch.app_id, batch.slices, batch.from_watermarks, batch.upper, int(row[0]))

    def _insert_pending(self, batch: Batch) -> tuple[int] | None:
        return self.conn.execute(
            "INSERT INTO es_pipeline.pending_batches (consumer, app_id, slices, from_watermarks, upper_bound, run_id) "
            "VALUES (%s, %s, %s::smallint[], %s::xid8[], %s::text::xid8, %s) RETURNING batch_id",
            (batch.consumer, batch.app_id, int_array(batch.slices), int_array(batch.from_watermarks),
             str(batch.upper), self.run_id),
        ).fetchone()

    def pending_overlapping(self, slices: Sequence[int]) -> list[Batch]:
        rows = self.conn.execute(
            "SELECT batch_id, app_id, slices, from_watermarks::text[], upper_bound FROM es_pipeline.pending_batches "
            "WHERE consumer = %s AND slices && %s::smallint[] ORDER BY batch_id",
            (self.consumer, list(slices)),
        ).fetchall()
        return [
            Batch(self.consumer, app_id, tuple(sl), tuple(int(w) for w in ws), int(upper), int(bid))
            for bid, app_id, sl, ws, upper in rows
        ]


_SOURCE = """
SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint,
       greatest((SELECT max(watermark::text::bigint) FROM es_pipeline.offsets WHERE consumer = %(c)s),
                (SELECT max(upper_bound::text::bigint) FROM es_pipeline.pending_batches WHERE consumer = %(c)s)),
       (SELECT source_cluster FROM es_pipeline.sinks WHERE consumer = %(c)s),
       (SELECT system_identifier::text FROM pg_control_system()),
       pg_is_in_recovery(), current_setting('transaction_read_only') = 'on',
       pg_snapshot_xmax(pg_current_snapshot())::text::bigint,
       (SELECT rebased_below::text::bigint FROM es_pipeline.sinks WHERE consumer = %(c)s),
       -- The highest tx_id stored: one descent of the index on the transaction order (the probe's).
       (SELECT e.tx_id::text::bigint FROM {events} e ORDER BY e.tx_id::text::bigint DESC LIMIT 1)
"""


def check_source(conn: psycopg.Connection, consumer: str, source: Source | str) -> str:
    """The store's cluster identity, after checking that the offsets of `consumer` count its transaction ids.

    Raises `ReadOnlyStore` on a hot standby or a read-only role, `SourceChanged` when the offsets were recorded on
    another cluster (a dump restored elsewhere, a logical replica), `XidSpaceWentBack` when a watermark or pending
    batch lies above the horizon (the transaction ids went back), and `FutureTransactionIds` when `source` holds a
    row at or above the next transaction id this cluster will assign and at or above any rebase mark: rows another
    cluster wrote, which the horizon would hide until the counter passes them. Each would make new or restored
    events look extracted already, or never extractable: loss.
    """
    source = as_source(source)
    row = conn.execute(sql.SQL(_SOURCE).format(events=source.relation_sql()), {"c": consumer}).fetchone()
    assert row is not None
    horizon, top, recorded, current, standby, read_only = int(row[0]), row[1], row[2], str(row[3]), row[4], row[5]
    next_xid, mark, highest = int(row[6]), row[7], row[8]
    if standby or read_only:
        raise ReadOnlyStore("a hot standby" if standby else "the role's transactions are read-only")
    if recorded is not None and recorded != current:
        raise SourceChanged(consumer, recorded, current)
    if top is not None and int(top) > horizon:
        raise XidSpaceWentBack(consumer, int(top), horizon)
    if highest is not None and int(highest) >= max(next_xid, int(mark or 0)):
        raise FutureTransactionIds(consumer, source.label, int(highest), next_xid, fresh=not top)
    return current


def read_watermarks(conn: psycopg.Connection, consumer: str, slices: Sequence[int]) -> dict[int, int]:
    """Watermark per slice; a slice never extracted has watermark 0 (nothing is below it)."""
    rows = conn.execute(
        "SELECT slice, watermark FROM es_pipeline.offsets WHERE consumer = %s AND slice = ANY(%s::smallint[])",
        (consumer, int_array(slices)),
    ).fetchall()
    found = {int(s): int(w) for s, w in rows}
    return {s: found.get(s, 0) for s in slices}


def mark_rebased(
    conn: psycopg.Connection, source: Source | str, consumer: str, lake_batches: int = 0
) -> tuple[str, int, int]:
    """The bookkeeping of `offsets rebase` (see `extraction.rebase`), in one transaction: forget the
    watermarks, pending batches and lake commits of `consumer`; record the store's cluster and the mark
    below which batches leave out what the lake holds: past every transaction id in the store and the
    horizon; and take the batch id the first runs after it write their rows as, past `lake_batches` (the highest
    batch id in the lake: a restored sequence may be behind it). Returns (cluster, mark, watermarks forgotten)."""
    with conn.transaction():
        row = conn.execute(
            sql.SQL(
                "SELECT (SELECT system_identifier::text FROM pg_control_system()), greatest("
                "pg_snapshot_xmin(pg_current_snapshot())::text::bigint, "
                "(SELECT max(e.tx_id::text::bigint) + 1 FROM {} e))"
            ).format(as_source(source).relation_sql())
        ).fetchone()
        assert row is not None
        cluster, below = str(row[0]), int(row[1])
        n = conn.execute("DELETE FROM es_pipeline.offsets WHERE consumer = %s", (consumer,)).rowcount
        conn.execute("DELETE FROM es_pipeline.pending_batches WHERE consumer = %s", (consumer,))
        conn.execute("DELETE FROM es_pipeline.lake_commits WHERE consumer = %s", (consumer,))
        # A consumer that never bound a table (rows restored before its first run) gets its record now, bound to
        # no table (''): its first run binds the lake as it would a fresh start's, keeping the mark.
        conn.execute("SELECT setval('es_pipeline.pending_batches_batch_id_seq', greatest(%s, "
                     "(SELECT last_value FROM es_pipeline.pending_batches_batch_id_seq)))", (max(lake_batches, 1),))
        conn.execute(
            "INSERT INTO es_pipeline.sinks (consumer, table_id, path, source_cluster, rebased_below, rebase_batch) "
            "VALUES (%s, '', '', %s, %s::text::xid8, nextval('es_pipeline.pending_batches_batch_id_seq')) "
            "ON CONFLICT (consumer) DO UPDATE SET source_cluster = excluded.source_cluster, "
            "rebased_below = excluded.rebased_below, rebase_batch = excluded.rebase_batch",
            (consumer, cluster, str(below)),
        )
        conn.execute(
            "INSERT INTO es_pipeline.rebase_catchup (consumer, slice) SELECT %s, s FROM generate_series(0, %s) AS s "
            "ON CONFLICT DO NOTHING", (consumer, NUM_SLICES - 1),
        )
    return cluster, below, n


def reset_consumer(dsn: str, consumer: str, events_path: str, *, lake_removed: bool = False) -> int:
    """`es-pipeline offsets reset`: forget the watermarks, unless the table the next runs write to still
    holds rows (they would all be extracted again); refused too while a run is extracting."""
    try:
        if tables.holds_rows(events_path):
            raise LakeNotEmpty(events_path, consumer, "still holds events")
    except OSError as exc:
        if not lake_removed:
            raise LakeNotEmpty(events_path, consumer, f"cannot be checked ({type(exc).__name__})") from None
    return reset_when_idle(dsn, consumer)


def reset_when_idle(dsn: str, consumer: str) -> int:
    """`reset`, holding every slice lock of `consumer`: refused (SliceLocked) while a run is extracting."""
    with OffsetSession(dsn, consumer, run_id="offsets-reset", label="offsets reset") as session:
        session.lock(range(NUM_SLICES), "all slices")
        return reset(session.conn, consumer)


def reset(conn: psycopg.Connection, consumer: str) -> int:
    """Forget every watermark, pending batch, recorded sink and lake commit of `consumer`: the next runs start
    from the beginning."""
    with conn.transaction():
        n = conn.execute("DELETE FROM es_pipeline.offsets WHERE consumer = %s", (consumer,)).rowcount
        conn.execute("DELETE FROM es_pipeline.pending_batches WHERE consumer = %s", (consumer,))
        conn.execute("DELETE FROM es_pipeline.sinks WHERE consumer = %s", (consumer,))
        conn.execute("DELETE FROM es_pipeline.lake_commits WHERE consumer = %s", (consumer,))
        conn.execute("DELETE FROM es_pipeline.rebase_catchup WHERE consumer = %s", (consumer,))
    return n


# -- what the lake should hold, for the checks -----------------------------------------------------


def batch_frontier(dsn: str | psycopg.Connection, consumer: str) -> int:
    """The lowest batch id that may still reach the lake: the lowest one `consumer` holds pending, else the next
    one the sequence gives (a batch taken later has a higher id), or, while some slice's first run after a rebase
    is still to come, the rebase's (its rows carry that id: `OffsetSession.rows_batch_id`). Every batch below it
    that ever reaches the lake is there already in any version of the lake read after this (lake/cross_stream.py
    folds up to it)."""
    query = ("SELECT least((SELECT min(batch_id) FROM es_pipeline.pending_batches WHERE consumer = %(c)s), "
             "(SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END "
             "FROM es_pipeline.pending_batches_batch_id_seq), "
             "(SELECT rebase_batch FROM es_pipeline.sinks WHERE consumer = %(c)s "
             " AND EXISTS (SELECT 1 FROM es_pipeline.rebase_catchup WHERE consumer = %(c)s)))")
    if isinstance(dsn, psycopg.Connection):
        row = dsn.execute(query, {"c": consumer}).fetchone()
    else:  # a connect timeout and keepalives; unreachable: `DatabaseUnreachable`, one line
        with connect(dsn, autocommit=True, application_name="es_pipeline frontier") as conn:
            row = conn.execute(query, {"c": consumer}).fetchone()
    assert row is not None and row[0] is not None
    return int(row[0])


def pending_batch_ids(conn: psycopg.Connection, consumer: str) -> list[int]:
    """Batches written (or being written) whose watermarks have not advanced yet."""
    return [int(r[0]) for r in conn.execute(
        "SELECT batch_id FROM es_pipeline.pending_batches WHERE consumer = %s ORDER BY batch_id", (consumer,))]


def rebased_below(conn: psycopg.Connection, consumer: str) -> int | None:
    """The mark `offsets rebase` left for `consumer` (see extraction/rebase.py), if any."""
    row = conn.execute("SELECT rebased_below::text::bigint FROM es_pipeline.sinks WHERE consumer = %s",
                       (consumer,)).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def rebase_batch(conn: psycopg.Connection, consumer: str) -> int | None:
    """The batch id the first runs after `consumer`'s rebase write their rows as (`OffsetSession.rows_batch_id`)."""
    row = conn.execute("SELECT rebase_batch FROM es_pipeline.sinks WHERE consumer = %s", (consumer,)).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def events_from_another_cluster(conn: psycopg.Connection, source: Source | str, consumer: str) -> int:
    """How many events of the store lie at or above both the next transaction id this cluster will assign and the
    consumer's rebase mark: written by another cluster, not yet rebased (`check_source`). An index range scan of
    those rows only."""
    row = conn.execute(
        sql.SQL(
            "SELECT count(*) FROM {} e WHERE e.tx_id::text::bigint >= greatest("
            "pg_snapshot_xmax(pg_current_snapshot())::text::bigint, "
            "(SELECT rebased_below::text::bigint FROM es_pipeline.sinks WHERE consumer = %s))"
        ).format(as_source(source).relation_sql()),
        (consumer,),
    ).fetchone()
    return int(row[0]) if row else 0


def counts_below_watermarks(
    conn: psycopg.Connection, source: Source | str, consumer: str, slices: Sequence[int] | None = None
) -> dict[int, int]:
    """Per slice with an offset row (of `slices`, default all): how many events of the store lie below its
    watermark."""
    rows = conn.execute(
        sql.SQL(
            "SELECT o.slice, count(e.*) FROM es_pipeline.offsets o LEFT JOIN {} e "
            "ON e.slice = o.slice AND e.tx_id < o.watermark WHERE o.consumer = %s "
            "AND (%s::smallint[] IS NULL OR o.slice = ANY(%s::smallint[])) GROUP BY o.slice"
        ).format(as_source(source).relation_sql()),
        (consumer, None if slices is None else list(slices), None if slices is None else list(slices)),
    ).fetchall()
    return {int(s): int(n) for s, n in rows}


def events_below_watermarks(
    conn: psycopg.Connection, source: Source | str, consumer: str, stream_ids: Sequence[str]
) -> list[tuple[str, str, int]]:
    """(tenant, stream_id, version) of the events of these streams that lie below their slice's watermark."""
    rows = conn.execute(
        sql.SQL(
            "SELECT e.tenant, e.stream_id, e.version FROM {} e "
            "LEFT JOIN es_pipeline.offsets o ON o.consumer = %s AND o.slice = e.slice "
            "WHERE e.stream_id = ANY(%s) AND e.tx_id < coalesce(o.watermark, '0'::xid8)"
        ).format(as_source(source).relation_sql()),
        (consumer, list(stream_ids)),
    ).fetchall()
    return [(str(t), str(s), int(v)) for t, s, v in rows]
