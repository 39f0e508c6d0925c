"""Settings from the environment: defaults, and bad values refused with what to write instead."""

from __future__ import annotations

import pytest

from es_pipeline.errors import ConfigError
from es_pipeline.settings import Settings


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
