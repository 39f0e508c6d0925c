"""From the event store to the Delta `events` table, exactly once: slices, offsets, reader, extractor, probe, status."""
