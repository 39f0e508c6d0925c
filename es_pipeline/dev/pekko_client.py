"""A real Apache Pekko Persistence JDBC application (Java 17, Maven), for the tests; built once into .cache/pekko
with its Maven repository in .cache/m2 (`mvn package`, again only when pom.xml or a source file changes).

`pekko/` (beside this module) is the application: a typed `EventSourcedBehavior` "cart" whose events
(`ItemAdded`) Jackson serializes to JSON, journaled by pekko-persistence-jdbc's `jdbc-journal` in PostgreSQL's
`event_journal`. It takes the user on its command line and the password from the passfile PGPASSFILE names
(the PostgreSQL JDBC driver reads it), never from argv.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

from es_pipeline.settings import LOCAL_PG_PASSFILE, PROJECT_ROOT, fetching_once
from es_pipeline.store import conninfo

SOURCES = Path(__file__).parent / "pekko"
HOME = PROJECT_ROOT / ".cache" / "pekko"
REPOSITORY = PROJECT_ROOT / ".cache" / "m2"
JAR = HOME / "target" / "pekko-writer-1.0.jar"
MAIN = "espipeline.pekko.Writer"
# Small on purpose: the machine has 2 cores, and two writers may run beside PostgreSQL and the extraction.
JVM_FLAGS = ("-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Dslf4j.internal.verbosity=ERROR")
_RESULT = re.compile(r"^(written|replayed) (\d+)$")


def _sources() -> list[Path]:
    if not SOURCES.is_dir():
        raise FileNotFoundError(f"the Pekko client's sources ({SOURCES}) ship with es_pipeline's source repository, "
                                "not with the wheel: run it from a checkout")
    return sorted(p for p in SOURCES.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def _fingerprint() -> str:
    digest = hashlib.sha256()
    for path in _sources():
        digest.update(str(path.relative_to(SOURCES)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def install() -> str:
    """The application's classpath (its jar, then its dependencies): built with Maven the first time, and
    again only when pom.xml or a source changed."""
    with fetching_once("pekko"):
        return _install()


def _install() -> str:
    HOME.mkdir(parents=True, exist_ok=True)
    stamp, listing = HOME / "built-from", HOME / "classpath.txt"
    fingerprint = _fingerprint()
    if not (stamp.exists() and stamp.read_text() == fingerprint and listing.exists() and JAR.exists()):
        shutil.rmtree(HOME / "src", ignore_errors=True)
        for path in _sources():
            target = HOME / path.relative_to(SOURCES)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        done = subprocess.run(
            ["mvn", "-B", "-q", f"-Dmaven.repo.local={REPOSITORY}", "-DskipTests", "package",
             "dependency:build-classpath", f"-Dmdep.outputFile={listing}"],
            cwd=HOME, capture_output=True, text=True, timeout=1200,
        )
        if done.returncode != 0:
            raise RuntimeError(f"building the Pekko writer failed ({done.returncode}): "
                               f"{(done.stdout + done.stderr).strip()[-3000:]}")
        stamp.write_text(fingerprint)
    return os.pathsep.join([str(JAR), listing.read_text().strip()])


def published_schema(name: str = "postgres-create-schema.sql") -> str:
    """The PostgreSQL schema script that the pekko-persistence-jdbc jar in use ships (`schema/postgres/`)."""
    jar = next(p for p in install().split(os.pathsep) if Path(p).name.startswith("pekko-persistence-jdbc_"))
    with zipfile.ZipFile(jar) as z:
        return z.read(f"schema/postgres/{name}").decode()


def jdbc_url(dsn: str) -> str:
    """A libpq DSN as a JDBC URL, without user or password (the user goes apart, the password stays in the passfile)."""
    p = conninfo.parse(dsn)
    return f"jdbc:postgresql://{p.get('host', '127.0.0.1')}:{p.get('port', 5432)}/{p['dbname']}"


def env(dsn: str) -> dict[str, str]:
    """The environment of a writer: PGPASSFILE names the DSN's passfile, or the local servers'."""
    return {**os.environ, "PGPASSFILE": str(conninfo.parse(dsn).get("passfile") or LOCAL_PG_PASSFILE)}


def start(dsn: str, mode: str, worker: str, entities: int, events: int = 0, pause_ms: int = 0) -> subprocess.Popen[str]:
    """A JVM running the application as the DSN's user. `write`: carts `cart|<worker>-0` .. `-<entities-1>` persist
    `events` events each, all at once (a round of commands every `pause_ms`); `read`: the same carts recover
    from the journal. `finished` gives what it wrote or replayed."""
    if mode not in ("write", "read"):
        raise ValueError(f"mode: write or read, not {mode!r}")
    return subprocess.Popen(
        ["java", *JVM_FLAGS, "-cp", install(), MAIN, mode, "--jdbc-url", jdbc_url(dsn),
         "--user", str(conninfo.parse(dsn)["user"]), "--worker", worker, "--entities", str(entities),
         "--events", str(events), "--pause-ms", str(pause_ms)],
        env=env(dsn), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finished(process: subprocess.Popen[str], timeout: float = 300) -> int:
    """The number of events a writer persisted (`written N`) or replayed (`replayed N`); raises with the end of
    its error output if it failed."""
    out, err = process.communicate(timeout=timeout)
    lines = [m for line in out.splitlines() if (m := _RESULT.match(line.strip()))]
    if process.returncode != 0 or not lines:
        raise RuntimeError(f"the Pekko writer failed ({process.returncode}): {err.strip()[-3000:]}")
    return int(lines[-1].group(2))
