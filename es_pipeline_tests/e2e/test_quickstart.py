"""docs/quickstart.md, run as written, outside the repository: a new dg project made by create-dagster in a
temporary folder, es_pipeline installed from the wheel this checkout builds, the component scaffolded, a domain
written, events appended by four writers through the documented API, the first materialization, the tables read
with `es-pipeline sql`. Every ```bash block of the page runs, in order, in one shell: the page cannot rot.

The tables are then checked against the same computation done in SQL on the store, and the project's virtualenv
against the wheel's RECORD: nothing es_pipeline writes lands there.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "quickstart.md"
WRITTEN_BY_DEFAULT = ("warehouse", ".dagster_home", ".pgdata", ".secrets", ".cache")


def bash_blocks(page: str) -> list[str]:
    """The page's ```bash blocks, in order (```shell ones are shown, not run)."""
    return re.findall(r"^```bash\n(.*?)^```", page, re.S | re.M)


def _uv() -> str:
    found = shutil.which("uv") or str(ROOT / ".cache" / "uv-tool" / "bin" / "uv")
    assert Path(found).exists(), "uv is missing: `make venv` installs it into .cache/uv-tool"
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_page_has_the_whole_path():
    blocks = "\n".join(bash_blocks(PAGE.read_text()))
    for step in ("create-dagster", "uv add es_pipeline", "dg scaffold defs es_pipeline.component.EsPipeline",
                 "es-pipeline materialize", "es-pipeline sql"):
        assert step in blocks, step


@pytest.mark.timeout(900)
def test_a_new_project_follows_the_quickstart_to_typed_tables_and_a_cross_stream_projection():
    wheels = Path(tempfile.mkdtemp(prefix="es-quickstart-wheel-"))
    built = subprocess.run([_uv(), "build", "--wheel", "-o", str(wheels), str(ROOT)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    # Beside the repository, in a folder the `postgres` user may enter (the local server's data is in the project).
    work = Path(tempfile.mkdtemp(prefix="es-quickstart-", dir="/tmp"))
    work.chmod(0o755)
    uv_bin = str(Path(_uv()).parent)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ES_PIPELINE_", "DAGSTER_", "VIRTUAL_ENV", "PYSPARK_", "UV_"))}
    env.update({
        "PATH": f"{uv_bin}:{env.get('PATH', '/usr/bin:/bin')}",
        "UV_FIND_LINKS": str(wheels),  # `uv add es_pipeline` finds this checkout's wheel; the rest from the index
        "ES_PIPELINE_LOCAL_PG_PORT": str(_free_port()),
        "UV_PYTHON": "3.11",
        "NO_COLOR": "1",
    })
    script = "set -euxo pipefail\n" + "\n".join(bash_blocks(PAGE.read_text()))
    project = work / "my-lake"
    try:
        run = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=780)
        assert run.returncode == 0, f"the quickstart stopped:\n{run.stderr[-4000:]}\n{run.stdout[-3000:]}"
        out = run.stdout
        assert "materializing into" in out and "the lake is up to date" in out
        dsn = subprocess.run([_uv(), "run", "es-pipeline", "db", "dsn"], cwd=project, env=env, capture_output=True,
                             text=True, check=True).stdout.strip()

        def lake(query: str) -> list[dict]:
            res = subprocess.run([_uv(), "run", "es-pipeline", "sql", query, "--format", "csv"], cwd=project, env=env,
                                 capture_output=True, text=True)
            assert res.returncode == 0, res.stderr
            return list(csv.DictReader(io.StringIO(res.stdout)))

        _the_tables_equal_the_store(dsn, lake)
        _nothing_written_into_the_virtualenv(project)
        for folder in ("warehouse", ".dagster_home", ".pgdata", ".secrets"):
            assert (project / folder).is_dir(), f"{folder} is not in the project"
    finally:
        if project.exists():
            subprocess.run([_uv(), "run", "es-pipeline", "db", "stop"], cwd=project, env=env, capture_output=True,
                           timeout=120)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(wheels, ignore_errors=True)


def _the_tables_equal_the_store(dsn: str, lake) -> None:
    """Each table against the same computation in SQL over es.events (never against what the lake says)."""
    with psycopg.connect(dsn) as conn:
        streams, events = conn.execute(
            "SELECT count(DISTINCT stream_id), count(*) FROM es.events WHERE stream_type = 'cart'").fetchone()
        price = "coalesce((payload->>'unit_price')::float8, (payload->>'price')::float8)"
        qty = "coalesce((payload->>'qty')::int, 1)"
        carts, total = conn.execute(f"""
            SELECT count(*), sum(total) FROM (
              SELECT stream_id, sum(CASE event_type WHEN 'ItemAdded' THEN {qty} * {price}
                                                    WHEN 'ItemRemoved' THEN -{qty} * {price} ELSE 0 END) AS total
              FROM es.events GROUP BY stream_id
              HAVING bool_or(event_type = 'CheckedOut')) c""").fetchone()
        units = dict(conn.execute(f"""
            SELECT payload->>'sku', sum(CASE event_type WHEN 'ItemAdded' THEN {qty} ELSE -{qty} END)
            FROM es.events WHERE event_type IN ('ItemAdded', 'ItemRemoved') GROUP BY 1""").fetchall())
        adds = {sku: (n, q) for sku, n, q in conn.execute(f"""
            SELECT payload->>'sku', count(*), sum({qty}) FROM es.events WHERE event_type = 'ItemAdded'
            GROUP BY 1""").fetchall()}
    assert streams == 200 and events > 200
    state = lake("SELECT count(*) AS streams, sum(version) AS events FROM stream_state WHERE stream_type = 'cart'")
    assert (int(state[0]["streams"]), int(state[0]["events"])) == (streams, events)
    typed = lake("SELECT count(*) AS carts, sum(total) AS total FROM stream_state_cart WHERE checked_out")
    assert int(typed[0]["carts"]) == carts and float(typed[0]["total"]) == pytest.approx(total)
    assert {r["sku"]: int(r["units"]) for r in lake("SELECT sku, units FROM sku_units")} == units
    rows = lake("SELECT sku, count(*) AS adds, sum(qty) AS qty, count(unit_price) AS priced FROM events_item_added "
                "GROUP BY sku")
    assert {r["sku"]: (int(r["adds"]), int(r["qty"])) for r in rows} == adds
    assert all(r["priced"] == r["adds"] for r in rows), "an old `price` payload was not upcast"


def _nothing_written_into_the_virtualenv(project: Path) -> None:
    """Every file of the installed package is one the wheel brought (its RECORD), bytecode aside; and none of the
    folders es_pipeline writes by default is anywhere in the virtualenv."""
    site = next((project / ".venv" / "lib").glob("python3.*/site-packages"))
    record = next(site.glob("es_pipeline-*.dist-info")) / "RECORD"
    shipped = {line.split(",")[0] for line in record.read_text().splitlines() if line}
    extra = [str(p.relative_to(site)) for p in (site / "es_pipeline").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and str(p.relative_to(site)) not in shipped]
    assert extra == [], f"written into the installed package: {extra[:10]}"
    strays = [str(p) for name in WRITTEN_BY_DEFAULT for p in (project / ".venv").rglob(name)]
    assert strays == [], f"es_pipeline's default folders inside the virtualenv: {strays[:10]}"
