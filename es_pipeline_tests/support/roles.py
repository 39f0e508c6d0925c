"""Login roles of es_pipeline's group roles (`es-pipeline db roles`), for tests that run as them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg.conninfo import make_conninfo

from es_pipeline.store import roles


@contextmanager
def login_roles(dsn: str) -> Iterator[dict[str, str]]:
    """The role model applied to the store at `dsn` (a superuser's), and a login role in each group
    but the owner's: {group role: a DSN that logs in as its login role}. The login roles are dropped after."""
    roles.apply(dsn, "es", echo=lambda _: None)
    made: dict[str, str] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for group in (roles.WRITER, roles.EXTRACTOR, roles.SNAPSHOTS):
            login = f"t_{group}_{os.getpid()}"
            conn.execute(f"DROP ROLE IF EXISTS {login}")
            conn.execute(f"CREATE ROLE {login} LOGIN IN ROLE {group}")
            made[group] = login
    try:
        yield {group: make_conninfo(dsn, user=login) for group, login in made.items()}
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for login in made.values():
                conn.execute(f"DROP ROLE IF EXISTS {login}")
