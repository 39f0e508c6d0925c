"""`stream_state`'s first build without a JVM: every event folded by this machine's cores.

A first build folds every event of `events`. On Spark that is a shuffle of every row by stream, a sort, and
every row through Arrow to the Python workers: 0.16 of a plain `groupBy` over the same events at 5 million
(bench/results/state_rebuild.md). Within the engine rule's bound (`Engine.on_spark`: 1 GiB of Parquet) it is
done here instead:

1. the table's current files read by pyarrow (one version of `events`, the one the build records): whole up to
   `pieces.PIECE_BYTES` of Parquet, else in one pass into pieces by slice span (lake/delta/pieces.py), so this
   process and each worker hold one piece at a time;
2. whole: split by slice over one forked process per core (one process below lake/state/forked.py's
   `ONE_PROCESS_ROWS`); in pieces: a piece per call over one forked process per core. Each orders its rows
   by the dictionary codes of tenant and stream, then version, and folds them stream by stream with
   `StreamFold.events` (the same reducers and rules as Spark's workers);
3. the output returned to lake/state/stream_state.py, which writes it with delta-rs under the same Delta
   transaction id (app id, version) Spark's MERGE carries, inside the table's turn, so either engine goes on
   from what the other folded; with it, the history tables' rows (lake/state/history.py), made by each
   folding process from its streams' trails as it goes.

A larger table goes to Spark by the kernel's runner (lake/kernel/runner.py); `events` with deletion vectors
returns None, and Spark does it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from itertools import islice

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from es_pipeline.domain import Domain, Reducer
from es_pipeline.lake.delta import current, pieces, tables
from es_pipeline.lake.delta.definition import Table
from es_pipeline.lake.state import declared_build, forked, history
from es_pipeline.lake.state.fold import (
    FOLD_COLUMNS,
    FOLD_OUT,
    Rules,
    StreamFold,
    fold_out_batch,
    with_schema_versions,
)
from es_pipeline.source import payloads

CHUNK = 65_536  # events taken and turned into Python objects at a time (whole streams)



Histories = dict[str, tuple[Reducer, Table]]  # lake/state/history.py `history_tables`
Built = dict[str, list[pa.Table]]  # per stream type, its history rows


def fold_table(events_path: str, domain: Domain, skip_unknown: bool) -> tuple[pa.Table, int, Built] | None:
    """Every stream of the `events` table at `events_path` folded here (the runner asks only within the engine
    rule's bound): (the fold's output, the `events` version read, the history tables' rows), or None: Spark's to do
    (deletion vectors)."""
    events = DeltaTable(events_path)
    if current.has_deletion_vectors(events):
        return None  # its files alone are not its rows
    size = tables.files_bytes(events)
    now = int(events.version())
    read = [*FOLD_COLUMNS, "payload_encoding", "slice", *(["metadata"] if domain.metadata_field else [])]
    count = pieces.count_for(size)
    histories = history.history_tables(domain)
    # Declared reducers' streams built by DuckDB's aggregations over this version (lake/state/declared_build.py);
    # the Python fold reads and takes the rest.
    declared = declared_build.native_types(domain)
    native = None
    if declared:  # a local lake's files read by DuckDB's own Parquet reader (faster than through Arrow)
        native = declared_build.build(current.files(events_path, events) if tables.is_uri(events_path)
                                      else events.file_uris(), declared)
    if native is not None and native.whole:
        return native.out, now, {}
    rows = pieces.batches(events_path, events, read, None if native is None else native.python_rows(declared))
    with pieces.spread(rows, pieces.schema(events, read), count, pieces.by_slice(count)) as parts:
        if parts.count == 1:
            folded = _fold(_prepared(_for_python(parts.read(0), native, declared), domain), dict(domain.folds),
                           _rules(domain, skip_unknown), histories)
        else:  # a piece per call, one forked process per core: each holds one piece at a time
            folded = forked.run((parts, domain, skip_unknown, histories, native, tuple(declared)), _fold_piece,
                                range(parts.count))
    out, now, built = _joined(folded, now)
    return (out if native is None else pa.concat_tables([native.out, out])), now, built


def _for_python(rows: pa.Table, native: declared_build.Native | None, declared: Iterable[str]) -> pa.Table:
    """`rows` without the events of streams built natively."""
    return rows if native is None else native.keep_for_python(rows, declared)


def fold_piece(rows: pa.Table, domain: Domain, skip_unknown: bool, histories: Histories) -> tuple[pa.Table, Built]:
    """Every stream of `rows` (whole streams, as `events` holds them) folded by this machine's cores: the fold's
    output, and the rows of the history tables of `histories`."""
    out, _, built = _joined(_fold(_prepared(rows, domain), dict(domain.folds), _rules(domain, skip_unknown),
                                  histories), -1)
    return out, built


def _rules(domain: Domain, skip_unknown: bool) -> Rules:
    return Rules(skip_unknown, domain.quarantines)


def _joined(folded: list[tuple[pa.Table, Built]], now: int) -> tuple[pa.Table, int, Built]:
    built: Built = {}
    for _, parts in folded:
        for stream_type, tables_of_type in parts.items():
            built.setdefault(stream_type, []).extend(tables_of_type)
    return pa.concat_tables([out for out, _ in folded]), now, built


def _prepared(rows: pa.Table, domain: Domain) -> pa.Table:
    """Rows as the reducers take them: payloads decoded, tenant filled, each event's schema version."""
    return with_schema_versions(payloads.for_reducers(tables.tenant_filled(rows)), domain)


def _fold(rows: pa.Table, registry: dict[str, Reducer], rules: Rules,
          histories: Histories) -> list[tuple[pa.Table, Built]]:
    """Every stream of `rows` folded: in this process, or split by slice over one forked process per core."""
    n = forked.shares(rows.num_rows) if "slice" in rows.column_names else 1
    bounds: list[int] = []
    if n > 1:  # the slices seen, cut into `n` spans of as many slices each
        low, high = (int(v.as_py()) for v in pc.min_max(rows["slice"]).values())
        bounds = [low + (high + 1 - low) * i // n for i in range(n + 1)]
    # Forked: each worker reads its share of the rows this process holds, without copying them to it.
    return forked.run((rows, registry, rules, bounds, histories), _fold_share, range(n))


def _fold_piece(i: int) -> tuple[pa.Table, Built]:
    """The fold of piece `i` (whole streams), read from disk by the worker that folds it."""
    parts, domain, skip_unknown, histories, native, declared = forked.shared()
    return _fold_rows(_prepared(_for_python(parts.read(i), native, declared), domain), None, dict(domain.folds),
                      _rules(domain, skip_unknown), histories)


def _fold_share(share: int) -> tuple[pa.Table, Built]:
    """The fold of one share of the rows (its span of slices; all of them without `bounds`).

    The rows are ordered by stream and version without sorting strings: the share's tenants and stream ids
    become dictionary codes, and the codes are sorted. Then `CHUNK` events at a time (whole streams) are
    taken in that order and folded stream by stream (`StreamFold.events`)."""
    rows, registry, rules, bounds, histories = forked.shared()
    ids = None
    if bounds:
        lo, hi = bounds[share], bounds[share + 1]
        ids = pc.indices_nonzero(pc.and_(pc.greater_equal(rows["slice"], lo), pc.less(rows["slice"], hi)))
    return _fold_rows(rows, ids, registry, rules, histories)


def _fold_rows(rows: pa.Table, ids: pa.Array | None, registry: dict[str, Reducer], rules: Rules,
               histories: Histories) -> tuple[pa.Table, Built]:
    """The fold of `rows` (those at `ids`; all without), stream by stream, and the history rows of the types that
    keep one (made a chunk of streams at a time, from each stream's trail)."""

    def share_of(name: str) -> pa.Array:
        column = rows[name] if ids is None else rows[name].take(ids)
        return column.combine_chunks()

    keys = pa.table({"tenant": _codes(share_of("tenant")), "stream": _codes(share_of("stream_id")),
                     "version": share_of("version")})
    order = pc.sort_indices(keys, [("tenant", "ascending"), ("stream", "ascending"), ("version", "ascending")])
    starts = _stream_starts(keys["tenant"].take(order), keys["stream"].take(order))
    at = order if ids is None else ids.take(order)  # the share's order, as rows of `rows`
    # Each column taken whole, once (a take per chunk of events from the many chunks read costs 4x more).
    heads = [rows[name].take(at.take(pa.array(starts[:-1], pa.int64()))).to_pylist()
             for name in ("stream_id", "tenant", "stream_type")]
    events = [rows[name].take(at) for name in ("version", "event_type", "payload")]
    events.append(rows["recorded_at"].take(at).cast(pa.int64()))
    out: list[tuple[object, ...]] = []
    built: Built = {}
    first = 0  # the first stream of the next chunk
    while first < len(starts) - 1:
        end = min(max(bisect_left(starts, starts[first] + CHUNK, first + 1), first + 1), len(starts) - 1)
        lo, n = starts[first], starts[end] - starts[first]
        run = zip(*(column.slice(lo, n).to_pylist() for column in events), strict=True)
        kept: dict[str, list[StreamFold]] = {}
        for k in range(first, end):
            stream_type = heads[2][k]
            fold = StreamFold(heads[1][k], heads[0][k], stream_type, registry.get(stream_type), *rules)
            fold.events(islice(run, starts[k + 1] - starts[k]))
            out.append(fold.row(with_trail=False))
            if fold.trail and fold.error is None:
                kept.setdefault(stream_type, []).append(fold)
        for stream_type, folds in kept.items():
            reducer, table = histories[stream_type]
            built.setdefault(stream_type, []).append(history.built_rows(folds, reducer, table))
        first = end
    return pa.Table.from_batches([fold_out_batch(out)] if out else [], schema=FOLD_OUT), built


def _codes(values: pa.Array) -> pa.Array:
    """A dictionary code per value (equal values, equal codes; in order of first appearance)."""
    return pc.dictionary_encode(values).indices


def _stream_starts(tenants: pa.Array, streams: pa.Array) -> list[int]:
    """Where each stream begins in rows ordered by stream (its codes), and the end: [0, ..., len]."""
    n = len(streams)
    if n == 0:
        return [0]
    change = pc.or_(pc.not_equal(streams[1:], streams[:-1]), pc.not_equal(tenants[1:], tenants[:-1]))
    return [0, *(pc.add(pc.indices_nonzero(change), 1).to_pylist()), n]
