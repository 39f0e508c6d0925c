"""`es-pipeline tenant erase T`: a tenant out of the store, the lake, every projection and the snapshots.

In this order, each step safe to run again (a cut-short erasure is finished by running it again):
1. refuse, changing nothing, unless the tenant's events are in a partition of their own (or already gone);
2. take every slice's lock (waiting for running `events` runs), and replay any batch a crashed run left
   pending, so that nothing in flight lands after the erasure or is lost by it;
3. record the erasure as started (`es_pipeline.tenant_erasures`);
4. drop the tenant's partition (detach, then drop: no DELETE, nothing for the append-only guard to refuse);
   in the native store also its `streams` and `snapshots` rows (an adopted store: `es_pipeline.snapshots`);
5. delete its rows from `events`, purge its files (`lake/delta/erase.py`: vacuum with no retention, change data
   removed) and check that none still holds the tenant, under the slice locks (no append can write a file the
   purge would take for unreferenced); then release the locks, so that extraction goes on;
6. every rebuild beside `stream_state` waited for and its shadow dropped (it may hold the tenant, read before);
   then the same for `stream_state`, `stream_catalog`, `event_type_daily` and `snapshots`, each in its turn
   (`serial.one_at_a_time`, which a long rebuild may hold: extraction no longer waits for it): the writers of
   each table are held off while its rows and files go. A projection that was up to date with `events` records
   the erasure's version with its DELETE and goes on from there; one that lagged is rebuilt whole by its next
   update (the change data it would have read is purged);
7. record the erasure as finished, unless a Parquet file under any table still holds a row of the tenant.
Other tenants are untouched: their events wait in the store while the locks are held (the store's drop and
the `events` delete and purge) and are extracted by the next runs, once each
(`es_pipeline_tests/extraction/test_tenant_erase.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psycopg
from deltalake import DeltaTable

from es_pipeline.errors import ErasureIncomplete, SliceLocked, TenantRefused
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.offsets import OffsetSession
from es_pipeline.extraction.slices import NUM_SLICES, SliceRange
from es_pipeline.lake import cross_stream, inventory
from es_pipeline.lake.aggregates.builtin import EVENT_TYPE_DAILY, STREAM_CATALOG
from es_pipeline.lake.delta import erase as lake_erase
from es_pipeline.lake.delta import tables
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel.position import txn_version_after
from es_pipeline.lake.kernel.turn import one_at_a_time
from es_pipeline.lake.state import history, rebuild
from es_pipeline.lake.state import stream_state as st
from es_pipeline.settings import Settings
from es_pipeline.source.mapping import NO_TENANT
from es_pipeline.store import tenants
from es_pipeline.store.conninfo import connect
from es_pipeline.store.event_store import EventStore

LOCK_CHUNK = 16  # slices locked at a time while waiting for running `events` runs


@dataclass
class Erasure:
    """What `tenant erase` removed."""

    tenant: str
    partition: str | None = None  # the dropped partition (None: the events were already gone from the store)
    store_events: int = 0
    store_rows: dict[str, int] = field(default_factory=dict)  # per store table: streams (native), snapshots
    lake_rows: dict[str, int] = field(default_factory=dict)  # per lake table
    files_purged: int = 0
    rebuilt: list[str] = field(default_factory=list)  # projections that lagged: rebuilt whole by their next update
    replayed_batches: int = 0


def _projection_after(
    name: str, path: str, events_id: str, before: int, erased_at: int
) -> tuple[tuple[str, int] | None, bool]:
    """For a projection about to lose the tenant's rows: (the (app id, version) its DELETE records, or None; whether
    its next update must rebuild it whole). Up to date with `events` just before the erasure (`before`): it records
    the erasure's version and goes on from there. Already past the erasure (it folded it meanwhile): nothing to
    record. Behind: its change feed across the erasure is purged, so it is rebuilt."""
    if name == "stream_state":
        app_id = st.app_id(events_id)
    else:
        projection = {p.name: p for p in (STREAM_CATALOG, EVENT_TYPE_DAILY)}.get(name)
        if projection is None or not tables.is_delta_table(path):
            return None, False
        app_id = projection.table.app_id_over(events_id)
    read = tables.transaction_version(path, app_id)
    if read is None:
        return None, False  # never built: its first update builds it whole anyway
    if name == "stream_state":  # its txn versions carry the reducers' revisions it folded with: kept as they are
        def at(v: int) -> int:
            return txn_version_after(int(read), v)
    else:
        def at(v: int) -> int:
            return v
    if int(read) >= at(erased_at):
        return None, False
    if int(read) == at(before):
        return (app_id, at(erased_at)), False
    return None, True


def _history_after(name: str, path: str, state_path: str, events_id: str, before: int,
                   grains: Sequence[str]) -> tuple[str, int] | None:
    """For a history table (lake/state/history.py) about to lose the tenant's rows, after `stream_state` did: the
    (app id, version) its DELETE records, so that it stays bound to `stream_state` (its version is `stream_state`'s
    when it follows it); None where it need not or cannot (then, unbound, its next update builds it whole). Its app
    id names its grain, which is the domain's: tried for each of `grains`."""
    state_read = tables.transaction_version(state_path, st.app_id(events_id))
    if state_read is None:
        return None
    for grain in grains:
        app = history.app_id_of(name, events_id, grain)
        held = tables.transaction_version(path, app)
        if held is None or held == state_read:
            continue
        if held == txn_version_after(state_read, before):  # it followed stream_state up to the erasure
            return app, state_read
    return None


def _lock_everything(session: OffsetSession, wait_seconds: float, progress: Callable[[str], None]) -> None:
    """Every slice's lock, range by range, keeping each as it comes: a range's run ends and its slices are
    ours, however often runs of the other ranges start (all at once would rarely find every range free)."""
    deadline, told = time.monotonic() + wait_seconds, 0.0
    chunks = [list(range(lo, min(lo + LOCK_CHUNK, NUM_SLICES))) for lo in range(0, NUM_SLICES, LOCK_CHUNK)]
    while True:
        held_by = ""
        for chunk in chunks:
            try:
                session.lock(chunk, f"{chunk[0]:04d}-{chunk[-1]:04d}")
            except SliceLocked as exc:
                held_by = exc.holder
        if not held_by:
            return
        if time.monotonic() >= deadline:
            raise SliceLocked("all slices", sorted(set(range(NUM_SLICES)) - session.locked), held_by)
        if time.monotonic() - told >= 10:
            progress(f"waiting for slice locks: {NUM_SLICES - len(session.locked)} slices are held, e.g. by {held_by}")
            told = time.monotonic()
        time.sleep(0.2)


def erase_tenant(
    settings: Settings, tenant: str, *, wait_seconds: float = 600.0, progress: Callable[[str], None] = print,
) -> Erasure:
    """Erase `tenant` (module docstring); `TenantRefused` before any change where it cannot."""
    source = settings.source
    if source.tenant == NO_TENANT:
        raise TenantRefused("erase", tenant, f"{source.label} has no tenants (its mapping's tenant is {NO_TENANT})",
                            "Set `tenant` in the mapping (docs/sources.md).")
    if tenant == "":
        raise TenantRefused("erase", tenant, "the empty tenant is every event of a store without tenants", "Name one.")
    done = Erasure(tenant)
    with connect(settings.pg_dsn, autocommit=True) as conn:
        _refuse_unless_erasable(conn, settings, tenant, progress)  # before any lock: changes nothing
        extractor = Extractor(settings.pg_dsn, None, settings.warehouse, source=source)
        everything = SliceRange(0, NUM_SLICES - 1)
        with extractor.session(everything, run_id="tenant-erase") as session:
            progress("taking every slice's lock (running `events` runs finish their pass first)")
            _lock_everything(session, wait_seconds, progress)
            done.replayed_batches = extractor.settle(session, everything, run_id="tenant-erase").replayed_batches
            part = _refuse_unless_erasable(conn, settings, tenant, lambda _: None)  # again: no run changes it now
            _erase_store(conn, settings, tenant, part, done, progress)
            before, erased_at, left = _erase_events(conn, settings, tenant, done)
        # The slice locks are released: the other tenants' events flow again while the projections, each in its
        # turn (which a long rebuild may hold), lose the tenant's rows. Extraction never touches them.
        progress("the tenant is out of the store and of `events`: extraction goes on while the projections follow")
        _erase_projections(conn, settings, tenant, done, before, erased_at, left)
    return done


def _refuse_unless_erasable(conn: psycopg.Connection, settings: Settings, tenant: str,
                            progress: Callable[[str], None]) -> tenants.Partition | None:
    """The tenant's partition (None: its events are gone from the store already); `TenantRefused` where the
    store cannot be erased by dropping one."""
    source = settings.source
    part = tenants.find_partition(conn, source, tenant)  # refuses a name the column would spell otherwise
    if part is None and tenants.store_has_rows(conn, source, tenant):
        raise TenantRefused(
            "erase", tenant, f"its events in {source.label} are not in a partition of their own",
            "es_pipeline erases a tenant from the store by dropping its partition (PARTITION BY LIST on the tenant "
            "column). Delete its rows with the framework's own tools, then run `tenant erase` again: it then "
            "erases the lake.")
    if part is None and tenant not in tenants.erasures(conn, source.consumer):
        progress(f"tenant {tenant!r} has no partition in {source.label}: erasing it from the lake")
    return part


def _erase_store(conn: psycopg.Connection, settings: Settings, tenant: str, part: tenants.Partition | None,
                 done: Erasure, progress: Callable[[str], None]) -> None:
    """Steps 3 and 4: the erasure recorded as started, the partition dropped, the native store's `streams` rows."""
    source = settings.source
    if part is not None:
        done.partition, done.store_events = part.qualified, tenants.count_events(conn, part)
    tenants.record_start(conn, source.consumer, tenant, done.partition, done.store_events)
    if part is not None:
        progress(f"dropping {part.qualified} ({done.store_events:,} events)")
        tenants.drop(conn, part, tenant)
    if source.native:
        done.store_rows = tenants.delete_stream_rows(conn, source.schema, tenant)


def _erase_events(
    conn: psycopg.Connection, settings: Settings, tenant: str, done: Erasure,
) -> tuple[int, int | None, dict[str, list[str]]]:
    """Steps 5 to 6 for `events`, under every slice lock (held by the caller) and the table's turn: no append and
    no compaction can write a file the purge would take for unreferenced. Returns (the version before the DELETE,
    the DELETE's version or None, the files still holding the tenant)."""
    events_path = EVENTS.path(settings.warehouse)
    with one_at_a_time(settings.pg_dsn, "events"):
        before = DeltaTable(events_path).version() if tables.is_delta_table(events_path) else -1
        deleted = lake_erase.delete_tenant(events_path, tenant)
        done.lake_rows["events"] = deleted[0] if deleted else 0
        done.files_purged += lake_erase.purge(events_path)
        found = lake_erase.leftovers(events_path, tenant)
    return before, (deleted[1] if deleted else None), ({"events": found} if found else {})


def _erase_projections(
    conn: psycopg.Connection, settings: Settings, tenant: str, done: Erasure,
    before: int, erased_at: int | None, left: dict[str, list[str]],
) -> None:
    """Steps 5 to 7 for the projections, each table in its turn, and the store's snapshots in the turn of the
    lake's; then the erasure recorded as finished, unless a file of any table still holds the tenant."""
    source, warehouse = settings.source, settings.warehouse
    deleted = erased_at is not None
    erased_at = before if erased_at is None else erased_at
    # The typed state tables last, each in stream_state's turn: an update between the turns reads only the erasure's
    # deletes from stream_state's change feed (or rebuilds from stream_state, the tenant gone), so none comes back.
    names = inventory.lake_tables(warehouse)[1:]
    crossing = set(cross_stream.table_names(warehouse))
    events_path = EVENTS.path(warehouse)
    events_id = tables.table_id(events_path) if tables.is_delta_table(events_path) else ""
    grains = history.grains_of(settings.domain_modules)
    # A rebuild beside stream_state (lake/state/rebuild.py) may hold the tenant's rows in its shadow, read before the
    # erasure: waited for (its turn), then every shadow dropped; the next one starts from `events` without the tenant.
    with one_at_a_time(settings.pg_dsn, rebuild.TURN):
        rebuild.drop_all(warehouse)
    for name in names:
        path = tables.table_path(warehouse, name)
        with one_at_a_time(settings.pg_dsn, inventory.turn_of(name)):
            advance, lagging = _projection_after(name, path, events_id, before, erased_at) if deleted else (None, False)
            if deleted and name.endswith(history.SUFFIX) and inventory.turn_of(name) == "stream_state":
                advance = _history_after(name, path, tables.table_path(warehouse, "stream_state"), events_id, before,
                                         grains)
            gone = lake_erase.delete_tenant(path, tenant, advance=advance)
            done.lake_rows[name] = gone[0] if gone else 0
            if name in crossing:  # its change feed may still hold the tenant's waiting events: folded anew
                cross_stream.mark_for_rebuild(warehouse, name, events_id)
                done.rebuilt.append(name)
            if lagging:
                done.rebuilt.append(name)
            done.files_purged += lake_erase.purge(path)
            if name == "snapshots":  # after the lake's: a take in this turn cannot write them back again
                store = EventStore.for_source(settings.pg_dsn, source)
                done.store_rows[store.snapshots_table.as_string(conn).replace('"', "")] = store.delete_snapshots(tenant, conn)
    left = {**left, **{name: found for name in names
                       if (found := lake_erase.leftovers(tables.table_path(warehouse, name), tenant))}}
    if left:  # not recorded as finished: running the erasure again deletes and purges again
        raise ErasureIncomplete(tenant, left)
    tenants.record_finish(conn, source.consumer, tenant, done.lake_rows)
