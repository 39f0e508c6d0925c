"""Delta primitives, with no table of their own: paths, schemas, reads and idempotent writes (`tables`), what
defines a table (`definition`), `events`' change feed and a table's files (`feed`), streaming Arrow appends
(`arrow_append`), one update of a table at a time (`serial`), a tenant's rows out of a table (`erase`)."""
