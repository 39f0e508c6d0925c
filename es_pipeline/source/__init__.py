"""Event stores as sources: where the events are, and how their columns become the lake's (docs/sources.md)."""
