"""A real S3 server for development and tests: s3proxy (Maven Central `org.gaul:s3proxy`, the
jar-with-dependencies artifact) on its filesystem store, which answers `If-None-Match: *` atomically
(from 4.0 on: the object is published with a hard link, which fails if the name exists). delta-rs
commits with exactly that, so concurrent writers cannot overwrite each other's commits on it.

The jar is downloaded once into `.cache/s3proxy/` and checked against its SHA-1; the server's access key
and secret are generated once into `.secrets/s3proxy` (git-ignored, 0600). Every S3 client of the project
(delta-rs, pyarrow) takes the endpoint and keys from the standard variables that `client_env` returns.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from es_pipeline.dev.stack import free_port, stop_process, wait_port
from es_pipeline.errors import LocalServerError
from es_pipeline.lake.spark.java import java_binary
from es_pipeline.settings import LOCAL_SECRETS, PROJECT_ROOT, fetching_once

VERSION = "4.1.0"
JAR_SHA1 = "0a0b89e982bc1b1b5757d45b61109e05a840dd87"  # Maven Central's, for this version
JAR_URL = f"https://repo1.maven.org/maven2/org/gaul/s3proxy/{VERSION}/s3proxy-{VERSION}-jar-with-dependencies.jar"
JAR = PROJECT_ROOT / ".cache" / "s3proxy" / f"s3proxy-{VERSION}-jar-with-dependencies.jar"
KEYS = LOCAL_SECRETS / "s3proxy"
REGION = "us-east-1"


def jar() -> Path:
    """The s3proxy jar, downloaded once (about 55 MB) and verified."""
    if JAR.exists():
        return JAR
    with fetching_once("s3proxy"):
        return JAR if JAR.exists() else _download()


def _download() -> Path:
    JAR.parent.mkdir(parents=True, exist_ok=True)
    partial = JAR.with_suffix(".part")
    print(f"downloading s3proxy {VERSION} from Maven Central (55 MB, once) into {JAR.parent}", flush=True)
    with urllib.request.urlopen(JAR_URL, timeout=60) as response, partial.open("wb") as out:  # noqa: S310 - a fixed https URL
        while chunk := response.read(1 << 20):
            out.write(chunk)
    digest = hashlib.sha1(partial.read_bytes(), usedforsecurity=False).hexdigest()
    if digest != JAR_SHA1:
        partial.unlink()
        raise LocalServerError(f"the s3proxy jar from Maven Central has SHA-1 {digest}, not {JAR_SHA1}: not used")
    partial.rename(JAR)
    return JAR


def keys() -> tuple[str, str]:
    """The local server's access key and secret, generated on first use."""
    if not KEYS.exists():
        with fetching_once("s3proxy-keys"):  # written whole before another process reads it
            if not KEYS.exists():
                KEYS.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                fd = os.open(KEYS, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(f"es-pipeline-{secrets.token_hex(4)}\n{secrets.token_hex(24)}\n")
    access, secret = KEYS.read_text().split()
    return access, secret


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    data: Path

    def bucket(self, name: str) -> str:
        """A bucket of this server (made if missing: on the filesystem store a bucket is a folder); its URI."""
        (self.data / name).mkdir(exist_ok=True)
        return f"s3://{name}"

    def client_env(self) -> dict[str, str]:
        """The standard variables that delta-rs, pyarrow and the AWS SDKs read for this server."""
        access, secret = keys()
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION, "AWS_ALLOW_HTTP": "true"}


@contextmanager
def s3proxy(data: Path, *, port: int | None = None) -> Iterator[S3Server]:
    """s3proxy on 127.0.0.1 with its objects under `data`, for as long as the context lasts."""
    java = java_binary()
    if java is None:
        raise LocalServerError("s3proxy needs Java 17 or later: a JDK on PATH or JAVA_HOME (or `make`'s portable extra)")
    port = port or free_port()
    data.mkdir(parents=True, exist_ok=True)
    access, secret = keys()
    conf = data.parent / f"{data.name}.s3proxy.properties"
    conf.touch(mode=0o600)
    conf.write_text(
        f"s3proxy.endpoint=http://127.0.0.1:{port}\ns3proxy.authorization=aws-v2-or-v4\n"
        f"s3proxy.identity={access}\ns3proxy.credential={secret}\n"
        f"jclouds.provider=filesystem\njclouds.filesystem.basedir={data}\n"
    )
    log = data.parent / f"{data.name}.s3proxy.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([java, "-jar", str(jar()), "--properties", str(conf)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_port(port, 60)
        except TimeoutError:
            raise LocalServerError(f"s3proxy did not start on port {port}; see {log}") from None
        yield S3Server(f"http://127.0.0.1:{port}", data)
    finally:
        stop_process(proc, 20)
