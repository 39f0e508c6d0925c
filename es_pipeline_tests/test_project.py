"""One configuration (es_pipeline/project.py): the command line reads a dg project's EsPipeline attributes as the code
location does, says where each setting came from, and names the attribute the user set when a value is refused."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from es_pipeline import cli
from es_pipeline.domain import load
from es_pipeline.errors import ConfigError, DomainError
from es_pipeline.health.doctor import instance_gaps, recommended_instance_yaml
from es_pipeline.project import configuration, dg_project_root

REPO = Path(__file__).resolve().parents[1]


def _project(tmp: Path, *components: tuple[str, str]) -> Path:
    root = tmp / "lake-project"
    (root / "src" / "team" / "defs").mkdir(parents=True)
    (root / "pyproject.toml").write_text(textwrap.dedent("""\
        [project]
        name = "team"
        [tool.dg]
        directory_type = "project"
        [tool.dg.project]
        root_module = "team"
        """))
    for part in ("src/team/__init__.py", "src/team/defs/__init__.py"):
        (root / part).write_text("")
    for name, body in components:
        folder = root / "src" / "team" / "defs" / name
        folder.mkdir()
        (folder / "defs.yaml").write_text("type: es_pipeline.component.EsPipeline\n" + textwrap.dedent(body))
    return root


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for variable in ("ES_PIPELINE_SLICE_RANGES", "ES_PIPELINE_WAREHOUSE", "ES_PIPELINE_DOMAIN", "ES_PIPELINE_SOURCE",
                     "ES_PIPELINE_ENGINE", "LAKE_FOLDER"):
        monkeypatch.delenv(variable, raising=False)
    # Each test's project is a package `team` of its own folder: another test's, imported by dg's loader, is forgotten.
    for module in [m for m in sys.modules if m == "team" or m.startswith("team.")]:
        monkeypatch.delitem(sys.modules, module)
    return monkeypatch


def test_outside_a_dg_project_the_environment_alone(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("ES_PIPELINE_SLICE_RANGES", "3")
    conf = configuration(cwd=tmp_path)
    assert conf.project is None and conf.component is None
    assert conf.settings.slice_ranges == 3 and conf.source_of("ES_PIPELINE_SLICE_RANGES") == "environment"
    assert conf.source_of("ES_PIPELINE_ENGINE") == "default"


def test_the_components_attributes_are_the_settings_and_say_where_they_came_from(
        tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    root = _project(tmp_path, ("lake", """\
        attributes:
          domain: [team.domain]
          warehouse: lake-files
          slice_ranges: 4
        """))
    clean_env.setenv("ES_PIPELINE_SLICE_RANGES", "8")  # the attribute wins, as in the code location
    conf = configuration(cwd=root / "src" / "team")
    assert conf.project == root.resolve() and conf.component == "src/team/defs/lake/defs.yaml"
    assert conf.settings.slice_ranges == 4
    assert conf.settings.warehouse == root.resolve() / "lake-files"  # relative: to the project's root
    assert conf.settings.domain_modules == ("team.domain",)
    assert conf.source_of("ES_PIPELINE_SLICE_RANGES") == "attribute `slice_ranges` of src/team/defs/lake/defs.yaml"
    assert conf.source_of("ES_PIPELINE_SOURCE") == "default"


def test_a_refused_value_names_the_attribute_not_the_variable(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    root = _project(tmp_path, ("lake", "attributes:\n  slice_ranges: 0\n"))
    with pytest.raises(ConfigError, match=r"attribute `slice_ranges` of src/team/defs/lake/defs.yaml='0'"):
        configuration(cwd=root)
    unknown = _project(tmp_path / "other", ("lake", "attributes:\n  slices: 4\n"))
    with pytest.raises(ConfigError, match="attribute `slices`.*one of domain, warehouse"):
        configuration(cwd=unknown)


def test_a_domain_that_does_not_import_is_the_attributes_fault(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    root = _project(tmp_path, ("lake", "attributes:\n  domain: [no_such_team.domain]\n"))
    settings = configuration(cwd=root).settings
    with pytest.raises(DomainError, match=r"attribute `domain` of src/team/defs/lake/defs.yaml names module "
                                          r"'no_such_team.domain'"):
        load(settings.domain_modules, settings.origin("ES_PIPELINE_DOMAIN"))


def test_several_components_need_a_name(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    root = _project(tmp_path, ("east", "attributes:\n  slice_ranges: 2\n"), ("west", "attributes:\n  slice_ranges: 5\n"))
    with pytest.raises(ConfigError, match="one of east, west: the project has several"):
        configuration(cwd=root)
    assert configuration("west", cwd=root).settings.slice_ranges == 5
    with pytest.raises(ConfigError, match="--component='north'"):
        configuration("north", cwd=root)


def test_a_templated_file_resolves_through_dgs_loader(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    root = _project(tmp_path, ("lake", """\
        attributes:
          warehouse: "{{ env.LAKE_FOLDER }}"
          slice_ranges: 2
        """))
    clean_env.setenv("LAKE_FOLDER", str(tmp_path / "templated-lake"))
    clean_env.syspath_prepend(str(root / "src"))
    conf = configuration(cwd=root)
    assert conf.settings.warehouse == tmp_path / "templated-lake" and conf.settings.slice_ranges == 2


def test_config_prints_each_setting_with_its_source_and_the_partition_keys(
        tmp_path: Path, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    root = _project(tmp_path, ("lake", "attributes:\n  slice_ranges: 4\n"))
    clean_env.chdir(root)
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    assert "(component src/team/defs/lake/defs.yaml)" in out
    assert re.search(r"ES_PIPELINE_SLICE_RANGES\s+4\s+from attribute `slice_ranges`", out)
    assert "0000-0255, 0256-0511, 0512-0767, 0768-1023" in out
    assert "password" not in out.lower() or "never shown" in out


def test_the_dg_project_root_is_found_from_below(tmp_path: Path) -> None:
    root = _project(tmp_path)
    assert dg_project_root(root / "src" / "team" / "defs") == root.resolve()
    assert dg_project_root(REPO) is None  # es_pipeline's own repository is not a dg project


def test_instance_gaps_name_what_the_dagster_yaml_lacks(tmp_path: Path) -> None:
    assert len(instance_gaps(None)) == 2
    assert instance_gaps(REPO) == []  # the repository's own dagster.yaml
    (tmp_path / "dagster.yaml").write_text(recommended_instance_yaml())
    assert instance_gaps(tmp_path) == []
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    assert [g.split(" (")[0] for g in instance_gaps(tmp_path)] == ["tag concurrency per range", "run monitoring"]



def test_doctor_says_what_is_wrong_one_line_each(dsn, empty_dsn: str, tmp_path: Path) -> None:
    from dataclasses import replace

    from es_pipeline.health.doctor import FAIL, OK, diagnose
    from es_pipeline.settings import Settings

    ready = replace(Settings.from_env({"ES_PIPELINE_PG_DSN": str(dsn), "ES_PIPELINE_DOMAIN": "shop.domain"}),
                    warehouse=tmp_path / "lake")
    found = {f.what: f for f in diagnose(ready)}
    assert found["domain"].level == OK and "cart" in found["domain"].line
    assert found["store"].level == OK and found["migrations"].level == OK
    assert found["lake"].level == OK and "no table yet" in found["lake"].line

    behind = replace(ready, pg_dsn=empty_dsn, domain_modules=("no_such_team.domain",))
    found = {f.what: f for f in diagnose(behind)}
    assert found["domain"].level == FAIL and "no_such_team" in found["domain"].line
    assert found["migrations"].level == FAIL and "es-pipeline db migrate" in found["migrations"].line
    for finding in found.values():
        assert "\n" not in finding.line and "password=" not in finding.line


@pytest.mark.parametrize("command", [["config"], ["doctor"], ["materialize"]])
def test_a_misspelled_attribute_of_a_templated_component_is_one_line_naming_it(
    tmp_path: Path, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: list[str],
) -> None:
    root = _project(tmp_path, ("lake", """\
        attributes:
          warehouse: "{{ env.LAKE_FOLDER }}"
          slice_rnages: 4
        """))
    clean_env.setenv("LAKE_FOLDER", str(tmp_path / "lake"))
    clean_env.chdir(root)
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "attribute `slice_rnages`" in err and "slice_ranges" in err, err


@pytest.mark.parametrize("templated", [False, True])
def test_a_mode_attribute_out_of_its_choices_is_one_line_naming_it_and_them(
    tmp_path: Path, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], templated: bool,
) -> None:
    """A mode is a `Literal` in the component's schema (es_pipeline/settings.py declares it once); read by our reader
    (a plain defs.yaml) or by dg's loader (a templated one), a value outside it is refused in one line."""
    body = "attributes:\n  engine: fast\n" + ('  warehouse: "{{ env.LAKE_FOLDER }}"\n' if templated else "")
    clean_env.setenv("LAKE_FOLDER", str(tmp_path / "lake"))
    root = _project(tmp_path, ("lake", body))
    clean_env.syspath_prepend(str(root / "src"))
    clean_env.chdir(root)
    assert cli.main(["config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "engine" in err and "fast" in err, err
    assert all(word in err for word in ("auto", "spark", "local")), err


def test_the_components_attributes_and_template_are_the_declared_ones() -> None:
    """Each declared attribute (es_pipeline/settings.py) is a field of the component with the declared type (a mode a
    `Literal` of its choices) and its variable in its description, and a line of the `dg scaffold` template."""
    import typing

    from es_pipeline.component import TEMPLATE, EsPipeline
    from es_pipeline.settings import ATTRIBUTES, OneOf

    model = EsPipeline.model_fields
    assert set(model) == set(ATTRIBUTES)
    for name, setting in ATTRIBUTES.items():
        assert setting.variable in (model[name].description or "") and f"{name}:" in TEMPLATE
        if isinstance(setting.kind, OneOf):
            assert set(typing.get_args(typing.get_args(model[name].annotation)[0])) == set(setting.kind.allowed)


def test_a_blank_attribute_is_unset_and_a_mode_is_read_trimmed() -> None:
    """`engine: "{{ env('ENGINE', '') }}"` with ENGINE unset leaves the variable or the default in charge, as the
    command line's reader does."""
    from es_pipeline.component import EsPipeline

    assert EsPipeline(engine="").engine is None and EsPipeline(engine=" spark").engine == "spark"
