"""Every error es_pipeline raises on purpose is in docs/errors.md, with what to do about it."""

from __future__ import annotations

import inspect

from es_pipeline import errors
from es_pipeline.settings import PROJECT_ROOT


def test_every_error_has_a_row_in_the_errors_table() -> None:
    table = (PROJECT_ROOT / "docs" / "errors.md").read_text()
    named = {name for name, cls in inspect.getmembers(errors, inspect.isclass)
             if issubclass(cls, errors.EsPipelineError) and cls is not errors.EsPipelineError}
    missing = sorted(n for n in named if f"| `{n}` |" not in table)
    assert not missing, f"docs/errors.md has no row for {missing}"
    retryable = {n for n in named if issubclass(getattr(errors, n), errors.Retryable)}
    for name in named:
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        assert row.rstrip(" |").endswith("yes" if name in retryable else "no"), row


def test_a_spark_connect_refusal_for_want_of_a_token_is_explained_in_one_line() -> None:
    from pyspark.errors.exceptions.connect import SparkConnectGrpcException

    refused = SparkConnectGrpcException("[UNAUTHENTICATED] No authentication token provided")
    explained = errors.explain(refused)
    assert isinstance(explained, errors.SparkConnectRefused)
    assert "SPARK_CONNECT_AUTHENTICATE_TOKEN" in str(explained) and "\n" not in str(explained)
