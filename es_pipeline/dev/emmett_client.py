"""A real Emmett client (`@event-driven-io/emmett-postgresql`, Node), for the Emmett demo and the tests; installed
once into .cache/emmett (`npm ci`, Node 20).

`append.mjs` and `read.mjs` (beside this module) use Emmett's own API: `getPostgreSQLEventStore(url)`,
`appendToStream`, `readStream`. Emmett creates its tables (`emt_messages`, ...) on its first append.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from es_pipeline.settings import LOCAL_PG_PASSFILE, PROJECT_ROOT, fetching_once
from es_pipeline.store import conninfo

SCRIPTS = Path(__file__).parent / "emmett"
HOME = PROJECT_ROOT / ".cache" / "emmett"
FILES = ("package.json", "package-lock.json", "append.mjs", "read.mjs")


def install() -> Path:
    """The client's folder, with its node_modules (npm ci, once per package-lock.json)."""
    if not SCRIPTS.is_dir():
        raise FileNotFoundError(f"the Emmett client's scripts ({SCRIPTS}) ship with es_pipeline's source repository, "
                                "not with the wheel: run the Emmett demo from a checkout")
    with fetching_once("emmett"):
        return _install()


def _install() -> Path:
    HOME.mkdir(parents=True, exist_ok=True)
    stale = any(not (HOME / f).exists() or (HOME / f).read_bytes() != (SCRIPTS / f).read_bytes() for f in FILES)
    for f in FILES:
        shutil.copyfile(SCRIPTS / f, HOME / f)
    if stale or not (HOME / "node_modules" / "@event-driven-io" / "emmett-postgresql").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=HOME, check=True,
                       capture_output=True, timeout=600)
    return HOME


def node_url(dsn: str) -> str:
    """A libpq DSN as the URL node-postgres takes; the password stays in the passfile (PGPASSFILE)."""
    p = conninfo.parse(dsn)
    return f"postgresql://{p['user']}@{p.get('host', '127.0.0.1')}:{p.get('port', 5432)}/{p['dbname']}"


def env() -> dict[str, str]:
    return {**os.environ, "PGPASSFILE": str(LOCAL_PG_PASSFILE)}


def start_appending(
    dsn: str, worker: str, streams: int, events_per_stream: int, per_append: int = 1, shape: str = "v2"
) -> subprocess.Popen[str]:
    """A Node process appending `streams` × `events_per_stream` events (`ItemAdded`) to streams `cart-<worker>-<n>`;
    `shape="v1"`: the older payloads (`price`, not `unit_price`) and some `ItemRemoved` (append.mjs)."""
    return subprocess.Popen(
        ["node", "append.mjs", node_url(dsn), worker, str(streams), str(events_per_stream), str(per_append), shape],
        cwd=install(), env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finished(process: subprocess.Popen[str], timeout: float = 300) -> int:
    """The number of events a writer appended; raises with its error output if it failed."""
    out, err = process.communicate(timeout=timeout)
    if process.returncode != 0:
        raise RuntimeError(f"the Emmett writer failed ({process.returncode}): {err.strip()[-2000:]}")
    return int(json.loads(out.strip().splitlines()[-1])["events"])


def read_stream(dsn: str, stream: str) -> dict[str, object]:
    """What Emmett's own `readStream` returns for `stream` (count, version, ...)."""
    done = subprocess.run(["node", "read.mjs", node_url(dsn), stream], cwd=install(), env=env(),
                          capture_output=True, text=True, timeout=120, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))
