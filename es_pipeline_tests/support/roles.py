"""The role model in the tests: every test database carries it (`es-pipeline db roles`), and one login role
per group role serves the whole test session, so that es_pipeline runs as the extractor, not a superuser."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from es_pipeline.dev import local_server
from es_pipeline.store import roles

LOGIN_GROUPS = (roles.WRITER, roles.EXTRACTOR, roles.SNAPSHOTS)


class StoreDsn(str):
    """A test database's DSN as a superuser (set-up, appends, faults), carrying the DSNs of its login roles:
    es_pipeline runs as `.extractor`; `.writer` appends as an application would; `.snapshots` writes back."""

    extractor: str
    writer: str
    snapshots: str
    logins: dict[str, str]

    @classmethod
    def of(cls, dsn: str, logins: dict[str, str]) -> StoreDsn:
        made = cls(dsn)
        made.extractor = make_conninfo(dsn, user=logins[roles.EXTRACTOR])
        made.writer = make_conninfo(dsn, user=logins[roles.WRITER])
        made.snapshots = make_conninfo(dsn, user=logins[roles.SNAPSHOTS])
        made.logins = dict(logins)
        return made

    def of_database(self, name: str) -> StoreDsn:
        """The same DSNs for another database of the same server (a copy of this one, say)."""
        return StoreDsn.of(make_conninfo(self, dbname=name), self.logins)


def create_login(conn: psycopg.Connection, login: str, *groups: str) -> None:
    """A login role (dropped first if it exists) in `groups`, with the local servers' password: the passfile
    that every local DSN names then logs it in."""
    conn.execute("SET password_encryption = 'scram-sha-256'")
    conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(login)))
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
        sql.Identifier(login), sql.Literal(local_server.password())))
    for group in groups:
        conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(group), sql.Identifier(login)))


@contextmanager
def login_roles(admin_dsn: str) -> Iterator[dict[str, str]]:
    """A login role in each group role but the owner's, for this test session: {group role: login role}.

    The group roles must exist (`roles.apply` on any database of the server makes them); roles are
    cluster-wide, the grants are per database (a database cloned from a template keeps them)."""
    made = {group: f"t_{group}_{os.getpid()}" for group in LOGIN_GROUPS}
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for group, login in made.items():
            create_login(conn, login, group)
    try:
        yield made
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            for login in made.values():
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(login)))
