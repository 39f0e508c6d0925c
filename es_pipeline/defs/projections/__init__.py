"""The projections of `events` (stream_catalog, event_type_daily, stream_state), their check and automation."""
