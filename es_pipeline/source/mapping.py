"""A source mapping: which table holds the events, and how its columns become the lake's.

Every read of the store (the extraction's batches, the sensor's probe, `status`, the checks, a rebase)
goes through `Source.relation()`: a subquery that shows any event table under the native columns
(`global_position, tx_id, stream_id, stream_type, version, slice, event_type, payload,
payload_encoding, metadata, recorded_at, tenant`). PostgreSQL pulls such a subquery up into the query
around it, so a condition on `slice` or `tx_id` reaches the table's own indexes, provided they are
built on the very expressions the mapping uses (`es-pipeline source adopt` builds them from it).

Column expressions are SQL over the table's columns (the table's alias is `t`); they come from the
presets below or from the operator's own TOML file (docs/sources.md), never from an event. A leaf:
this module imports only `errors`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from psycopg import sql

from es_pipeline.errors import ConfigError

NUM_SLICES = 1024  # extraction.slices.NUM_SLICES (that layer is above this one)
PAYLOAD_FORMATS = ("json", "text", "bytes")  # bytes: UTF-8 JSON lands as JSON, anything else as base64
NO_TENANT = "''"  # the tenant of a store without tenants: the empty string (never NULL: it is part of keys)


def hashed_slice(column: str) -> str:
    """The slice of a text key, as the native store computes it (`es.slice_of`), written inline so that a
    foreign store needs no function of ours: a bitwise AND of the 64-bit hash keeps 0..1023 for every value."""
    return f"(hashtextextended({column}, 0) & {NUM_SLICES - 1})::smallint"


@dataclass(frozen=True)
class Source:
    """Where the events are and how each lake column is computed from a row (SQL expressions)."""

    name: str  # the preset's name, or the TOML file's path
    schema: str
    table: str
    stream_id: str
    version: str
    event_type: str
    payload: str
    recorded_at: str
    tx_id: str = "tx_id"  # an xid8 column set by the writing transaction (`adopt` adds it where missing)
    stream_type: str = "''"
    payload_format: str = "json"
    metadata: str = "NULL"
    global_position: str = "NULL::bigint"
    tenant: str = NO_TENANT
    slice: str = ""  # default: hashed_slice(stream_id)
    filter: str = "true"  # which rows are events (e.g. not deletion markers)
    # The zone a `timestamp without time zone` recorded_at is written in ("UTC", "Europe/Paris"): never guessed
    # from the session's zone (`source adopt` refuses such a column without it).
    recorded_at_zone: str = ""
    # The framework deletes old events of a stream (Pekko's `deleteEventsTo`): the lake keeps what it extracted
    # before, so a rebase and the checks compare it with what the store still holds (extraction/rebase.py).
    deletes_events: bool = False
    # The table's columns the mapping reads: `adopt` names the missing ones. tx_id is checked on its own.
    columns: tuple[str, ...] = ()
    # Other tables of the same schema the expressions read (the extractor role is granted SELECT on them too).
    also_reads: tuple[str, ...] = ()
    native: bool = False  # es_pipeline's own store (`es.events`), created by `db migrate`

    def __post_init__(self) -> None:
        if self.payload_format not in PAYLOAD_FORMATS:
            raise ConfigError(f"{self.name}: payload_format", self.payload_format, " or ".join(PAYLOAD_FORMATS))
        for f in ("schema", "table", "tx_id", "stream_id", "version", "event_type", "payload", "recorded_at"):
            if not str(getattr(self, f)).strip():
                raise ConfigError(f"{self.name}: {f}", "", "a column name or SQL expression")
        if not self.slice:
            object.__setattr__(self, "slice", hashed_slice(self.stream_id))

    @property
    def qualified_table(self) -> str:
        return sql.Identifier(self.schema, self.table).as_string(None)

    @property
    def native_tenants(self) -> bool:
        """The native store partitioned by tenant (`es-tenants`): `db migrate` creates it so."""
        return self.native and self.tenant != NO_TENANT

    @property
    def label(self) -> str:
        """How messages name the source: `emmett (public.emt_messages)`."""
        return f"{self.name} ({self.schema}.{self.table})"

    @property
    def consumer(self) -> str:
        """The consumer whose offsets, batches and lock keys belong to this source, so that two stores in one
        database never share them. The native store keeps its historical names (`events` in `es`,
        `events:<schema>`); another table is named by its schema and table."""
        if self.native:
            return "events" if self.schema == "es" else f"events:{self.schema}"
        return f"events:{self.schema}.{self.table}"

    def relation(self) -> str:
        """The events as a subquery with the native columns, to be aliased by the caller (`... e`)."""
        return f"(SELECT {self.select_list()} FROM {self.qualified_table} t WHERE {self.filter})"

    def relation_sql(self) -> sql.SQL:
        """`relation()` for a psycopg statement with parameters (its `%` doubled, which psycopg reads as one)."""
        return sql.SQL(self.relation().replace("%", "%%"))  # type: ignore[arg-type]  # SQL of our own making

    def select_list(self) -> str:
        if self.payload_format == "json":
            payload, encoding = f"({self.payload})::text", "'json'::text"
        elif self.payload_format == "text":
            payload, encoding = f"({self.payload})::text", "'text'::text"
        else:  # decoded after the read (source.payloads): JSON when it is UTF-8 JSON, else base64
            payload, encoding = f"({self.payload})::bytea", "NULL::text"
        return ", ".join([
            f"({self.global_position})::bigint AS global_position",
            f"{self.tx_id} AS tx_id",
            f"({self.stream_id})::text AS stream_id",
            f"({self.stream_type})::text AS stream_type",
            f"({self.version}) AS version",
            f"{self.slice} AS slice",
            f"({self.event_type})::text AS event_type",
            f"{payload} AS payload",
            f"{encoding} AS payload_encoding",
            f"coalesce(({self.metadata})::text, '{{}}') AS metadata",
            f"{self.recorded_at_sql()} AS recorded_at",
            f"({self.tenant})::text AS tenant",
        ])

    def recorded_at_sql(self) -> str:
        """`recorded_at` as a timestamptz, a zone-less column read in its declared zone (never the session's)."""
        if self.recorded_at_zone:
            zone = self.recorded_at_zone.replace("'", "''")
            return f"(({self.recorded_at})::timestamp AT TIME ZONE '{zone}')"
        return f"({self.recorded_at})::timestamptz"

    @property
    def decodes_payloads(self) -> bool:
        """Whether payloads arrive as bytes and are decoded in Python (source.payloads), not in SQL."""
        return self.payload_format == "bytes"


# -- presets ------------------------------------------------------------------------------------------------

def native(schema: str = "es", *, tenants: bool = False) -> Source:
    """es_pipeline's own store, `es.events` (created by `es-pipeline db migrate`); with `tenants`, the same
    store partitioned by tenant (the `es-tenants` preset: `events.tenant`, one partition per tenant)."""
    return Source(
        name="es-tenants" if tenants else "es", schema=schema, table="events", native=True,
        stream_id="stream_id", stream_type="stream_type", version="version", event_type="event_type",
        payload="payload", metadata="metadata", recorded_at="recorded_at", global_position="global_position",
        slice="slice", tx_id="tx_id", tenant="tenant" if tenants else NO_TENANT,
        columns=("global_position", "tx_id", "stream_id", "stream_type", "version", "slice", "event_type",
                 "payload", "metadata", "recorded_at", *(("tenant",) if tenants else ())),
    )


def native_tenants(schema: str = "es") -> Source:
    return native(schema, tenants=True)


def emmett(schema: str = "public") -> Source:
    """Emmett's PostgreSQL store (`@event-driven-io/emmett-postgresql`): `emt_messages`, which already has
    `transaction_id xid8`. Only events (`message_kind = 'E'`), archived or not; the stream type is the stream
    name's prefix, as Emmett writes it into `emt_streams`; the tenant is Emmett's `partition`."""
    return Source(
        name="emmett", schema=schema, table="emt_messages", tx_id="transaction_id",
        stream_id="stream_id", stream_type="CASE WHEN strpos(stream_id, '-') > 0 THEN split_part(stream_id, '-', 1) ELSE 'emt:unknown' END",
        version="stream_position",
        event_type="message_type", payload="message_data", metadata="message_metadata", recorded_at="created",
        global_position="global_position", tenant="partition", filter="message_kind = 'E'",
        columns=("stream_id", "stream_position", "global_position", "transaction_id", "message_type",
                 "message_data", "message_metadata", "created", "partition", "message_kind"),
    )


def pekko_r2dbc(schema: str = "public") -> Source:
    """Pekko (or Akka) Persistence R2DBC's `event_journal`: its own `slice` (0..1023) is the slice; deletion
    markers (`deleted`) are not events; the serializer's id and manifest travel in the metadata."""
    return Source(
        name="pekko-r2dbc", schema=schema, table="event_journal",
        stream_id="persistence_id", stream_type="entity_type", version="seq_nr",
        event_type="coalesce(nullif(event_ser_manifest, ''), entity_type)", payload="event_payload",
        payload_format="bytes", recorded_at="db_timestamp", slice="slice", filter="NOT deleted", deletes_events=True,
        metadata=("jsonb_build_object('ser_id', event_ser_id, 'ser_manifest', event_ser_manifest, "
                  "'writer', writer, 'tags', tags, 'meta_ser_id', meta_ser_id, 'meta_ser_manifest', meta_ser_manifest, "
                  "'meta_payload', encode(meta_payload, 'base64'))"),
        columns=("slice", "entity_type", "persistence_id", "seq_nr", "db_timestamp", "event_ser_id",
                 "event_ser_manifest", "event_payload", "deleted", "writer", "tags", "meta_ser_id",
                 "meta_ser_manifest", "meta_payload"),
    )


def pekko_jdbc(schema: str = "public") -> Source:
    """Pekko Persistence JDBC's `event_journal` (1.x): `ordering` is the global position; the entity type is
    the persistence id's prefix before `|` (Pekko Typed's convention); `write_timestamp` is epoch millis."""
    return Source(
        name="pekko-jdbc", schema=schema, table="event_journal",
        stream_id="persistence_id", stream_type="split_part(persistence_id, '|', 1)", version="sequence_number",
        event_type="coalesce(nullif(event_ser_manifest, ''), nullif(adapter_manifest, ''), 'event')",
        payload="event_payload", payload_format="bytes",
        recorded_at="to_timestamp(write_timestamp / 1000.0)", global_position="ordering", filter="NOT deleted",
        deletes_events=True,
        metadata=("jsonb_build_object('ser_id', event_ser_id, 'ser_manifest', event_ser_manifest, "
                  "'adapter_manifest', adapter_manifest, 'writer', writer, 'meta_ser_id', meta_ser_id, "
                  "'meta_ser_manifest', meta_ser_manifest, 'meta_payload', encode(meta_payload, 'base64'))"),
        columns=("ordering", "persistence_id", "sequence_number", "deleted", "writer", "write_timestamp",
                 "adapter_manifest", "event_ser_id", "event_ser_manifest", "event_payload", "meta_ser_id",
                 "meta_ser_manifest", "meta_payload"),
    )


def marten(schema: str = "public") -> Source:
    """Marten's `mt_events`: `seq_id` is the global position, `tenant_id` the tenant; the stream type is
    `mt_streams.type` (the aggregate's name, when Marten knows it)."""
    streams = sql.Identifier(schema, "mt_streams").as_string(None)
    return Source(
        name="marten", schema=schema, table="mt_events",
        stream_id="stream_id", version="version", event_type="type", payload="data", recorded_at="timestamp",
        stream_type=f"coalesce((SELECT s.type FROM {streams} s WHERE s.id = t.stream_id LIMIT 1), '')",
        global_position="seq_id", tenant="tenant_id",
        metadata="jsonb_build_object('event_id', id, 'dotnet_type', mt_dotnet_type, 'is_archived', is_archived)",
        slice=hashed_slice("stream_id::text"),
        columns=("seq_id", "id", "stream_id", "version", "data", "type", "timestamp", "tenant_id",
                 "mt_dotnet_type", "is_archived"),
        also_reads=("mt_streams",),
    )


PRESETS = {"es": native, "es-tenants": native_tenants, "emmett": emmett, "pekko-r2dbc": pekko_r2dbc, "pekko-jdbc": pekko_jdbc, "marten": marten}
SETTING = "ES_PIPELINE_SOURCE"
EXPECTED = (f"a preset ({', '.join(PRESETS)}), optionally with its schema (`emmett:events`), "
            "or the path of a TOML file describing the table (docs/sources.md)")


def as_source(source: Source | str) -> Source:
    """`source`, or the native store in the schema named by a string (what older callers pass)."""
    return native(source) if isinstance(source, str) else source


def load(spec: str | None, native_schema: str = "es") -> Source:
    """The source that `ES_PIPELINE_SOURCE` names: a preset, `preset:schema`, or a TOML file."""
    text = (spec or "es").strip()
    if text.endswith(".toml") or (text.split(":")[0] not in PRESETS and Path(text).is_file()):
        return from_toml(Path(text))
    name, _, schema = text.partition(":")
    if name not in PRESETS:
        raise ConfigError(SETTING, text, EXPECTED)
    if name in ("es", "es-tenants"):
        return native(schema or native_schema, tenants=name == "es-tenants")
    return PRESETS[name](schema) if schema else PRESETS[name]()


_TOML_KEYS = {f.name for f in fields(Source)} - {"name", "native", "columns"}


def from_toml(path: Path) -> Source:
    """A custom mapping: a `[source]` table with `table = "schema.table"` and the column expressions."""
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(SETTING, str(path), "the path of an existing TOML file (no such file)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(SETTING, str(path), f"a valid TOML file ({exc})") from None
    body = data.get("source")
    if not isinstance(body, dict):
        raise ConfigError(SETTING, str(path), "a TOML file with a [source] table (docs/sources.md)")
    body = dict(body)
    qualified = str(body.pop("table", ""))
    schema, _, table = qualified.rpartition(".")
    if not table:
        raise ConfigError(f"{path}: table", qualified, 'the events table as "schema.table"')
    unknown = sorted(set(body) - _TOML_KEYS - {"columns", "preset"})
    if unknown:
        raise ConfigError(f"{path}: [source]", ", ".join(unknown),
                          f"only these keys: table, preset, columns, {', '.join(sorted(_TOML_KEYS - {'schema', 'table'}))}")
    if "schema" in body:
        raise ConfigError(f"{path}: schema", str(body["schema"]),
                          f'no schema key: the schema goes in table = "schema.{table}"')
    base = body.pop("preset", None)
    columns = _names(path, "columns", body.pop("columns", []))
    if "also_reads" in body:
        body["also_reads"] = _names(path, "also_reads", body["also_reads"])
    if not isinstance(body.get("deletes_events", False), bool):
        raise ConfigError(f"{path}: deletes_events", repr(body["deletes_events"]), "true or false")
    for key, value in body.items():
        if key not in ("also_reads", "deletes_events") and not isinstance(value, str):
            raise ConfigError(f"{path}: {key}", repr(value), 'a string: a column name or SQL expression, e.g. "version"')
    values: dict[str, Any] = dict(body)
    missing = [k for k in ("stream_id", "version", "event_type", "payload", "recorded_at") if k not in values]
    if base is not None:
        if base not in PRESETS or base in ("es", "es-tenants"):
            raise ConfigError(f"{path}: preset", str(base),
                              f"one of {', '.join(p for p in PRESETS if p not in ('es', 'es-tenants'))}")
        start = PRESETS[base](schema or "public")
        return replace(start, name=str(path), table=table, columns=columns or start.columns, **values)
    if missing:
        raise ConfigError(f"{path}: [source]", "missing " + ", ".join(missing),
                          "an expression for each of stream_id, version, event_type, payload, recorded_at")
    return Source(name=str(path), schema=schema or "public", table=table, columns=columns, **values)


def _names(path: Path, key: str, value: object) -> tuple[str, ...]:
    """A TOML list of names, checked: one bare string would become a tuple of its characters."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ConfigError(f"{path}: {key}", repr(value), f'a list of names, e.g. {key} = ["Streams"]')
    return tuple(value)


def slug(source: Source) -> str:
    """A short name for files and folders: the preset's name, or the TOML file's stem."""
    return Path(source.name).stem if source.name.endswith(".toml") else source.name


def describe(source: Source) -> list[str]:
    """The mapping as lines `lake column <- SQL`, for `es-pipeline source show` and the docs."""
    s = source
    rows = [
        ("table", s.qualified_table), ("consumer", s.consumer), ("tx_id", s.tx_id), ("slice", s.slice),
        ("stream_id", s.stream_id), ("stream_type", s.stream_type), ("version", s.version),
        ("event_type", s.event_type), ("payload", f"{s.payload} ({s.payload_format})"), ("metadata", s.metadata),
        ("recorded_at", s.recorded_at), ("global_position", s.global_position), ("tenant", s.tenant),
        ("filter", s.filter),
    ]
    return [f"{k:<16} {v}" for k, v in rows]
