"""`es-pipeline offsets rebase`: after the event store moved to another PostgreSQL cluster, exactly once again.

A dump restored into a new cluster (or a cut-over to a logical replica) keeps the rows and their `tx_id`
values, but the new cluster counts transaction ids from elsewhere: new events get ids below, between and
above the restored ones, so no watermark can separate what the lake holds from what it lacks. Runs refuse
such a store (`offsets.check_source`): offsets recorded on another cluster, or rows whose `tx_id` this cluster
has not assigned yet (a store restored before es_pipeline met it, a copy job, an attached partition). A rebase
makes it safe again:

1. under every slice lock, check that each event of the lake is in the store, with the same key
   (tenant, stream id, version) and `recorded_at`; if not, the store is older than the lake and nothing is
   changed (`RebaseRefused`);
2. forget the watermarks, pending batches and lake commits, record the new cluster, and set the mark
   `rebased_below` past every transaction id in the store and the horizon (`offsets.mark_rebased`);
3. the next runs read the store from the start; a batch that starts below the mark leaves out, by key,
   the events the lake holds already (`Extractor`), and above the mark runs are as before. The first run on
   each slice also reads the restored events above the horizon at once (`Extractor._catch_up`), in Delta
   transactions named by the cluster and the mark, so that every later move catches up anew.
4. the rows of each slice's first run (the restored tail, and what the new cluster committed meanwhile) carry as
   their `batch_id` one id the rebase takes from the sequence past every batch of the lake: they sort together,
   by position, after everything extracted from the old cluster and before everything extracted after them
   (docs/domain.md, "The order of events"); cross-stream projections fold them once every first run is done.

Where the consumer has extracted nothing and the lake is empty (a store restored before its first extraction,
or a lake rebuilt after `offsets reset`), the first run rebases by itself: there is nothing to compare.

It costs one read of every key in the lake and in the store, and one pass over the store.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.compute as pc

from es_pipeline.errors import FutureTransactionIds, RebaseRefused, SourceChanged, XidSpaceWentBack
from es_pipeline.extraction import reader
from es_pipeline.extraction.offsets import OffsetSession, check_source, mark_rebased
from es_pipeline.extraction.slices import NUM_SLICES
from es_pipeline.lake.delta import tables
from es_pipeline.source.mapping import Source, as_source


@dataclass(frozen=True)
class Rebase:
    cluster: str
    rebased_below: int  # batches starting below this transaction id leave out what the lake holds
    lake_events: int  # events in the lake, every one found in the store but those `deleted`
    forgotten_slices: int
    deleted: int = 0  # events of the lake the store no longer holds: its framework deleted them (`deletes_events`)


def rebase(dsn: str, source: Source | str, consumer: str, events_path: str) -> Rebase | None:
    """Rebase `consumer` onto the store's cluster; None if its offsets already count this cluster's ids."""
    source = as_source(source)
    with OffsetSession(dsn, consumer, run_id="offsets-rebase", label="offsets rebase", source=source) as session:
        session.lock(range(NUM_SLICES), "all slices")
        try:
            check_source(session.conn, consumer, source)
            return None
        except (SourceChanged, XidSpaceWentBack, FutureTransactionIds):
            pass
        lake_keys = tables.event_keys(events_path)
        missing, deleted = lake_not_in_store(lake_keys, dsn, source)
        if missing.num_rows:
            raise RebaseRefused(events_path, missing.num_rows, tables.key_label(missing, 0))
        cluster, below, n = mark_rebased(session.conn, source, consumer, tables.highest_batch_id(events_path))
        return Rebase(cluster, below, lake_keys.num_rows, n, deleted)


def lake_not_in_store(lake_keys: pa.Table, dsn: str, source: Source) -> tuple[pa.Table, int]:
    """The lake's events the store does not hold (by key and `recorded_at`), and how many more the store's
    framework has deleted since (`Source.deletes_events`), which cannot be checked.

    A framework that deletes events (Pekko's `deleteEventsTo`) deletes a prefix of a stream and may keep its
    last deleted row as a marker: so the store is read with its deleted rows (the mapping's filter left out),
    and a lake event below the lowest version the store still holds of its stream is the framework's deletion.
    One above it that the store lacks still refuses the rebase: the store is older than the lake."""
    if not source.deletes_events:
        return tables.anti_join_keys(lake_keys, reader.event_keys(dsn, source)), 0
    store = reader.event_keys(dsn, replace(source, filter="true"))
    missing = tables.anti_join_keys(lake_keys, store)
    if missing.num_rows == 0:
        return missing, 0
    lowest = store.group_by(["tenant", "stream_id"]).aggregate([("version", "min")])
    joined = missing.join(lowest, keys=["tenant", "stream_id"], join_type="left outer")
    gone = pc.or_(pc.is_null(joined["version_min"]), pc.less(joined["version"], joined["version_min"]))
    return joined.filter(pc.invert(gone)).select(missing.column_names), int(pc.sum(gone.cast(pa.int64())).as_py() or 0)
