"""A team's domain: registering reducers, merging two packages' domains, loading them by module name (pure)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from es_pipeline import domain as domains
from es_pipeline.domain import Domain, Event
from es_pipeline.errors import ConfigError, DomainError
from es_pipeline.settings import Settings


def _identity(state: dict[str, Any], event: Event) -> dict[str, Any]:
    return state


def test_two_domains_merge_and_a_stream_type_folded_twice_is_refused_naming_both() -> None:
    a, b = Domain("a"), Domain("b")
    a.reducer("cart", revision=1)(_identity)
    b.reducer("invoice", revision=2)(lambda s, e: s)
    assert Domain.merged([a, b]).revisions() == {"cart": 1, "invoice": 2}
    c = Domain("c")
    c.reducer("cart", revision=1)(lambda s, e: s)
    with pytest.raises(DomainError, match=r"two reducers fold stream type 'cart'.*domain 'a'.*domain 'c'"):
        Domain.merged([a, c])


@pytest.mark.parametrize("revision", [0, 1000, "1", True])
def test_a_revision_is_a_whole_number_from_1_to_999(revision: Any) -> None:
    with pytest.raises(DomainError, match="from 1 to 999"):
        Domain("x").reducer("cart", revision=revision)


def test_modules_are_loaded_by_name_with_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second, empty = (types.ModuleType(n) for n in ("team_a", "team_b", "team_empty"))
    first.domain = Domain("a")  # type: ignore[attr-defined]
    first.domain.reducer("cart", revision=1)(_identity)  # type: ignore[attr-defined]
    second.billing = Domain("b")  # type: ignore[attr-defined]
    second.billing.reducer("invoice", revision=1)(_identity)  # type: ignore[attr-defined]
    for m in (first, second, empty):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    assert domains.load([]) is domains.NO_DOMAIN
    assert domains.load(["team_a"]) is first.domain  # type: ignore[attr-defined]
    assert set(domains.load(["team_a", "team_b:billing"]).reducers) == {"cart", "invoice"}
    with pytest.raises(DomainError, match="holds no Domain"):
        domains.load(["team_empty"])
    with pytest.raises(DomainError, match=r"'team_a:nothing', which is not a Domain"):
        domains.load(["team_a:nothing"])
    with pytest.raises(DomainError, match=r"cannot be imported.*uv pip install -e"):
        domains.load(["no_such_team_package.domain"])


def test_es_pipeline_domain_names_modules() -> None:
    env = {"ES_PIPELINE_DOMAIN": " shop.domain, billing.domain:domain "}
    assert Settings.from_env(env).domain_modules == ("shop.domain", "billing.domain:domain")
    assert Settings.from_env({}).domain_modules == ()
    with pytest.raises(ConfigError, match="ES_PIPELINE_DOMAIN"):
        Settings.from_env({"ES_PIPELINE_DOMAIN": "shop/domain.py"})

