"""Settings from the environment: defaults, and bad values refused with what to write instead."""

from __future__ import annotations

import pytest

from es_pipeline.errors import ConfigError
from es_pipeline.settings import Settings, local_pg_dsn


def test_defaults_follow_the_design() -> None:
    s = Settings.from_env({})
    assert s.slice_ranges == 8
    assert s.spark_master == "local[*]"
    assert s.events_writer == "delta-rs"
    assert s.warehouse.name == "warehouse"


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [("ES_PIPELINE_SLICE_RANGES", "eight", "whole number"), ("ES_PIPELINE_EVENTS_WRITER", "parquet", "delta-rs or spark")],
)
def test_a_bad_value_names_the_setting_and_what_it_accepts(name: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        Settings.from_env({name: value})
    assert name in str(err.value) and repr(value) in str(err.value) and expected in str(err.value)


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("ES_PIPELINE_SENSOR_INTERVAL", "soon", "whole number of seconds"),
        ("ES_PIPELINE_SENSOR_INTERVAL", "0", "whole number of seconds"),
        ("ES_PIPELINE_AUTOMATION", "maybe", "on or off"),
        ("ES_PIPELINE_LOCAL_PG_PORT", "post", "TCP port"),
        ("ES_PIPELINE_SLICE_RANGES", "2048", "between 1 and 1024"),
        ("ES_PIPELINE_BATCH_EVENTS", "0", "whole number of events"),
        ("ES_PIPELINE_BATCH_BYTES", "lots", "size in bytes"),
        ("ES_PIPELINE_BATCH_BYTES", "12TB", "size in bytes"),
        ("ES_PIPELINE_BATCH_BYTES", "512", "at least 1MB"),
        ("ES_PIPELINE_JDBC_MIN_ROWS", "-1", "0 (never read over JDBC)"),
        ("ES_PIPELINE_TAIL_SECONDS", "forever", "0 (one pass per run)"),
        ("ES_PIPELINE_REPORT_SECONDS", "7200", "0 (every pass)"),
    ],
)
def test_every_setting_is_validated_when_read(name: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        Settings.from_env({name: value})
    assert name in str(err.value) and expected in str(err.value) and "\n" not in str(err.value)


def test_settings_read_the_values_given() -> None:
    s = Settings.from_env({"ES_PIPELINE_SENSOR_INTERVAL": "2", "ES_PIPELINE_AUTOMATION": "off",
                           "ES_PIPELINE_LOCAL_PG_PORT": "6543", "ES_PIPELINE_EVENTS_WRITER": "spark"})
    assert (s.sensor_interval_seconds, s.automation, s.local_pg_port, s.events_writer) == (2, False, 6543, "spark")
    assert ":6543/" in s.pg_dsn  # the default store is the local server, on its port
    assert (s.jdbc_min_rows, Settings.from_env({"ES_PIPELINE_JDBC_MIN_ROWS": "0"}).jdbc_min_rows) == (None, 0)
    assert (s.tail_seconds, Settings.from_env({"ES_PIPELINE_TAIL_SECONDS": "0"}).tail_seconds) == (300, 0)
    assert (s.report_seconds, Settings.from_env({"ES_PIPELINE_REPORT_SECONDS": "0"}).report_seconds) == (30, 0)


def test_the_sensor_ticks_less_often_by_default_where_runs_tail() -> None:
    """Tailing runs take the commits themselves: the sensor's default tick is 15 s with them, 5 s without;
    a value given is kept either way."""
    assert Settings.from_env({}).sensor_interval_seconds == 30
    assert Settings.from_env({"ES_PIPELINE_TAIL_SECONDS": "0"}).sensor_interval_seconds == 5
    assert Settings.from_env({"ES_PIPELINE_SENSOR_INTERVAL": "3"}).sensor_interval_seconds == 3


@pytest.mark.parametrize(
    ("text", "size"),
    [("536870912", 512 << 20), ("512MB", 512 << 20), ("2GiB", 2 << 30), ("64m", 64 << 20), ("1 G", 1 << 30)],
)
def test_batch_bytes_take_a_unit(text: str, size: int) -> None:
    assert Settings.from_env({"ES_PIPELINE_BATCH_BYTES": text}).batch_bytes == size


def test_the_settings_defaults_are_what_an_empty_environment_gives() -> None:
    from_env = Settings.from_env({"ES_PIPELINE_PG_DSN": "postgresql://h/db", "ES_PIPELINE_WAREHOUSE": "/tmp/w"})
    made = Settings(pg_dsn="postgresql://h/db", warehouse=from_env.warehouse)
    # The catalog's default follows the local server's port, as the store's does: not a field default.
    assert from_env.metastore_dsn == local_pg_dsn(from_env.local_pg_port, "metastore")
    differ = {f: (getattr(made, f), getattr(from_env, f)) for f in made.__dataclass_fields__
              if getattr(made, f) != getattr(from_env, f) and f not in ("pg_dsn_from_env", "metastore_dsn")}
    assert not differ, differ


def test_the_readmes_table_is_the_declarations() -> None:
    """The README's "Settings" table is made from the declarations (`es-pipeline config --markdown`): a setting
    added, removed or reworded in es_pipeline/settings.py and not in the README fails here."""
    from pathlib import Path

    from es_pipeline.settings import markdown_table

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    begin, end = "<!-- settings: made by `es-pipeline config --markdown` -->\n", "<!-- settings: end -->"
    table = readme[readme.index(begin) + len(begin):readme.index(end)]
    assert table == markdown_table(), "README.md's settings table is stale: paste `es-pipeline config --markdown`"


def test_every_declared_setting_is_read_and_shown_from_its_one_declaration() -> None:
    """What each declaration drives: `Settings.from_env` fills its field (a bad value refused in one line naming it
    and what it accepts), and a secret is never shown. The component's side: test_project.py."""
    from es_pipeline.settings import DECLARED, OneOf, Whole, shown

    fields = Settings.__dataclass_fields__
    for setting in DECLARED:
        assert setting.field is None or setting.field in fields, setting.variable
        if isinstance(setting.kind, Whole):
            with pytest.raises(ConfigError) as err:
                Settings.from_env({setting.variable: str(setting.kind.hi + 1)})
            assert setting.variable in str(err.value) and str(setting.kind.hi) in str(err.value)
        if isinstance(setting.kind, OneOf):
            with pytest.raises(ConfigError, match=" or ".join(setting.kind.allowed)):
                Settings.from_env({setting.variable: "nonesuch"})
        if setting.secret and setting.field:
            made = Settings.from_env({setting.variable: "postgresql://u:hunter2@h/db"})
            assert "hunter2" not in shown(setting, made)


def test_config_never_shows_a_spark_connect_token_nor_a_secret() -> None:
    from es_pipeline.settings import BY_VARIABLE, shown

    made = Settings.from_env({"ES_PIPELINE_SPARK_REMOTE": "sc://spark:15002/;token=s3cr3t;use_ssl=true",
                              "ES_PIPELINE_SNAPSHOT_DSN": " postgresql://u:hunter2@h/db "})
    assert shown(BY_VARIABLE["ES_PIPELINE_SPARK_REMOTE"], made) == "sc://spark:15002/;token=(never shown);use_ssl=true"
    assert shown(BY_VARIABLE["ES_PIPELINE_SNAPSHOT_DSN"], made) == "(set; never shown)"
    assert made.snapshot_dsn == " postgresql://u:hunter2@h/db ", "a secret as given: Dagster reads the variable as is"
    assert not Settings.from_env({"ES_PIPELINE_PG_DSN": "  "}).pg_dsn_from_env
