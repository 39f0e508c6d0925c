"""The Spark Connect server's token: without one, any local process could run code in its JVM.

Spark (4.0 on) checks a bearer token when `spark.connect.authenticate.token` is set; the server and the
Python client both read it from `SPARK_CONNECT_AUTHENTICATE_TOKEN`. `es-pipeline spark serve` takes that
variable, or this project's own token, generated once into `.secrets/spark-connect-token` (git-ignored,
0600); `make dev` and the end-to-end stack export it to every client. The client sends a token without
TLS only to the host `localhost` (the server has no TLS), so the local remote is `sc://localhost:<port>`.
"""

from __future__ import annotations

import os
import secrets

from es_pipeline.settings import LOCAL_SECRETS

TOKEN_ENV = "SPARK_CONNECT_AUTHENTICATE_TOKEN"
TOKEN_FILE = LOCAL_SECRETS / "spark-connect-token"


def local_token() -> str:
    """The project's Spark Connect token, generated on first use."""
    if TOKEN_FILE.exists():
        return TOKEN_FILE.read_text().strip()
    TOKEN_FILE.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_hex(24)
    fd = os.open(TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def local_remote(port: int) -> str:
    """The Spark Connect URL of a server of this machine: the token travels in TOKEN_ENV, not in the URL."""
    return f"sc://localhost:{port}"
