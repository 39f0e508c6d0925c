"""Additive aggregates of `events` that need no domain: the machinery (`aggregate`) and the built-in tables,
`stream_catalog` and `event_type_daily` (`builtin`)."""
