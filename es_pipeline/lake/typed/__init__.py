"""Typed values: the rule by which a JSON value becomes a column (`shapes`), one type's batch as typed rows
(`typed_rows`), and the typed event tables, one per event type (`event_tables`)."""
