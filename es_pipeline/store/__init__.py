"""The PostgreSQL event store: connections (one DSN for psycopg, ADBC and JDBC), the writers' API, migrations."""
