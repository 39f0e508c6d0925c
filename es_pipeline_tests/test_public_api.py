"""The public API (es_pipeline/__init__.py): what a team may import is stated, importable, and light."""

import subprocess
import sys

import es_pipeline


def test_every_public_name_is_importable_from_the_package():
    assert sorted(es_pipeline.__all__) == sorted(set(es_pipeline.__all__))
    for name in es_pipeline.__all__:
        assert getattr(es_pipeline, name) is not None, name
    assert es_pipeline.EsPipeline.__module__ == "es_pipeline.component"


def test_a_writer_importing_the_package_loads_neither_dagster_nor_spark():
    code = "import sys, es_pipeline; print(sorted(m for m in ('dagster', 'pyspark') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_public_names_are_the_ones_the_docs_use():
    """docs/writing.md and docs/domain.md import from `es_pipeline` itself, by the names of __all__."""
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    imported = set()
    for page in ("writing.md", "domain.md", "quickstart.md"):
        for names in re.findall(r"^from es_pipeline import (.+)$", (docs / page).read_text(), re.M):
            imported |= {n.strip() for n in names.split(",")}
    assert imported and imported <= set(es_pipeline.__all__), imported - set(es_pipeline.__all__)
